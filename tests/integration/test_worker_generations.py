"""The agent-started worker across generations, driven over its real pipe by this test (playing the master).

Real worker processes, a real SIGKILL in the middle of training: survivors
abandon the iteration, re-form in generation 2 from the plan the test sends,
copy the layer states they lack and finish with the failure-free parameters.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import yaml

from oobleck_mm.master.store import serve_store_only
from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.protocol.convert import plan_to_proto
from oobleck_mm.protocol.pipe import recv_report, send_command
from oobleck_mm.runtime.template import warm_process
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout
from oobleck_mm.runtime.agent_worker import worker_main
from oobleck_mm.verify import compare

pytestmark = pytest.mark.integration
STEPS = 5


TOKEN = "test-token"


def assignment(gen, rank, plan, port, previous=None, previous_ranks=(), save_final="", steps=STEPS):
    a = pb.Assignment(
        generation=gen,
        rank=rank,
        world_size=plan.world_size,
        store_host="127.0.0.1",
        store_port=port,
        store_token=TOKEN,
        start_step=0,
        steps=steps,
        plan=plan_to_proto(plan),
        save_final_dir=save_final,
    )
    if previous is not None:
        a.previous_generation = gen - 1
        a.previous_plan.CopyFrom(plan_to_proto(previous))
        a.previous_ranks.extend(previous_ranks)
    return pb.WorkerCommand(assignment=a)


def reports_until(conn, predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        if conn.poll(0.1):
            report = recv_report(conn)
            seen.append(report)
            if predicate(report):
                return seen
    raise AssertionError(f"timed out; saw {[r.WhichOneof('report') for r in seen]}")


def job_config(tmp_path):
    """tiny_mm in float64 with the e2e tests' heartbeats (stalls reported after 2 x 200 ms)."""
    with open("configs/tiny_mm.yaml") as f:
        d = yaml.safe_load(f)
    d["training"].update(dtype="float64", steps=STEPS)
    d["fault_tolerance"].update(heartbeat_interval="200ms", heartbeat_timeout="3s")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(d))
    return config


def start_workers(config, count, pipes, procs):
    """``count`` agent-style workers (node0..), their pipes and processes appended to ``pipes``/``procs``."""
    for rank in range(count):  # forks of the warm template, as an agent starts its workers
        parent, child = mp.Pipe()
        p = warm_process(worker_main, child, str(config), f"node{rank}", 0)
        p.start()
        pipes.append(parent)
        procs.append(p)


def _verify_catches_a_changed_moment_and_a_flipped_byte(job, final, tmp_path) -> None:
    """Issue 54 item 2: ``verify`` compared parameters only. A float64 run whose Adam moment is off (the
    checkpoint consistent, its sha256 recorded anew) now fails on that moment; flipped bytes fail the
    manifest (the sha256 its writer recorded), as ``--resume`` and ``export`` do."""
    import hashlib
    import json
    import shutil

    import torch

    from oobleck_mm.errors import UserError

    def moments(path):
        payload = torch.load(path, weights_only=True)
        keys = [
            k for k in (payload["optimizer"] or {}) if "exp_avg_sq" in k and payload["optimizer"][k].abs().max() > 0
        ]
        return payload, keys

    name = next(p.stem for p in sorted((final / "layers").glob("*.pt")) if moments(p)[1])
    moved = tmp_path / "moment-off"
    shutil.copytree(final, moved)
    path = moved / "layers" / f"{name}.pt"
    payload, keys = moments(path)
    key = max(keys, key=lambda k: payload["optimizer"][k].abs().max().item())  # the layer's largest: 1e-3 of it
    payload["optimizer"][key] = payload["optimizer"][key] * (1 + 1e-3)
    torch.save(payload, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_suffix(".sha256").write_text(digest)
    meta = json.loads((moved / "meta.json").read_text())  # a consistent checkpoint, only its moment off
    meta["layer_sha256"][name], meta["layer_bytes"][name] = digest, path.stat().st_size
    (moved / "meta.json").write_text(json.dumps(meta))
    verdict = compare(job, STEPS, str(moved), progress=lambda line: None)
    assert not verdict.ok and verdict.worst.name == name and "exp_avg_sq" in verdict.worst.worst_tensor, (
        verdict.format()
    )
    flipped = tmp_path / "flipped"
    shutil.copytree(final, flipped)
    path = flipped / "layers" / f"{name}.pt"
    data = bytearray(path.read_bytes())
    data[-200:-100] = bytes(b ^ 0xFF for b in data[-200:-100])
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="sha256"):
        compare(job, STEPS, str(flipped), progress=lambda line: None)


