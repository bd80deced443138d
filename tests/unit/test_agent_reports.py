"""What an agent replays to a restarted master (``oobleck_mm.agent.reports``): the facts the lost master knew, in order."""

from __future__ import annotations

from oobleck_mm.agent.reports import ReportLog
from oobleck_mm.protocol import oobleck_pb2 as pb


def metrics(step: int) -> pb.WorkerReport:
    return pb.WorkerReport(metrics=pb.StepMetrics(generation=1, step=step))


def phase(name: str) -> pb.WorkerReport:
    return pb.WorkerReport(phase=pb.PhaseDone(generation=1, phase=name))


def sent(log: ReportLog, local_rank: int, report: pb.WorkerReport) -> int:
    return log.record(local_rank, report)


def test_a_restarted_master_gets_the_latest_of_each_kind_flagged_then_every_unsent_report_in_order():
    log = ReportLog()
    sent(log, 0, phase("states_copied"))
    sent(log, 0, phase("resumed"))
    for step in range(3):
        sent(log, 0, metrics(step))
    sent(log, 1, metrics(2))
    sent(log, 0, pb.WorkerReport(stalled=pb.Stalled(generation=1)))  # a moment that passed: never replayed
    sent(log, 0, phase("holding"))
    for step in (3, 4):  # no master listens: held
        log.hold(sent(log, 0, metrics(step)), 0, metrics(step))
    assert log.unsent == 2
    out = log.replay()
    described = [
        (
            p.local_rank,
            p.report.WhichOneof("report"),
            p.report.metrics.step if p.report.HasField("metrics") else p.report.phase.phase,
            p.replayed,
        )
        for p in out
    ]
    assert described == [
        (0, "phase", "states_copied", True),
        (0, "phase", "resumed", True),
        (1, "metrics", 2, True),  # worker 0's step 2 is superseded by its unsent steps
        (0, "metrics", 3, False),
        (0, "metrics", 4, False),
    ]
    assert log.unsent == 0 and [p.replayed for p in log.replay()] == [True, True, True, True]


def test_the_same_master_answering_again_gets_only_what_it_missed():
    log = ReportLog()
    sent(log, 0, metrics(0))
    log.hold(sent(log, 0, metrics(1)), 0, metrics(1))
    assert [(p.report.metrics.step, p.replayed) for p in log.replay(latest=False)] == [(1, False)]
