"""Metrics people read: the step row built from ranks' reports, the console line and its ETA,
metrics.csv and TensorBoard files (read back with tensorboard's own event reader)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from oobleck_mm.master.metrics import COLUMNS, MetricsSink
from oobleck_mm.master.progress import Progress, StepFacts, format_duration, format_step, step_row
from oobleck_mm.master.recovery import GenerationView
from oobleck_mm.config import load_config
from oobleck_mm.config.shape import layer_specs, matmul_param_count
from oobleck_mm.events import EventLog, read_events
from oobleck_mm.planning.layout import ExecutionPlan, PipelineLayout, StageLayout
from oobleck_mm.profiling.analytical import model_flops_per_sample
from oobleck_mm.protocol import oobleck_pb2 as pb

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# Two pipelines of different depths: ranks 0,1,2 (3 stages) and 3,4 (2 stages), on 5 nodes.
LAYOUT = ExecutionPlan(
    pipelines=(
        PipelineLayout((StageLayout(0, 0, 4), StageLayout(1, 4, 7), StageLayout(2, 7, 10)), 4),
        PipelineLayout((StageLayout(3, 0, 6), StageLayout(4, 6, 10)), 4),
    ),
    num_layers=10,
    microbatch_size=2,
)
GEN = GenerationView(2, LAYOUT, {(f"node{r}", 0): r for r in range(5)})
FACTS = StepFacts(global_batch=16, flops_per_sample=1e9, peak_flops=1e11, balancer=True)


def reports(step: int = 4) -> list[pb.StepMetrics]:
    pipeline_s = [0.30, 0.25, 0.20, 0.10, 0.40]  # pipeline 0's slowest stage 0.30, pipeline 1's 0.40
    return [
        pb.StepMetrics(
            generation=2,
            step=step,
            rank=r,
            loss=2.5,
            lr=3e-4,
            grad_norm=1.25,
            tokens=4000,
            step_time_s=0.5 + 0.1 * (r == 3),
            pipeline_s=pipeline_s[r],
            peak_memory_bytes=(r + 1) * 2**20,
            predicted_max_s=0.35,
            predicted_mean_s=0.33,
            predicted_contiguous_max_s=0.45,
        )
        for r in range(5)
    ]


def test_step_row_takes_the_slowest_rank_and_each_pipelines_slowest_stage():
    row = step_row(GEN, 4, reports(), FACTS)
    assert row["step_time_s"] == pytest.approx(0.6)  # rank 3 was slowest: the step lasted that long
    assert row["samples_per_s"] == pytest.approx(16 / 0.6)
    assert row["tokens_per_s"] == pytest.approx(4000 / 0.6)
    assert row["measured_max_s"] == pytest.approx(0.40) and row["measured_mean_s"] == pytest.approx(0.35)
    assert row["mfu"] == pytest.approx(1e9 * 16 / 0.6 / (1e11 * 5))  # every GPU of the generation
    assert (row["live_nodes"], row["gpus"], row["pipelines"], row["generation"]) == (5, 5, 2, 2)
    assert row["peak_memory_mb"] == pytest.approx(5.0)  # the largest worker's
    assert (row["loss"], row["lr"], row["grad_norm"]) == (2.5, 3e-4, 1.25)
    assert (row["predicted_max_s"], row["predicted_contiguous_max_s"]) == (0.35, 0.45)
    assert row["prediction_error"] == pytest.approx(0.40 / 0.35 - 1)  # the slowest measured over the predicted


def test_an_emulated_steps_row_sums_its_ranks_ops_and_host_cpu_and_judges_them():
    """An emulated step's row (``emulated_*``): its ranks' ops and late ops summed, the worst lateness, and the
    workers' CPU seconds, all of them and the busiest rank's: what the run's verdict reads (``validity.judge``)."""
    from oobleck_mm.emulation.validity import judge

    def emulated(step):
        out = reports(step)
        for r in out:
            r.emulated_ops, r.emulated_late_ops, r.emulated_s = 10, int(r.rank == 2), 0.4
            r.emulated_worst_lateness, r.host_cpu_s = 0.1 * r.rank, 0.2 + 0.1 * r.rank
        return out

    row = step_row(GEN, 4, emulated(4), FACTS)
    assert (row["emulated_ops"], row["emulated_late_ops"]) == (50, 1) and row["emulated_late_ranks"] == {"2": 1}
    assert row["emulated_worst_lateness"] == pytest.approx(0.4)
    assert row["emulated_host_cpu_s"] == pytest.approx(2.0) and row["emulated_busiest_rank_cpu_s"] == pytest.approx(0.6)
    assert "emulated_host_cpu_s" not in step_row(GEN, 4, reports(), FACTS)  # not emulated: no such columns
    verdict = judge([step_row(GEN, s, emulated(s), FACTS) for s in range(3)], 0.5)
    assert verdict.workers.cpu_s == pytest.approx(2.0) and verdict.workers.step_s == pytest.approx(0.6)
    assert verdict.workers.cores_needed == 6  # 3.33 cores busy: 6 cores at 60%


