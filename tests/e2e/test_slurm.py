"""examples/launch/slurm.sbatch and slurm_resume.sh on a real SLURM (issue 30 item 1).

``tests/slurm_cluster.py``: Debian's slurmctld and munge here, three slurmd each in a network namespace
of its own (``tests/network.py``), so SLURM sees three hosts with their own addresses, and a node whose
link is cut stops answering SLURM as it would on a cluster. The batch file runs as shipped; the sbatch
command line only overrides what this machine lacks (GPUs, 32 CPUs).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from harness import PACE, ROOT, wait_for, write_config
from oobleck_mm.events import read_events
from oobleck_mm.runtime.worker import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LAUNCH = ROOT / "examples" / "launch"
NODES = ["n0", "n1", "n2"]
NO_GPUS = ["--nodes=3", "--gpus-per-node=0", "--cpus-per-task=1"]
RESUMED_STEPS = 12
"""What the resubmitted job trains after its checkpoint (the test shortens the run to that)."""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    import network
    import slurm_cluster

    why = network.unavailable() or slurm_cluster.unavailable()
    if why is not None:
        pytest.skip(why)
    net = network.Network(NODES)
    try:
        cluster = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"), net)
        try:
            yield cluster
        finally:
            cluster.close()
    finally:
        net.close()


def _env(slurm, **more: str) -> dict[str, str]:
    """The submitting shell's environment, which sbatch exports to the job: where the repository is, the
    master's port (free here), the address agents dial (n0's), the interface gloo binds."""
    port = free_port()
    return {
        **slurm.env,
        **slurm.network.env(),
        "PORT": str(port),
        "MASTER_ADDR": slurm.network.address("n0"),
        "REPO": str(ROOT),
        "AGENT_GRACE": "3",
        "POLL_S": "1",
        **more,
    }


def _steps(run) -> list[dict]:
    path = run / "events.jsonl"
    return read_events(path, "step") if path.exists() else []


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"still running after {timeout:g} s: {out[-3000:]}") from None
    return out


def _what_the_jobs_said(tmp_path: Path, base: Path) -> str:
    """For a failure's message: each job's output (its tail) and how each try's master ended."""
    parts = [f"--- {p.name}:\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(tmp_path.glob("slurm-*.out"))]
    for events in sorted(base.glob("try*/events.jsonl")):
        parts.append(f"--- {events.parent.name} shutdown: {read_events(events, 'shutdown')}")
    return "\n".join(parts)


def test_a_failed_node_is_down_for_slurm_and_planned_out_then_a_notice_checkpoints_and_the_wrapper_resumes(
    slurm, tmp_path
):
    """One job through both things SLURM does to a run (one launch: two took 140 s of CI's 15 minutes):

    1. Node n2's link cut while the job trains: SLURM sets the node DOWN and, with ``--no-kill`` and a step
       per agent, keeps the job; the master plans n2 out and the job trains on the other two. (The batch
       file before ``--no-kill``, tried the same way: SLURM cancelled the job "DUE TO NODE FAILURE" and
       requeued it.) That the recovery itself is exact is asserted by test_partition.py and
       tests/e2e/test_recovery.py.
    2. Then ``scancel --signal=TERM`` (what SLURM's preemption with a GraceTime and the file's
       ``--signal=TERM@120`` send: SIGTERM to every step's tasks, not to the batch script): the agents take
       it as a notice, the master checkpoints the step and exits 3; slurm_resume.sh submits again with
       ``--resume`` from that checkpoint (once n2 is back: the job asks for 3 nodes; the user shortened the
       run in its config meanwhile) and the second job ends with 0. The window from the checkpoint to the final save equals the reference trainer's (float64,
       1e-9)."""
    from oobleck_mm.config import load_config
    from oobleck_mm.verify import compare_windows

    # Enough steps that the job still trains when SLURM sets the node down (idle: ~15 s after the cut; the
    # master's loss 3 s after it, then ~12 steps/s on the other two): SLURM's handling must find it running.
    steps, base, final = 300, tmp_path / "base", tmp_path / "final"
    config = write_config(tmp_path, nodes=3, steps=steps, training={"dtype": "float64"})
    slurm.wait_idle()
    wrapper = subprocess.Popen(
        [
            str(LAUNCH / "slurm_resume.sh"),
            *NO_GPUS,
            f"--output={tmp_path}/slurm-%j.out",
            "--",
            config,
            "--save-final",
            str(final),
        ],
        # Paced (harness.PACE): the job trains through SLURM's ~15 s to set n2 down at 5 steps a second or fewer,
        # not the ~12 a second an idle host's two survivors ran (each step a worker's CPU, for nothing).
        env=_env(slurm, BASE=str(base), OOBLECK_HOLD_AT=PACE),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first = base / "try1"
    try:
        try:
            wait_for(lambda: any(e["step"] >= 2 for e in _steps(first)), 180, "try 1's step 2")
            jobs = subprocess.run(
                ["squeue", "-h", "-o", "%i"], env=slurm.env, capture_output=True, text=True, timeout=20
            ).stdout.split()
            assert len(jobs) == 1, jobs
            slurm.network.cut("n2")
            wait_for(lambda: slurm.node_state("n2").startswith("down"), 60, f"SLURM setting n2 down: {slurm.sinfo()}")
            assert wrapper.poll() is None and not (base / "try2").exists(), "SLURM ended the job with its failed node"
            wait_for(lambda: read_events(first / "events.jsonl", "lost"), 30, "the master finding n2 lost")
            assert max(e["step"] for e in _steps(first)) < steps - 1, (
                "the job had finished before SLURM saw the failure"
            )
            subprocess.run(["scancel", "--signal=TERM", jobs[0]], env=slurm.env, check=True, timeout=20)
            wait_for(lambda: read_events(first / "events.jsonl", "shutdown"), 120, "try 1's master stopping")
            # The user shortens the run before the resubmitted job starts (it waits for n2, still down, and
            # reads the file when its master starts): the resume is checked over a dozen steps, not the
            # hundreds that only made sure try 1 still trained when SLURM acted (each a reference step too).
            raw = yaml.safe_load(Path(config).read_text())
            raw["training"]["steps"] = steps = max(e["step"] for e in _steps(first)) + 1 + RESUMED_STEPS
            Path(config).write_text(yaml.safe_dump(raw))
        finally:
            slurm.network.heal("n2")
            slurm.resume("n2")  # back for try 2 (3 nodes) and the next test
    finally:
        out = _finish(wrapper, 400)
    assert wrapper.returncode == 0, out[-3000:] + _what_the_jobs_said(tmp_path, base)
    events = first / "events.jsonl"
    assert [e["node"] for e in read_events(events, "lost")] == ["n2"]
    assert sorted(read_events(events, "plan_decided")[-1]["nodes"]) == ["n0", "n1"]
    stopped = max(e["step"] for e in _steps(first))
    assert (
        "try 1 stopped with a checkpoint (exit 3)" in out and f"resuming from the newest checkpoint in {first}" in out
    )
    assert stopped < steps and not (base / "try3").exists()
    second = read_events(base / "try2" / "events.jsonl", "step")
    assert second[0]["step"] == stopped + 1 and second[-1]["step"] == steps - 1, (
        stopped,
        second[0],
        second[-1],
    )  # 0-based
    assert sorted(read_events(base / "try2" / "events.jsonl", "plan_decided")[0]["nodes"]) == ["n0", "n1", "n2"]
    [checkpoint] = [m.parent for m in first.glob("**/meta.json")]
    [verdict] = compare_windows(load_config(config), [(str(checkpoint), str(final), steps)], progress=lambda line: None)
    assert verdict.ok and verdict.tolerance == 1e-9, verdict.format()
    assert not subprocess.run(["squeue", "-h"], env=slurm.env, capture_output=True, text=True).stdout.strip()


def test_the_wrapper_stops_on_a_bad_config_with_its_exit_2_and_never_resubmits(slurm, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "configs" / "tiny_mm.yaml").read_text().replace("global_batch: 16", "global_batch: -1"))
    slurm.wait_idle()
    done = subprocess.run(
        [str(LAUNCH / "slurm_resume.sh"), *NO_GPUS, f"--output={tmp_path}/slurm-%j.out", "--", str(bad)],
        env=_env(slurm, BASE=str(tmp_path / "base")),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "try 1 exited 2: not resubmitting" in done.stderr and not (tmp_path / "base" / "try2").exists()
    assert "training.global_batch" in (tmp_path / "base" / "try1" / "master.log").read_text()
