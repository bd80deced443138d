"""A node whose network goes away while its processes live on (issue 30 item 2).

The master listens on a bridge; every node is a network namespace of its own with its own address
(``tests/network.py``), so the agents reach the master, and the workers reach each other, only over
veth links. Cutting one link is a partition: nothing is killed, no socket is closed, the node's
processes train on as far as they can. The master must declare it lost by heartbeat timeout, the
survivors must recover and equal the reference, and when the link comes back the isolated node must
come back as a fresh join (its stale workers fenced off by generation), never with the state it had.
"""

from __future__ import annotations

import signal
import time

import pytest

from harness import (
    TIMEOUT_S,
    assert_all_gone,
    send,
    start_master_process,
    wait_event,
    wait_for,
    windows_with_switches,
    write_config,
)
from network import Network, unavailable
from oobleck_mm.events import read_events

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODES = ("node0", "node1", "node2")


@pytest.fixture
def network():
    why = unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
    net = Network(list(NODES))
    yield net
    net.close()


def test_a_slow_link_is_no_loss_and_a_partitioned_node_is_lost_then_back_as_a_fresh_join(
    tmp_path, procs, network, monkeypatch
):
    """One launch, two faults of the network (both on real links, neither kills a process):

    1. node1's link slowed to 8 Mbit/s (both directions, a token bucket) for 4 s: a step moves ~2.9 MB
       through it, so training nearly stops, its peers wait on it, and its heartbeats queue behind its
       transfers (up to 2.0 s late in 2 of 3 tries, under the 3 s timeout): no loss. (The
       peer-confirmed rule at half the timeout declared such a node lost; it is off by default now,
       ``fault_tolerance.confirmed_silence``.)
    2. node2's link cut: lost by heartbeats (a cut link carries no FIN), the others recover; when the
       link is back its agent registers again and the node joins as a new node (its workers receive
       their layers), so the run still equals the reference, window by window.
    3. Then a notice to node1, started with ``--left-exit-code 75`` (the Kubernetes manifest's, whose Job
       never replaces a pod that exits 0): it leaves at a step boundary with 75 while the job goes on.
    """
    from oobleck_mm.config import load_config
    from oobleck_mm.verify import checkpoint_windows, compare_windows

    # Steps enough for all three faults, however fast the survivors train while node2 rejoins (its old worker
    # waits out an 8 s collective timeout first): idle and unpaced they reached step 87 by then on this
    # project's 2-core host on 2026-11-30 (205 on 11-29's faster one, 108 under CI's load), so 240 steps were
    # asked for. Paced at 0.4 s a step (``runtime/hold.py``), no host trains more than 2.5 steps a second, so
    # the rejoin (10 s after the first step, step 9, paced: the notice went at step 28) comes by step ~30
    # however fast the host, and 60 steps leave the notice's generation 30 to train in. Every step past the
    # notice trains (and a judged window replays) for nothing. Windows of 15 steps: each judged one replays 15
    # reference steps.
    final, steps, every = tmp_path / "final", 60, 15
    monkeypatch.setenv("OOBLECK_HOLD_AT", "pace:0.4")  # the agents' environment, their workers'
    config = write_config(
        tmp_path,
        nodes=3,
        steps=steps,
        training={"dtype": "float64"},
        fault_tolerance={"checkpoint_interval": every, "keep_checkpoints": 0},
    )
    master, address, events, token = start_master_process(
        procs, config, tmp_path, "--host", network.master_address, "--save-final", str(final)
    )
    assert address.startswith(network.master_address), address
    agents = {
        node: procs.agent(
            address, node, token, network=network, extra=("--left-exit-code", "75") if node == "node1" else ()
        )
        for node in NODES
    }
    wait_event(events, "step", step=2, timeout=120)
    for agent, _ in agents.values():
        procs.remember(agent.pid)

    # 1. a slow link
    slowed_at = time.time()
    network.throttle("node1", kbit=8000)
    try:
        time.sleep(4.0)
        assert network.throttled_packets("node1") > 0, "the link was never slow"
    finally:
        network.unthrottle("node1")
    before = max(e["step"] for e in read_events(events, "step"))
    wait_event(events, "step", step=before + 3, timeout=60)  # trains at full speed again
    late = [e["gap_s"] for e in read_events(events, "heartbeat_late") if e["ts"] >= slowed_at]
    assert read_events(events, "lost") == [], f"a slow link is no loss (heartbeats late by {late} s)"

    # 2. a partition
    isolated = procs.remember(agents["node2"][0].pid)
    cut_at = time.time()
    network.cut("node2")
    try:
        lost = wait_event(events, "lost", node="node2", timeout=4 * TIMEOUT_S + 20)
        # No FIN crosses a cut link, so the stream stays open: only the missing heartbeats find it.
        assert lost["reason"] == "heartbeat_timeout", lost
        assert lost["ts"] - cut_at < TIMEOUT_S + 2.0, f"found {lost['ts'] - cut_at:.1f} s after the cut"
        recovered = wait_event(events, "plan_decided", generation=lost["generation"] + 1, timeout=60)
        assert "node2" not in recovered["nodes"], recovered
        wait_event(events, "step", generation=recovered["generation"], timeout=60)  # the survivors train on
        assert isolated[0].is_running(), "a partition kills nothing: node2's agent lives on"
    finally:
        network.heal("node2")
    back = wait_for(
        lambda: [
            e
            for e in read_events(events, "plan_decided")
            if e["generation"] > lost["generation"] and "node2" in e["joined"]
        ],
        120,
        "node2 joining again",
    )
    wait_event(events, "step", generation=back[0]["generation"], timeout=60)

    # 3. a notice, and the exit code a Kubernetes Job replaces
    assert max(e["step"] for e in read_events(events, "step")) < steps - 20, "too few steps left for a notice"
    send(agents["node1"][0], signal.SIGTERM)
    assert agents["node1"][0].wait(60) == 75, agents["node1"][1].read_text()[-2000:]
    assert master.wait(300) == 0, agents["node2"][1].read_text()[-3000:]
    for node in ("node0", "node2"):
        assert agents[node][0].wait(30) == 0, f"{node}: {agents[node][1].read_text()[-2000:]}"
    assert sorted(read_events(events, "plan_decided")[-1]["nodes"]) == ["node0", "node2"]
    assert [e["node"] for e in read_events(events, "lost")] == ["node2"]  # the leave was no loss
    assert back[0]["generation"] >= lost["generation"] + 2  # planned out, then in again
    # Its registration named the generation its workers ran, and was not taken as an adoption: the node
    # joined as new, and its agent said so.
    again = [e for e in read_events(events, "registered") if e["node"] == "node2" and e["ts"] > cut_at]
    assert again and again[0]["adopt_generation"] == lost["generation"] and again[0]["spare"], again
    assert "joins as a new node" in agents["node2"][1].read_text()
    # Fenced: had node2's workers kept the state they trained on alone, the windows after the cut would
    # differ from the reference.
    job = load_config(config)
    windows = checkpoint_windows(str(tmp_path / "run" / "checkpoints"), str(final))
    # Windows from the start to the final save, contiguous, so the ones spanning the cut and the rejoin are
    # compared. Not every periodic checkpoint need be there: a notice whose switch lands on a checkpoint
    # step can leave that one without meta.json (seen once in CI: step 110, the leaving worker gone before
    # its background share was reported; an open gap, not what this test is about). Judged: the windows the
    # switches (the loss, the rejoin, the leave) trained in, and the last (``windows_with_switches``).
    steps_at = [w[2] for w in windows]
    assert windows[0][0] is None and steps_at[0] == every and steps_at[-2:] == [steps, steps], windows
    # A periodic checkpoint the switch found without a leaver's share is made up after the next generation's
    # first step (``checkpoint_cut_short``), even when the leaver's share arrives after all (seen once: the
    # checkpoints of steps 30 and 32 both complete).
    made_up = {
        r["step"] + 1
        for cut in read_events(events, "checkpoint_cut_short")
        for r in read_events(events, "resumed")
        if r["generation"] == cut["generation"]
    }
    assert set(steps_at) <= set(range(every, steps + 1, every)) | made_up and len(steps_at) >= 5, windows
    # (Where the switches land depends on the host's speed: on a fast one they fell in every window once,
    # steps 0, 6, 28 and 30 of 60 with a checkpoint every 15, and every window was judged.)
    judged = windows_with_switches(windows, events)
    verdicts = compare_windows(job, judged, progress=lambda line: None)
    assert all(v.ok and v.tolerance == 1e-9 for v in verdicts), [v.format() for v in verdicts]
    assert_all_gone(isolated, 30)
