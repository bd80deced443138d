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

from agent.workers import Worker, stop_all
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
    stop_all([w], grace_s=10, shutdown=pb.Shutdown(reason="done"))
    assert w.process.exitcode == 0  # it obeyed the Shutdown: no kill needed
    w2 = worker(f"{__name__}:idle_with_child")
    assert w2.conn.poll(20)
    grandchild = int(w2.conn.recv_bytes())
    assert running(grandchild)
    w2.kill()
    assert w2.process.exitcode == -signal.SIGKILL and not running(grandchild)


def test_workers_die_with_a_killed_agent():
    # A stand-in agent process that starts a worker and then is SIGKILLed: nothing can clean
    # up after it, so the kernel's parent-death signal must.
    script = (
        "import sys; sys.path[:0] = sys.argv[1:]; from agent.workers import Worker; "
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


def test_an_agent_removes_the_folders_of_agents_that_are_gone(tmp_path):
    from agent.agent import remove_stale_work_dirs

    for name in ("oobleck-agent-node1-111-abc", "oobleck-agent-my-node-222-def", "oobleck-agent-node2-333-ghi",
                 "oobleck-agent-odd", "other-111-xyz"):  # fmt: skip
        (tmp_path / name).mkdir()
    removed = remove_stale_work_dirs(str(tmp_path), pid_alive=lambda pid: pid == 333)
    assert sorted(os.path.basename(p) for p in removed) == ["oobleck-agent-my-node-222-def", "oobleck-agent-node1-111-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["oobleck-agent-node2-333-ghi", "oobleck-agent-odd",
                                                           "other-111-xyz"]  # fmt: skip


def test_torchrun_environment_names_the_generation_a_worker_runs_in():
    from oobleck_mm.runtime.group import TORCHRUN_VARIABLES, torchrun_environment

    env = torchrun_environment(5, 8, 1, "nodeB", ["nodeA"] * 4 + ["nodeB"] * 3 + ["nodeC"], "10.0.0.1", 29500)
    assert tuple(env) == TORCHRUN_VARIABLES
    assert env == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "3",
                   "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip


def test_only_commands_that_mean_a_peer_is_gone_interrupt_the_iteration_in_flight():
    """A checkpoint with every rank alive (a stop on request, nodes leaving on notice) and MasterLost wait for
    the boundary every rank reaches together; interrupting would leave ranks on either side of the update."""
    from oobleck_mm.runtime.agent_worker import _drops_peers

    assert _drops_peers(pb.WorkerCommand(checkpoint=pb.Checkpoint(dir="d", generation=2, surviving_ranks=[0])))
    assert not _drops_peers(pb.WorkerCommand(checkpoint=pb.Checkpoint(dir="d", generation=2, at_boundary=True)))
    assert not _drops_peers(pb.WorkerCommand(master_lost=pb.MasterLost(reason="gone")))
    assert _drops_peers(pb.WorkerCommand(shutdown=pb.Shutdown(reason="done")))


def test_a_plan_whose_groups_form_in_the_background_is_not_switched_to_before_they_are_ready():
    """The step's "I hold a command" waits for the next generation's groups (the old one trains on), unless
    another command came after it; what was prepared is handed over once; a failing preparation only costs
    the optimisation, never the command."""
    import multiprocessing as mp
    import threading
    import time

    from oobleck_mm.protocol.pipe import send_command
    from oobleck_mm.runtime.agent_worker import CommandReader

    class Forming:  # stands for runtime.group.PreparedGroup, formed by peers in the real runs
        def __init__(self):
            self.done = threading.Event()

        def ready(self):
            return self.done.is_set()

    forming = Forming()

    def on_arrival(command):
        if command.assignment.generation == 3:
            raise RuntimeError("no plan to prepare")
        return forming if command.assignment.at_boundary else None

    ours, agents = mp.Pipe()
    reader = CommandReader(ours, on_arrival=on_arrival)

    def arrive(command, expect_queued: int):
        send_command(agents, command)
        deadline = time.monotonic() + 10
        while reader.queue.qsize() < expect_queued and time.monotonic() < deadline:
            time.sleep(0.005)

    join = pb.WorkerCommand(assignment=pb.Assignment(generation=2, previous_generation=1, at_boundary=True))
    arrive(join, 1)
    assert not reader.waiting()  # its groups are still forming: the old generation steps on
    forming.done.set()
    assert reader.waiting()
    taken = reader.get()
    assert reader.prepared_for(taken) is forming and reader.prepared_for(taken) is None
    forming.done.clear()
    arrive(pb.WorkerCommand(assignment=pb.Assignment(generation=4, previous_generation=3, at_boundary=True)), 1)
    assert not reader.waiting()
    arrive(pb.WorkerCommand(shutdown=pb.Shutdown(reason="done")), 2)
    assert reader.waiting()  # a later command is not held back by the forming groups
    reader.get(), reader.get()
    arrive(pb.WorkerCommand(assignment=pb.Assignment(generation=3, previous_generation=2, at_boundary=True)), 1)
    assert reader.waiting() and reader.prepared_for(reader.get()) is None  # on_arrival raised: a plain switch
    agents.close()