def test_predictions_are_absent_with_the_balancer_off_but_measured_times_are_not():
    row = step_row(GEN, 4, reports(), StepFacts(global_batch=16))
    assert "predicted_max_s" not in row and row["measured_max_s"] == pytest.approx(0.40)
    assert row["mfu"] is None  # no peak FLOP/s known: no MFU, not a zero


def test_console_line_is_compact_with_elapsed_and_eta_and_no_layout():
    row = step_row(GEN, 4, reports(), FACTS)
    line = format_step(row, 100, elapsed_s=75, eta_s=3725)
    assert line.startswith("step 5/100  loss 2.5000  lr 3.00e-04  gnorm 1.25  26.7 samples/s  6.7k tok/s")
    assert line.endswith("[1:15, eta 1:02:05]") and "pipelines" not in line
    row["skipped"] = True
    assert "gnorm overflow" in format_step(row, 100, 0, None)
    assert format_duration(59.6) == "1:00" and format_duration(3600) == "1:00:00"


def test_eta_follows_the_recent_pace_and_lines_follow_log_every(tmp_path):
    now = [0.0]
    lines: list[str] = []
    facts = StepFacts(global_batch=16, log_every=3, eta_window=4)
    progress = Progress(EventLog(tmp_path / "e.jsonl"), 10, lines.append, lambda: now[0], facts)
    progress.start(GEN, None)
    for step in range(10):
        now[0] += 2.0  # two seconds a step
        for m in reports(step):
            progress.metrics(m)
    steps = [int(line.split()[1].split("/")[0]) for line in lines]
    assert steps == [1, 3, 6, 9, 10]  # the first, every 3rd, the last
    assert lines[1].endswith("[0:06, eta 0:14]")  # 7 steps left at 2 s each
    assert len(read_events(tmp_path / "e.jsonl", "step")) == 10  # the log gets every step


def test_a_step_reported_twice_is_logged_once(tmp_path):
    """A master paused past the agents' RPC deadline took their reports, but its answers were
    lost: every agent sends them again once it answers. The step is one step, not two."""
    lines: list[str] = []
    progress = Progress(EventLog(tmp_path / "e.jsonl"), 10, lines.append, lambda: 0.0, FACTS)
    progress.start(GEN, None)
    for step in (4, 5):
        for m in reports(step):
            progress.metrics(m)
    for m in reports(4) + reports(5):  # the whole of both steps again, every rank
        progress.metrics(m)
    for m in reports(6):
        progress.metrics(m)
    assert [e["step"] for e in read_events(tmp_path / "e.jsonl", "step")] == [4, 5, 6]
    assert len(lines) == 3