def test_killed_worker_survivors_reform_and_match_reference(tmp_path):
    config = job_config(tmp_path)
    store, port = serve_store_only(TOKEN)  # the master's rendezvous store, alone: the test plays the master
    gen1 = ExecutionPlan.even(10, [2, 2], [4, 4], 2)  # ranks 0,1 | 2,3
    pipes, procs = [], []
    try:
        start_workers(config, 4, pipes, procs)
        for rank, conn in enumerate(pipes):
            send_command(conn, assignment(1, rank, gen1, port))
        # let step 1 complete everywhere, then kill rank 3 (last stage of pipeline 1)
        for conn in pipes:
            reports_until(conn, lambda r: r.WhichOneof("report") == "metrics" and r.metrics.step == 1)
        os.kill(procs[3].pid, signal.SIGKILL)
        started = time.monotonic()
        time.sleep(1.0)  # the master's detection (heartbeat timeout 1 s; a killed agent's stream closes at once)
        # generation 2: rank 2 alone is a 1-stage pipeline and needs layers 5-9 from rank 1
        gen2 = ExecutionPlan(
            (
                PipelineLayout((StageLayout(0, 0, 5), StageLayout(1, 5, 10)), 5),
                PipelineLayout((StageLayout(2, 0, 10),), 3),
            ),
            10,
            2,
        )
        final = tmp_path / "final"
        for rank in range(3):
            send_command(
                pipes[rank],
                assignment(2, rank, gen2, port, previous=gen1, previous_ranks=[0, 1, 2], save_final=str(final)),
            )
        aborted = {}
        for rank in range(3):
            seen = reports_until(
                pipes[rank], lambda r: r.WhichOneof("report") == "phase" and r.phase.phase == "aborted"
            )
            aborted[rank] = seen[-1].phase.step
        unblocked_s = time.monotonic() - started
        # The new plan interrupts the survivors' waits; what may not be interrupted (a gloo point-to-point
        # wait) ends within the collective timeout's margin over the heartbeat timeout the test waited.
        from oobleck_mm.config.fault_tolerance import COLLECTIVE_TIMEOUT_MARGIN

        bound = 1.0 + COLLECTIVE_TIMEOUT_MARGIN.total_seconds() + 0.5
        assert unblocked_s < bound, f"survivors took {unblocked_s:.1f} s to give up the iteration (bound {bound} s)"
        phases = {}
        for rank in range(3):
            seen = reports_until(pipes[rank], lambda r: r.WhichOneof("report") == "done")
            phases[rank] = [r.phase.phase for r in seen if r.WhichOneof("report") == "phase"]
            steps = [r.metrics.step for r in seen if r.WhichOneof("report") == "metrics"]
            assert steps == list(range(min(aborted.values()), STEPS)), (rank, steps, aborted)
        assert all(p == ["rendezvous", "states_copied", "resumed"] for p in phases.values()), phases
        for conn in pipes[:3]:
            send_command(conn, pb.WorkerCommand(shutdown=pb.Shutdown(reason="done")))
        for p in procs:
            p.join(20)
        assert [p.exitcode for p in procs[:3]] == [0, 0, 0]
        from oobleck_mm.config import load_config

        verdict = compare(load_config(config), STEPS, str(final), progress=lambda line: None)
        assert verdict.worst.abs_diff < 1e-9 and verdict.ok and verdict.tolerance == 1e-9, verdict.format()
        hashes = [yaml.safe_load((final / "replicas" / f"rank{r}.json").read_text()) for r in range(3)]
        for layer in hashes[2]:  # rank 2 holds every layer; each replica must be identical
            assert all(h[layer] == hashes[2][layer] for h in hashes if layer in h)
        _verify_catches_a_changed_moment_and_a_flipped_byte(load_config(config), final, tmp_path)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        store.stop(grace=0)


