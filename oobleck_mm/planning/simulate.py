"""Discrete-event execution of DeepSpeed's real ``TrainSchedule`` instructions.

This is the reference that ``pipeline_time.iteration_time_1f1b`` is tested
against, and a tool for looking at a schedule's timeline. It knows nothing of
the schedule's step structure: each stage walks its own instruction stream, an
instruction is executed through a dispatch table ``{instruction class: handler}``
(an unknown class is a ``ValueError``), and point-to-point transfers are
blocking rendezvous matched by order on each directed channel, exactly as
NCCL/gloo send/recv pair up. The cost model is the one ``pipeline_time``
documents. DeepSpeed is imported lazily so that planning code stays importable
without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from oobleck_mm.planning.pipeline_time import validate_count, validate_latencies


@dataclass(frozen=True, slots=True)
class TraceEvent:
    stage: int
    instruction: str
    """DeepSpeed instruction class name, e.g. ``ForwardPass``."""
    buffer_id: int | None
    start_s: float
    """When the stage reached the instruction (for a transfer: its arrival at the rendezvous)."""
    end_s: float


@dataclass(frozen=True, slots=True)
class SimulationResult:
    makespan_s: float
    """When the last stage finished its last instruction."""
    stage_finish_s: tuple[float, ...]
    stage_busy_s: tuple[float, ...]
    """Seconds each stage spent computing (forward + backward), not waiting or transferring."""
    trace: tuple[TraceEvent, ...]
    """Every executed instruction, in the order the executor ran them (not sorted by time)."""


# A transfer channel: (kind, boundary k between stages k and k+1).
_Channel = tuple[str, int]


@dataclass(frozen=True, slots=True)
class _Transfer:
    channel: _Channel
    is_sender: bool


def simulate_train_schedule(
    forward: Sequence[float],
    backward: Sequence[float],
    send_activation: Sequence[float],
    send_grad: Sequence[float],
    num_microbatches: int,
) -> SimulationResult:
    """Run ``TrainSchedule(num_microbatches, S, k)`` on every stage ``k`` and time it."""
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    validate_count("num_microbatches", num_microbatches)
    num_stages = len(forward)
    schedules = [
        TrainSchedule(micro_batches=int(num_microbatches), stages=num_stages, stage_id=k) for k in range(num_stages)
    ]
    # Steps only group instructions; each stage runs them back to back.
    streams = [[cmd for step in schedule for cmd in step] for schedule in schedules]
    return execute_streams(streams, forward, backward, send_activation, send_grad)


def execute_streams(
    streams: Sequence[Sequence[object]],
    forward: Sequence[float],
    backward: Sequence[float],
    send_activation: Sequence[float],
    send_grad: Sequence[float],
) -> SimulationResult:
    """Execute one instruction stream per stage; raises ``RuntimeError`` on deadlock."""
    f, b, a, g = validate_latencies(forward, backward, send_activation, send_grad)
    if len(streams) != len(f):
        raise ValueError(f"streams must have one entry per stage ({len(f)}), got {len(streams)}")
    return _Executor(streams, f, b, {"activation": a, "grad": g}).run()


class _Executor:
    def __init__(self, streams, forward, backward, transfer_s) -> None:
        self.streams = streams
        self.transfer_s = transfer_s
        num_stages = len(streams)
        self.pc = [0] * num_stages
        self.clock = [0.0] * num_stages
        self.busy = [0.0] * num_stages
        self.trace: list[TraceEvent] = []
        # (channel, is_sender) -> (stage, arrival) of the end waiting there. A stage blocks at
        # its transfer, so each end of a channel has at most one waiter, and pairing the
        # current waiters pairs the n-th send with the n-th receive.
        self.waiting: dict[tuple[_Channel, bool], tuple[int, float]] = {}
        self.dispatch = _dispatch_table(forward, backward)

    def run(self) -> SimulationResult:
        num_stages = len(self.streams)
        while True:
            progressed = False
            for stage in range(num_stages):
                while self.pc[stage] < len(self.streams[stage]) and self._step(stage):
                    progressed = True
            if all(self.pc[s] == len(self.streams[s]) for s in range(num_stages)):
                break
            if not progressed:
                blocked = {s: self.streams[s][pc] for s, pc in enumerate(self.pc) if pc < len(self.streams[s])}
                raise RuntimeError(f"pipeline deadlock: stages blocked at {blocked}")
        return SimulationResult(
            makespan_s=max(self.clock),
            stage_finish_s=tuple(self.clock),
            stage_busy_s=tuple(self.busy),
            trace=tuple(self.trace),
        )

    def _step(self, stage: int) -> bool:
        """Try to execute ``stage``'s next instruction; False if it must wait for a peer."""
        inst = self.streams[stage][self.pc[stage]]
        handler = self.dispatch.get(type(inst))
        if handler is None:
            known = sorted(cls.__name__ for cls in self.dispatch)
            raise ValueError(f"stage {stage}: no handler for instruction {inst!r}; known: {known}")
        outcome = handler(stage)
        if isinstance(outcome, _Transfer):
            return self._rendezvous(stage, inst, outcome)
        self._finish(stage, inst, self.clock[stage], self.clock[stage] + outcome)
        self.busy[stage] += outcome
        return True

    def _rendezvous(self, stage: int, inst, transfer: _Transfer) -> bool:
        peer_side = (transfer.channel, not transfer.is_sender)
        if peer_side not in self.waiting:
            # Both ends block until the other arrives; record this end once.
            self.waiting.setdefault((transfer.channel, transfer.is_sender), (stage, self.clock[stage]))
            return False
        peer, peer_arrival = self.waiting.pop(peer_side)
        arrival = self.waiting.pop((transfer.channel, transfer.is_sender), (stage, self.clock[stage]))[1]
        kind, boundary = transfer.channel
        done = max(arrival, peer_arrival) + self.transfer_s[kind][boundary]
        self._finish(peer, self.streams[peer][self.pc[peer]], peer_arrival, done)
        self._finish(stage, inst, arrival, done)
        return True

    def _finish(self, stage: int, inst, start: float, end: float) -> None:
        self.trace.append(TraceEvent(stage, type(inst).__name__, getattr(inst, "buffer_id", None), start, end))
        self.clock[stage] = end
        self.pc[stage] += 1


def _dispatch_table(forward, backward) -> dict[type, Callable[[int], float | _Transfer]]:
    """Instruction class -> handler(stage) returning compute seconds or the transfer to join."""
    from deepspeed.runtime.pipe import schedule as ds

    def free(stage: int) -> float:
        # Loads are local; the all-reduce and optimizer step are costed by the plan, not here.
        return 0.0

    return {
        ds.LoadMicroBatch: free,
        ds.ReduceTiedGrads: free,
        ds.ReduceGrads: free,
        ds.OptimizerStep: free,
        ds.ForwardPass: lambda stage: float(forward[stage]),
        ds.BackwardPass: lambda stage: float(backward[stage]),
        ds.SendActivation: lambda stage: _Transfer(("activation", stage), is_sender=True),
        ds.RecvActivation: lambda stage: _Transfer(("activation", stage - 1), is_sender=False),
        ds.SendGrad: lambda stage: _Transfer(("grad", stage - 1), is_sender=True),
        ds.RecvGrad: lambda stage: _Transfer(("grad", stage), is_sender=False),
    }
