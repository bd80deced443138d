"""Worker processes as the agent sees them: psutil supervision, killing whole trees, dying with the agent.

The worker here is a stand-in that only waits on its pipe (and, for the tree
test, owns a child): what is tested is the agent's handling of real processes
in real states (stopped, killed, orphaned), which does not depend on training.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from oobleck_mm.agent.workers import Worker, stop_all
from oobleck_mm.protocol import oobleck_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


def idle(conn, config_path: str, node: str, local_rank: int) -> None:
    conn.send_bytes(f"{os.getpid()} {node} {local_rank}".encode())
    while True:
        try:
            command = pb.WorkerCommand.FromString(conn.recv_bytes())
        except EOFError:
            return
        if command.WhichOneof("command") == "shutdown":
            return


def still_importing(conn, config_path: str, node: str, local_rank: int) -> None:
    conn.send_bytes(str(os.getpid()).encode())  # started; never says ready nor reads a command
    time.sleep(60)


def idle_with_child(conn, config_path: str, node: str, local_rank: int) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    conn.send_bytes(str(child.pid).encode())
    idle(conn, config_path, node, local_rank)


def eventually(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
    return value


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def worker():
    made = []

    def start(target: str = f"{__name__}:idle") -> Worker:
        made.append(Worker(target, "job.yaml", "nodeX", 3))
        return made[-1]

    yield start
    for w in made:
        w.kill()
        w.close()


def test_supervision_tells_healthy_stopped_and_killed_apart(worker):
    w = worker()
    assert w.conn.poll(20) and w.conn.recv_bytes() == f"{w.pid} nodeX 3".encode()  # the entry passed our args
    assert w.fault() is None
    os.kill(w.pid, signal.SIGSTOP)
    stopped = eventually(w.fault)
    assert (stopped.reason, stopped.kind, stopped.local_rank) == ("worker_stopped", pb.WORKER_STOPPED, 3)
    os.kill(w.pid, signal.SIGCONT)
    eventually(lambda: w.fault() is None)
    os.kill(w.pid, signal.SIGKILL)
    exited = eventually(w.fault)
    assert exited.reason == "worker_exited" and "SIGKILL" in exited.message


def test_shutdown_ends_a_worker_and_kill_takes_its_children(worker):
    w = worker()
    w.conn.poll(20)
    w.conn.recv_bytes()
    w.ready = True  # (the agent's reports thread sets it from the worker's ready report)
    stop_all([w], grace_s=10, shutdown=pb.Shutdown(reason="done"))
    assert w.process.exitcode == 0  # it obeyed the Shutdown: no kill needed
    w2 = worker(f"{__name__}:idle_with_child")
    assert w2.conn.poll(20)
    grandchild = int(w2.conn.recv_bytes())
    assert running(grandchild)
    w2.kill()
    assert w2.process.exitcode == -signal.SIGKILL and not running(grandchild)


def test_a_worker_still_starting_is_killed_at_once_by_a_shutdown(worker):
    # A Ctrl-C while the workers import: waiting out the grace would only delay the end.
    w = worker(f"{__name__}:still_importing")
    assert w.conn.poll(20)
    w.conn.recv_bytes()
    began = time.monotonic()
    stop_all([w], grace_s=30, shutdown=pb.Shutdown(reason="interrupted"))
    assert w.process.exitcode == -signal.SIGKILL
    assert time.monotonic() - began < 15  # not the 30 s grace (the kill itself waits at most 4 s)


def test_a_shared_template_that_does_not_answer_leaves_the_agent_its_own(monkeypatch, worker):
    # local's template gone (or never there): the node starts one of its own and says so, never fails.
    import oobleck_mm.agent.workers as workers_module
    from oobleck_mm.runtime.template import SHARED_TEMPLATE_ENV

    monkeypatch.setenv(SHARED_TEMPLATE_ENV, "/nonexistent/oobleck-template-listener")
    monkeypatch.setattr(workers_module, "_shared", None)
    w = worker()
    assert w.conn.poll(20) and w.conn.recv_bytes() == f"{w.pid} nodeX 3".encode()
    assert workers_module._shared is False
    assert psutil.Process(w.pid).ppid() != os.getpid()  # a fork of this process's own template


def test_workers_die_with_a_killed_agent():
    # A stand-in agent process that starts a worker and then is SIGKILLed: nothing can clean
    # up after it, so the kernel's parent-death signal must.
    script = (
        "import sys; sys.path[:0] = sys.argv[1:]; from oobleck_mm.agent.workers import Worker; "
        f"w = Worker('{__name__}:idle', 'job.yaml', 'n', 0); w.conn.poll(20); w.conn.recv_bytes(); "
        "print(w.pid, flush=True); import time; time.sleep(60)"
    )
    # The stand-in agent finds this module where pytest found it.
    agent = subprocess.Popen([sys.executable, "-c", script, *sys.path], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    started = []
    try:
        pid = int(agent.stdout.readline())
        started = psutil.Process(agent.pid).children(recursive=True)
        assert pid in {p.pid for p in started}
        agent.kill()
        agent.wait()
        eventually(lambda: not running(pid), timeout=3)
    finally:
        for p in started:
            if p.is_running():
                p.kill()
        agent.kill()
        agent.wait()