def test_a_last_collective_completed_on_some_ranks_only_is_settled_at_the_next_generation(tmp_path, monkeypatch):
    """Step 0's last collective (the gradient norm) ends on ranks 0-2 and not on rank 3.

    Rank 0 holds before that collective (``reduce`` hold point); rank 3, waiting inside it, is sent
    a re-formed generation 2 (the master re-planned), so it gives up there, its gradients reduced,
    while its gloo thread still finishes the collective for the others, who apply step 0. They are
    re-planned in turn during step 1. Generation 2 starts with survivors one step apart: rank 3
    applies step 0's update from the others' norm, and the run ends equal to the reference. Before,
    the workers stopped the job: "survivors disagree on the step to resume: 0 vs 1".
    """
    config = job_config(tmp_path)
    monkeypatch.setenv("OOBLECK_HOLD_AT", "reduce@node0:4")  # the workers inherit it
    store, port = serve_store_only(TOKEN)
    plan = ExecutionPlan.even(10, [2, 2], [4, 4], 2)  # ranks 0,1 | 2,3; every rank in the last collective
    final = tmp_path / "final"
    pipes, procs = [], []
    try:
        start_workers(config, 4, pipes, procs)
        for rank, conn in enumerate(pipes):
            send_command(conn, assignment(1, rank, plan, port))
        reports_until(pipes[0], lambda r: r.WhichOneof("report") == "phase" and r.phase.phase == "holding")
        reports_until(pipes[3], lambda r: r.WhichOneof("report") == "stalled" and "gradient-norm" in r.stalled.what)
        again = [
            assignment(2, rank, plan, port, previous=plan, previous_ranks=[0, 1, 2, 3], save_final=str(final))
            for rank in range(4)
        ]
        send_command(pipes[3], again[3])  # the master re-planned: rank 3 gives up inside the collective
        seen3 = reports_until(pipes[3], lambda r: r.WhichOneof("report") == "phase" and r.phase.phase == "aborted")
        assert seen3[-1].phase.step == 0 and "re-planned" in seen3[-1].phase.message, seen3[-1].phase
        for rank in range(3):  # rank 0's hold ends: the collective completes on ranks 0-2, who apply step 0
            reports_until(pipes[rank], lambda r: r.WhichOneof("report") == "metrics" and r.metrics.step == 0)
        for rank in range(3):
            send_command(pipes[rank], again[rank])
        steps, phases = {}, {}
        for rank in range(4):
            seen = reports_until(pipes[rank], lambda r: r.WhichOneof("report") in ("done", "failed"))
            assert seen[-1].WhichOneof("report") == "done", seen[-1]
            steps[rank] = [r.metrics.step for r in seen if r.WhichOneof("report") == "metrics"]
            phases[rank] = [(r.phase.phase, r.phase.step) for r in seen if r.WhichOneof("report") == "phase"]
        assert all(steps[rank] == list(range(1, STEPS)) for rank in range(4)), steps
        assert ("settled", 0) in phases[3] and not any(p == "settled" for p, _ in phases[0] + phases[1] + phases[2])
        for conn in pipes:
            send_command(conn, pb.WorkerCommand(shutdown=pb.Shutdown(reason="done")))
        for p in procs:
            p.join(20)
        from oobleck_mm.config import load_config

        verdict = compare(load_config(config), STEPS, str(final), progress=lambda line: None)
        assert verdict.worst.abs_diff < 1e-9 and verdict.ok, verdict.format()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        store.stop(grace=0)
