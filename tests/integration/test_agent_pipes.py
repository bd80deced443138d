"""The agent's workers' pipes (``oobleck_mm.agent.pipes``): no interleaving of a worker's replacement and the reports
thread's read can end that thread (issue 55), and a failure of the thread stops the node, never silences it.

The race of issue 55: the main thread killed the workers (restart-mode recovery) and closed
their pipes while the reports thread was inside ``recv_bytes`` (past its check that the pipe
is open, before it read the handle); the read raised ``TypeError`` and the thread died. The
first test puts the agent's own main-thread code exactly there, with real worker processes
(on the code before the fix, the reader dies and the fresh worker's reports never arrive);
the last runs random orders of starts, reports, exits and retirements (``hypothesis``) on
real OS pipes, some of them between the reader's ``wait`` and its read.
"""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as real_wait

from hypothesis import given, settings
from hypothesis import strategies as st

import oobleck_mm.agent.pipes as pipes
from oobleck_mm.agent.agent import Agent
from oobleck_mm.agent.options import AgentOptions
from oobleck_mm.agent.pipes import ReportPipes
from oobleck_mm.protocol import oobleck_pb2 as pb


def chatty(conn, config_path: str, node: str, local_rank: int) -> None:
    """A worker that says ready, reports a step every 20 ms and obeys nothing (the agent kills it)."""
    conn.send_bytes(pb.WorkerReport(ready=pb.WorkerReady()).SerializeToString())
    step = 0
    while True:
        conn.send_bytes(pb.WorkerReport(metrics=pb.StepMetrics(generation=1, step=step)).SerializeToString())
        step += 1
        time.sleep(0.02)


def garbled(conn, config_path: str, node: str, local_rank: int) -> None:
    conn.send_bytes(b"\xff\xff\xff")  # not a WorkerReport
    time.sleep(60)


def test_killing_the_workers_while_the_reader_reads_their_pipe_leaves_the_reader_running(monkeypatch):
    agent = Agent(AgentOptions(master="127.0.0.1:1", token="t", node="nodeX", worker_target=f"{__name__}:chatty"))
    agent.config_path = "job.yaml"
    agent.ref = pb.NodeRef(node="nodeX", session=7)
    forwarded: list[tuple[int, int]] = []  # (worker pid, step)
    monkeypatch.setattr(agent, "_forward", lambda w, report: forwarded.append((w.pid, report.metrics.step)))
    raced = threading.Event()
    watched: set[int] = set()
    read = Connection._recv_bytes

    def restart_then_read(conn, maxsize=None):
        if id(conn) in watched and not raced.is_set():
            raced.set()
            # The main thread's restart-mode recovery lands inside the read (after recv_bytes checked the
            # pipe open, before it reads the handle): it kills and forgets the node's workers.
            main = threading.Thread(target=agent._kill_workers)
            main.start()
            main.join()
        return read(conn, maxsize)

    monkeypatch.setattr(Connection, "_recv_bytes", restart_then_read)
    failures: list[BaseException] = []
    reader = threading.Thread(target=agent._pipes.run, args=(agent._stopping, failures.append), daemon=True)
    try:
        old = agent._start_worker(0)
        watched.add(id(old.conn))
        reader.start()
        assert raced.wait(60), "the reader never read the worker's pipe"
        fresh = agent._start_worker(0)  # the next assignment starts a fresh worker
        deadline = time.monotonic() + 60
        while not any(pid == fresh.pid for pid, _ in forwarded):
            assert time.monotonic() < deadline, "no report of the fresh worker reached the master"
            assert reader.is_alive() and not failures, f"the reports thread died: {failures}"
            time.sleep(0.02)
        assert reader.is_alive() and not failures
        assert all(kind != "fatal" for kind, _ in _drain(agent.inbox))
        assert old.conn.closed, "the reader closes a retired worker's pipe at its next turn"
    finally:
        agent._stopping.set()
        if reader.ident:
            reader.join(5)
        agent._kill_workers()
        agent._pipes.close_all()


def test_a_failure_of_the_reports_thread_stops_the_node_as_a_fault():
    agent = Agent(AgentOptions(master="127.0.0.1:1", token="t", node="nodeX", worker_target=f"{__name__}:garbled"))
    agent.config_path = "job.yaml"
    agent.ref = pb.NodeRef(node="nodeX", session=7)
    reader = threading.Thread(target=agent._pipes.run, args=(agent._stopping, agent._on_reader_failure), daemon=True)
    try:
        agent._start_worker(0)
        reader.start()
        kind, (session, message) = agent.inbox.get(timeout=60)
        assert (kind, session) == ("fatal", 7) and "reports thread failed" in message and "DecodeError" in message
        reader.join(5)
        assert not reader.is_alive()
    finally:
        agent._stopping.set()
        agent._kill_workers()
        agent._pipes.close_all()


def _drain(q):
    out = []
    while not q.empty():
        out.append(q.get())
    return out


# ---------------------------------------------------------------------- any order, real pipes
class End:
    """The agent's end of one worker's pipe (``ReportPipes`` reads ``conn`` and sets ``eof``)."""

    def __init__(self, uid: int) -> None:
        self.uid = uid
        self.conn, self.child = Pipe(duplex=True)
        self.eof = False
        self.sent = 0
        self.exited = False


ACTIONS = st.lists(
    st.tuples(st.sampled_from(["start", "report", "exit", "retire"]), st.integers(0, 3), st.booleans()), max_size=40
)
"""(what, which worker, whether it lands between the reader's wait and its read)."""


@settings(max_examples=300, deadline=None)
@given(ACTIONS)
def test_no_order_of_starts_reports_exits_and_retirements_fails_the_reader(actions):
    delivered: list[tuple[int, int]] = []
    eofs: list[int] = []
    reader = ReportPipes(lambda w, data: delivered.append((w.uid, int(data))), lambda w: eofs.append(w.uid))
    ends: dict[int, End] = {}
    retired: list[End] = []
    made: list[End] = []
    in_window = [a for a in actions if a[2]]

    def act(what: str, which: int) -> None:
        end = ends.get(which)
        if what == "start" and end is None:
            ends[which] = end = End(len(made))
            made.append(end)
            reader.watch(end)
        elif what == "report" and end is not None and not end.exited:
            end.child.send_bytes(str(end.sent).encode())
            end.sent += 1
        elif what == "exit" and end is not None and not end.exited:
            end.child.close()
            end.exited = True
        elif what == "retire" and end is not None:
            reader.retire([end])
            retired.append(ends.pop(which))

    def wait_with_action(conns, timeout=None):
        ready = real_wait(conns, timeout)
        if in_window:
            act(*in_window.pop(0)[:2])
        return ready

    original = pipes.wait_connections
    pipes.wait_connections = wait_with_action
    try:
        for what, which, windowed in actions:
            if not windowed:
                act(what, which)
            reader.read_once(0)
        while in_window:
            act(*in_window.pop(0)[:2])
        for _ in range(3 * len(actions) + 3):  # read what is left
            reader.read_once(0)
    finally:
        pipes.wait_connections = original
    # Every report of a worker never retired came, once, in order; every exit of one was seen.
    for end in ends.values():
        assert [n for uid, n in delivered if uid == end.uid] == list(range(end.sent))
        assert (end.uid in eofs) == end.exited
    # What was retired is closed by the reader; nothing it read came from a closed pipe.
    assert all(end.conn.closed for end in retired)
    for end in made:
        if not end.conn.closed:
            end.conn.close()
        if not end.exited:
            end.child.close()
