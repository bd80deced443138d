"""The run's metrics for people: ``metrics.csv`` (one row per step) and TensorBoard event files.

Both are written from the master's event log as it is written (``EventLog.subscribe``):
the ``step`` event already is the row (``oobleck_mm/master/progress.py`` builds it from every
rank's report), and the recovery events (a node lost or joining, a plan, the
workers' rendezvous, state copy and resume, checkpoints) go to TensorBoard as
text and scalars at the step they happened, so a loss curve and its incidents
line up. ``events.jsonl`` stays the complete record; these are views of it.

    tensorboard --logdir RUN_DIR/tensorboard
"""

from __future__ import annotations

import csv
import logging
import os
import threading
import time
from typing import Any, Mapping

log = logging.getLogger(__name__)

COLUMNS = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "samples_per_s",
    "tokens_per_s",
    "step_time_s",
    "generation",
    "live_nodes",
    "gpus",
    "pipelines",
    "mfu",
    "peak_memory_mb",
    "balancer",
    "predicted_max_s",
    "predicted_mean_s",
    "predicted_contiguous_max_s",
    "measured_max_s",
    "measured_mean_s",
    "prediction_error",
    "deferred",
    "skipped",
    "loss_scale",
    "elapsed_s",
    "wall_gap_s",
    "wall_time",
    "stragglers",
    "slowest_node",
    "slowest_node_factor",
    "emulated_ops",
    "emulated_late_ops",
    "emulated_worst_lateness",
    "emulated_host_cpu_s",
    "emulated_busiest_rank_cpu_s",
)
"""``metrics.csv``'s header. ``step`` counts steps done (the console's numbering: the event log's
``step`` + 1). ``predicted_*`` are the balancer's model (empty with it off); ``measured_*`` are the
slowest and mean pipeline's 1F1B seconds, measured with the balancer on or off; ``prediction_error``:
``measured_max_s / predicted_max_s - 1`` (the balancer's cost model against the clock, transfers and
waits included, which the model does not price); ``deferred``: samples whose LLM work ran a microbatch
after their encoders' (``balance.deferral``; empty with the balancer off). ``wall_gap_s``:
wall-clock seconds since the previous step completed, ``step_time_s`` plus whatever the job waited
between the two (a recovery, a join's switch); a recovery row's time lost, and a join's survivors'
pause, are these gaps less the run's median (``oobleck_mm.faults.report``). ``stragglers``: nodes flagged
slow after this step; ``slowest_node_factor``: the highest node's compute over the other nodes' per unit
of predicted work in this step (``oobleck_mm/master/stragglers.py``; 1 for a node like the rest). ``emulated_*``: an
emulated run's ops on its emulated devices this step, those that ended late and the worst lateness over its
op's duration (``oobleck_mm/emulation/clock.py``; empty when not emulated), and the CPU seconds the workers'
processes spent in the step, all of them and the busiest rank's (``StepResult.host_cpu_s``)."""

SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "samples_per_s": "throughput/samples_per_s",
    "tokens_per_s": "throughput/tokens_per_s",
    "step_time_s": "throughput/step_time_s",
    "mfu": "throughput/mfu",
    "live_nodes": "cluster/live_nodes",
    "gpus": "cluster/gpus",
    "generation": "cluster/generation",
    "peak_memory_mb": "memory/peak_mb",
    "predicted_max_s": "balance/predicted_max_s",
    "predicted_mean_s": "balance/predicted_mean_s",
    "predicted_contiguous_max_s": "balance/predicted_contiguous_max_s",
    "measured_max_s": "balance/measured_max_s",
    "measured_mean_s": "balance/measured_mean_s",
    "prediction_error": "balance/prediction_error",
    "loss_scale": "train/loss_scale",
    "stragglers": "stragglers/count",
    "slowest_node_factor": "stragglers/slowest_node_factor",
}
"""Row column -> TensorBoard tag (empty values are not written)."""

RECOVERY_EVENTS = {
    "lost": ("node", "reason"),
    "registered": ("node", "spare"),
    "injected": ("kind", "nodes"),
    "plan_decided": ("generation", "cause", "describe", "seconds", "layer_states_moved"),
    "rendezvous_done": ("generation", "seconds", "since_detected_s"),
    "states_copied": ("generation", "seconds", "bytes", "since_detected_s"),
    "resumed": ("generation", "step", "since_detected_s"),
    "checkpoint_saved": ("dir", "step"),
    "aborted": ("generation", "node", "message"),
    "straggler_detected": ("node", "factor", "step", "reason"),
    "straggler_cleared": ("node", "factor", "reason"),
}
"""Events shown in TensorBoard's text tab (with these fields) at the step they happened."""

PHASE_SCALARS = {
    "plan_decided": "seconds",
    "rendezvous_done": "since_detected_s",
    "states_copied": "since_detected_s",
    "resumed": "since_detected_s",
}
"""Recovery phase -> the field plotted as ``recovery/<phase>_s`` (seconds since the incident was seen)."""