def test_metrics_csv_and_tensorboard_hold_every_step_and_the_recovery_at_its_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventLog(tmp_path / "events.jsonl")
    sink = MetricsSink(str(tmp_path))
    events.subscribe(sink)
    for step in range(3):
        events.write(
            "step",
            **{**step_row(GEN, step, reports(step), FACTS), "finished_at": 100.0 + step},
            elapsed_s=1.0 + step,
            wall_time=1.8e9,
        )
    events.write("lost", node="node4", reason="stream_closed")
    events.write("resumed", generation=3, step=3, since_detected_s=0.42, seconds=0.1)
    events.write(
        "step", **{**step_row(GEN, 3, reports(3), FACTS), "finished_at": 105.0}, elapsed_s=5.0, wall_time=1.8e9 + 5
    )
    events.close()
    sink.close()

    with open(tmp_path / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0]) == COLUMNS
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]  # steps done, as the console counts
    assert float(rows[0]["tokens_per_s"]) == pytest.approx(4000 / 0.6, rel=1e-5)
    assert rows[0]["wall_time"] == "1800000000.000" and rows[0]["loss_scale"] == ""
    # Completion to completion on the workers' clock: the recovery's wait shows in the row after it.
    assert [r["wall_gap_s"] for r in rows] == ["", "1.000", "1.000", "3.000"]

    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4] and all(math.isclose(e.value, 2.5) for e in loss)
    assert [e.step for e in acc.Scalars("balance/measured_max_s")] == [1, 2, 3, 4]
    assert [(e.step, round(e.value, 2)) for e in acc.Scalars("recovery/resumed_s")] == [(3, 0.42)]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("recovery/text_summary")]
    assert texts[0] == (3, "lost: node=node4, reason=stream_closed")  # after step 3, where it happened


def test_model_flops_count_forward_and_both_backward_halves_once():
    job = load_config(str(CONFIGS / "tiny_mm.yaml"))
    flops = model_flops_per_sample(job)
    expected = 0.0
    for spec in layer_specs(job.model, job.data):
        tokens = spec.tokens_per_sample
        attention = 4.0 * tokens * spec.attention_len * spec.hidden * (0.5 if spec.causal else 1.0)
        matmul = 2.0 * matmul_param_count(spec) * tokens
        # forward (matmul + attention) + weight grads (matmul) + input grads (matmul + 2 attention);
        # the token embedding has no input gradient to speak of
        expected += 3 * matmul + (3 * attention if spec.kind != "token_embed" else attention)
    assert flops == pytest.approx(expected, rel=1e-12)