class MetricsSink:
    """Writes ``metrics.csv`` and TensorBoard files under ``run_dir`` from event-log records."""

    def __init__(self, run_dir: str, tensorboard: bool = True) -> None:
        self.csv_path = os.path.join(run_dir, "metrics.csv")
        self.tensorboard_dir = os.path.join(run_dir, "tensorboard") if tensorboard else None
        self._lock = threading.Lock()
        self._last_step = 0
        self._last_finished: float | None = None
        """When the previous step completed (its ``finished_at``, else its ``ts``): for ``wall_gap_s``."""
        self._broken: set[str] = set()
        new = not os.path.exists(self.csv_path) or os.path.getsize(self.csv_path) == 0
        self._csv_file = open(self.csv_path, "a", encoding="utf-8", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            self._csv.writeheader()
        self._tb = self._open_tensorboard(self.tensorboard_dir) if self.tensorboard_dir is not None else None

    @staticmethod
    def _open_tensorboard(logdir: str) -> TensorBoardWriter | None:
        try:
            return TensorBoardWriter(logdir)
        except Exception as exc:  # noqa: BLE001 - metrics must not stop training: said, and the csv goes on
            log.error("metrics: cannot open TensorBoard files in %s (%s); metrics.csv is still written", logdir, exc)
            return None

    def __call__(self, record: Mapping[str, Any]) -> None:
        """An ``EventLog`` subscriber: never raises (metrics must not stop training)."""
        name = record.get("event")
        try:
            with self._lock:
                if name == "step":
                    self._step(record)
                elif name in RECOVERY_EVENTS:
                    self._recovery(name, record)
        except OSError as exc:  # a full disk: said once per kind, the job goes on
            self._report_once("write", f"metrics in {os.path.dirname(self.csv_path)}: cannot write ({exc.strerror})")

    def _step(self, record: Mapping[str, Any]) -> None:
        row = {c: _cell(record.get(c), c) for c in COLUMNS}
        row["step"] = int(record["step"]) + 1
        finished = record.get("finished_at") or record.get("ts")  # the workers' clock where the event has it
        if isinstance(finished, (int, float)):
            if self._last_finished is not None:
                row["wall_gap_s"] = _cell(finished - self._last_finished, "wall_gap_s")
            self._last_finished = finished
        self._last_step = row["step"]
        self._csv.writerow(row)
        self._csv_file.flush()
        if self._tb is not None:
            for column, tag in SCALARS.items():
                value = record.get(column)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(tag, value, row["step"], walltime=record.get("ts"))

    def _recovery(self, name: str, record: Mapping[str, Any]) -> None:
        if self._tb is None:
            return
        fields = ", ".join(f"{k}={record[k]}" for k in RECOVERY_EVENTS[name] if record.get(k) not in (None, ""))
        self._tb.add_text("recovery", f"{name}: {fields}", self._last_step, walltime=record.get("ts"))
        field = PHASE_SCALARS.get(name)
        if field is not None and isinstance(record.get(field), (int, float)):
            self._tb.add_scalar(f"recovery/{name}_s", record[field], self._last_step, walltime=record.get("ts"))

    def _report_once(self, kind: str, message: str) -> None:
        if kind not in self._broken:
            self._broken.add(kind)
            log.error("%s", message)

    def close(self) -> None:
        with self._lock:
            try:
                self._csv_file.close()
                if self._tb is not None:
                    self._tb.close()
            except OSError as exc:
                self._report_once("close", f"metrics: cannot finish writing ({exc.strerror})")


class TensorBoardWriter:
    """TensorBoard event files through tensorboard's own ``EventFileWriter``, with the records
    ``torch.utils.tensorboard.SummaryWriter`` writes for ``add_scalar`` and ``add_text`` (the same
    ``Summary`` protos: a ``simple_value`` scalar; a text-plugin string tensor tagged ``TAG/text_summary``).

    Not ``SummaryWriter`` itself: that is a wrapper over this same ``EventFileWriter`` which imports
    torch, 2.2 s of CPU on a 2-core host (0.3 s for tensorboard's protos) in a master that needs torch
    for nothing else; every start and restart of a master paid it, and a restarted master's took CPU
    from the workers training on beside it."""

    def __init__(self, logdir: str, flush_secs: float = 5.0) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        # Flushed every few seconds: a user watching a live run sees it, a crash loses little.
        self._events = EventFileWriter(logdir, max_queue_size=10, flush_secs=flush_secs)

    def add_scalar(self, tag: str, value: float, step: int, walltime: float | None = None) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))]), step, walltime)

    def add_text(self, tag: str, text: str, step: int, walltime: float | None = None) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

        plugin = SummaryMetadata.PluginData(plugin_name="text", content=TextPluginData(version=0).SerializeToString())
        tensor = TensorProto(
            dtype="DT_STRING",
            string_val=[text.encode("utf-8")],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        value = Summary.Value(tag=f"{tag}/text_summary", metadata=SummaryMetadata(plugin_data=plugin), tensor=tensor)
        self._add(Summary(value=[value]), step, walltime)

    def _add(self, summary, step: int, walltime: float | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        event = Event(summary=summary, step=int(step), wall_time=time.time() if walltime is None else walltime)
        self._events.add_event(event)

    def close(self) -> None:
        self._events.close()


def _cell(value: Any, column: str = "") -> Any:
    if value is None:
        return ""
    if column in ("elapsed_s", "wall_time", "wall_gap_s") and isinstance(value, float):
        return f"{value:.3f}"  # seconds, unix time: fixed point, not 1.79553e+09
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def where_things_are(run_dir: str, event_log_path: str, tensorboard: bool) -> str:
    """The closing lines of a run: where its figure, metrics and logs are, and how to look at them."""
    figure = os.path.join(run_dir, "run.png")
    lines = [f"figure:      {figure}"] if os.path.exists(figure) else []
    lines.append(f"metrics:     {os.path.join(run_dir, 'metrics.csv')} (one row per step)")
    if tensorboard:
        lines.append(f"tensorboard: tensorboard --logdir {os.path.join(run_dir, 'tensorboard')}")
    lines.append(f"event log:   {event_log_path}")
    if any(name.startswith("agent-") for name in os.listdir(run_dir)):
        lines.append(f"agent logs:  {os.path.join(run_dir, 'agent-*.log')}")
    return "\n".join(lines)