def test_a_node_whose_compute_is_slow_is_judged_by_the_machine_and_named_in_the_console_the_log_and_every_row(
    tmp_path,
):
    """Progress hands each completed step's per-rank compute to the machine (``StepCompleted``), whose part
    ``slow_nodes`` judges it with ``oobleck_mm.master.stragglers`` and has the row logged with the judgement
    (``LogStep``), as the coordinator wires them: rank 4 (node4) computes twice what the cost model predicts
    relative to the others from step 20 (its range's first CALIBRATION_WARMUP records taught it the healthy
    speed), and is flagged after ``straggler_steps``. The verdicts are a function of the events: the same
    events through a fresh state give the same ones."""
    from oobleck_mm.master import slow_nodes
    from oobleck_mm.master.context import Context
    from oobleck_mm.master.effects import LogStep, Record, Say
    from oobleck_mm.master.inputs import StepCompleted
    from oobleck_mm.master.state import JobState, RunOptions, Settings
    from oobleck_mm.master.stragglers import CALIBRATION_WARMUP, StragglerDetector, StragglerRule

    job = load_config(str(CONFIGS / "tiny_mm.yaml"))
    settings = Settings.of(job, num_nodes=5, steps=40, store_host="h", store_port=1, options=RunOptions())
    lines: list[str] = []
    events = EventLog(tmp_path / "e.jsonl")
    progress = Progress(events, 40, lines.append, lambda: 0.0, StepFacts(global_batch=16), judged=True)
    state = JobState(stragglers=StragglerDetector(StragglerRule(factor=1.5, clear_factor=1.2, steps=3)))
    fed: list[StepCompleted] = []

    def carry_out(effects) -> None:  # as the coordinator does
        for e in effects:
            if isinstance(e, LogStep):
                progress.log_step(e.generation, e.step, e.stragglers, e.latest)
            elif isinstance(e, Record):
                events.write(e.kind, **e.fields)
            elif isinstance(e, Say):
                lines.append(e.text)

    def judge() -> None:
        for generation, step, ranks in progress.take_completed():
            fed.append(StepCompleted(generation, step, ranks))
            ctx = Context(state, settings, 0.0)
            slow_nodes.step_completed(ctx, fed[-1])
            carry_out(ctx.effects)

    expected = {r: 0.1 * (r + 1) for r in range(5)}
    progress.start(GEN, None, expected)
    slow_from = 20
    assert slow_from >= CALIBRATION_WARMUP
    for step in range(slow_from + 8):
        for m in reports(step):
            slow = 2.0 if m.rank == 4 and step >= slow_from else 1.0
            m.forward_s, m.backward_s = expected[m.rank] * slow, expected[m.rank] * slow * 2  # 3x the model's scale
            m.step_time_s = 0.5 * (2.0 if step >= slow_from else 1.0)  # everyone waits for node4: its compute counts
            progress.metrics(m)
            judge()
    [detected] = read_events(tmp_path / "e.jsonl", "straggler_detected")
    assert (detected["node"], detected["step"], detected["factor"]) == ("node4", slow_from + 1, 2.0)  # median 1, 2, 2
    assert any("node node4 is a straggler" in line and "2.00x" in line for line in lines)
    rows = read_events(tmp_path / "e.jsonl", "step")
    assert [r["stragglers"] for r in rows] == [0] * (slow_from + 1) + [1] * 7
    assert rows[-1]["slowest_node"] == "node4" and rows[-1]["slowest_node_factor"] == pytest.approx(2.0)
    # Replayed through a fresh state: the same verdicts (the machine decides from its events alone).
    again = JobState(stragglers=StragglerDetector(StragglerRule(factor=1.5, clear_factor=1.2, steps=3)))
    replayed = []
    for event in fed:
        ctx = Context(again, settings, 0.0)
        slow_nodes.step_completed(ctx, event)
        replayed += [e.fields for e in ctx.effects if isinstance(e, Record)]
    assert replayed == [{k: v for k, v in detected.items() if k not in ("ts", "event")}]
    # node4 planned out: forgotten, and cleared with the reason.
    ctx = Context(state, settings, 0.0)
    slow_nodes.keep_only(ctx, ["node0", "node1", "node2", "node3", "node5"])
    carry_out(ctx.effects)
    [cleared] = read_events(tmp_path / "e.jsonl", "straggler_cleared")
    assert (cleared["node"], cleared["reason"]) == ("node4", "no longer in the plan")


def test_the_masters_tensorboard_files_read_back_as_torchs_summary_writer_writes_them(tmp_path):
    """``TensorBoardWriter`` (tensorboard's own event writer, no torch in the master) against
    ``torch.utils.tensorboard.SummaryWriter`` given the same calls: TensorBoard reads the same tags,
    steps, wall times, values, plugins and texts from both."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from oobleck_mm.master.metrics import TensorBoardWriter

    def calls(writer):
        for step, value in ((1, 3.0), (2, 2.5), (3, 1.0)):
            writer.add_scalar("train/loss", value, step, walltime=100.0 + step)
        writer.add_text("recovery", "lost: node=node4, reason=stream_closed", 3, walltime=104.0)
        writer.add_scalar("recovery/resumed_s", 0.42, 3, walltime=104.5)
        writer.close()

    calls(TensorBoardWriter(str(tmp_path / "ours")))
    calls(SummaryWriter(str(tmp_path / "torch")))

    def read(name):
        acc = EventAccumulator(str(tmp_path / name), size_guidance={"tensors": 0, "scalars": 0})
        acc.Reload()
        tags = acc.Tags()
        scalars = {t: [(e.wall_time, e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}
        tensors = {
            t: [(e.wall_time, e.step, e.tensor_proto.string_val, acc.SummaryMetadata(t).plugin_data.plugin_name)]
            for t in tags["tensors"]
            for e in acc.Tensors(t)
        }
        return scalars, tensors

    ours, theirs = read("ours"), read("torch")
    assert ours == theirs
    assert ours[0]["train/loss"] == [(101.0, 1, 3.0), (102.0, 2, 2.5), (103.0, 3, 1.0)]
    assert ours[1]["recovery/text_summary"] == [(104.0, 3, [b"lost: node=node4, reason=stream_closed"], "text")]
