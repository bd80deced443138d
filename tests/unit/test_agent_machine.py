"""The agent's state machine (``oobleck_mm.agent.machine``) under random event orders (hypothesis' stateful testing).

``AgentModel`` plays the master (assignments, checkpoints, restarts, benches, shutdowns; dying, pausing,
forgetting the node, coming back restarted), the node's workers (crashing, writing their share), the
operator's signals and the clock around ``machine.step``, and carries out the effects as the shell would
(answering ``AskLeave``, ``TryMaster`` and ``Supervise`` from the world it plays). After every event:

- an exit is final: nothing is asked after it;
- no worker is orphaned or leaked: the machine's workers are exactly the processes started and not yet
  stopped or killed, a rank is never started twice, and an assignment only goes to a running worker;
- a healthy node always comes back as a join: with no signal, worker fault or fatal error, the agent exits
  only on the master's Shutdown, or once no master answered for ``master_timeout``;
- a pending share is finished or reported: exit 3 only once every worker told ``MasterLost`` wrote its
  share, and the write ends only when all answered, at its deadline, or on a signal;
- nothing waits forever: each waiting state has a deadline, a lost master is tried every interval, and
  when the chaos stops and time runs on the node is either exited or back to plain training;
- a thread of an earlier registration is not listened to.

The suite runs a shallow profile; ``python scripts/bench_machine.py --machine agent`` runs 5,000 sequences
and its mutants (each guard removed once) must each fail this file.
"""

from __future__ import annotations

import os
import signal

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from oobleck_mm.agent import effects as fx
from oobleck_mm.agent import inputs as ev
from oobleck_mm.agent import machine
from oobleck_mm.errors import ExitCode
from oobleck_mm.protocol import oobleck_pb2 as pb

EXAMPLES = int(os.environ.get("OOBLECK_MACHINE_EXAMPLES", "120"))
SHRINK = os.environ.get("OOBLECK_MACHINE_SHRINK", "1") != "0"
GPUS = 2


def _settings(master_timeout: float | None) -> machine.Settings:
    return machine.Settings(
        interval=1.0,
        master_timeout=master_timeout,
        preempt_grace=20.0,
        worker_stop=5.0,
        collective=30.0,
        write_without_master=15.0,
        resume_command="oobleck-launch master --config job.yaml",
    )


class AgentModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.settings: machine.Settings | None = None
        self.state: machine.AgentState | None = None
        self.live: set[int] = set()
        """Worker processes started and not stopped or killed (what the shell holds)."""
        self.crashed: set[int] = set()
        self.master_up = True
        self.master_knows_node = True
        self.down_since: float | None = None
        self.sessions = 1
        self.generation = 0
        self.exited: int | None = None
        self.causes: set[str] = set()
        """What may end the node with an error: a signal, a worker fault, a fatal error, a master away too long."""
        self.told_master_lost: set[int] = set()
        self.written: dict[int, bool] = {}
        self.collecting = False
        self.last_try: float | None = None
        self.write_began: float | None = None

    # ------------------------------------------------------------------ the shell, played
    def feed(self, event: ev.Event) -> tuple:
        assert self.state is not None
        before_exit = self.exited
        transition = machine.step(self.state, event, self.now, self.settings)
        if before_exit is not None:
            assert not transition.effects, f"effects after the exit: {transition.effects}"
        self.carry_out(transition)
        return transition.effects

    def carry_out(self, transition: machine.Transition) -> None:
        answers = []
        for effect in transition.effects:
            assert self.exited is None, f"{effect} after the exit"
            if isinstance(effect, fx.StartWorker):
                assert effect.local_rank not in self.live, f"worker {effect.local_rank} started twice: one leaks"
                self.live.add(effect.local_rank)
                self.crashed.discard(effect.local_rank)
            elif isinstance(effect, fx.SendAssignment):
                assert effect.local_rank in self.live, f"an assignment to worker {effect.local_rank}, not running"
            elif isinstance(effect, fx.SendAll):
                if effect.command.WhichOneof("command") == "master_lost":
                    assert self.collecting, "MasterLost sent before the shares are collected: answers would be lost"
                    self.told_master_lost = set(self.live)
                    self.write_began = self.now
            elif isinstance(effect, (fx.StopWorkers, fx.KillWorkers)):
                self.live.clear()
            elif isinstance(effect, fx.AskLeave):
                answers.append(ev.LeaveAnswered(self.master_up, "" if self.master_up else "UNAVAILABLE"))
            elif isinstance(effect, fx.TryMaster):
                self.last_try = self.now
                if self.master_up:
                    if self.master_knows_node:
                        answers.append(ev.MasterAnswers(None))
                    else:  # NOT_FOUND, then a new registration
                        self.sessions += 1
                        self.master_knows_node = True
                        answers.append(ev.MasterAnswers(self.sessions, adopted=False))
            elif isinstance(effect, fx.Supervise):
                failed = sorted(self.crashed & self.live)
                if failed:
                    answers.append(ev.WorkerFailed(failed[0], pb.WORKER_EXITED, "worker_exited", "exit code -9"))
            elif isinstance(effect, fx.CollectShares):
                self.collecting = True
            elif isinstance(effect, fx.Rejoin):
                self.down_since = None
            elif isinstance(effect, fx.Exit):
                self.exited = effect.code
                self.check_exit(effect.code)
        for answer in answers:
            if self.exited is None:
                self.feed(answer)

    def check_exit(self, code: int) -> None:
        if code == ExitCode.OK:
            assert "shutdown" in self.causes, "exit 0 without the master's Shutdown"
            return
        if code == ExitCode.NO_REPLICAS:
            assert self.told_master_lost, "exit 3 without asking the workers to write"
            assert all(self.written.get(r) for r in self.told_master_lost), (
                f"exit 3 while a share is missing or failed: told {sorted(self.told_master_lost)}, wrote {self.written}"
            )
            return
        healthy = not (self.causes & {"signal", "notice", "crash", "fatal"})
        away_too_long = self.down_since is not None and (
            self.settings.master_timeout is None or self.now - self.down_since > self.settings.master_timeout
        )
        assert not healthy or away_too_long or self.told_master_lost, (
            f"a healthy node exited {code} (master up: {self.master_up}, away since {self.down_since}, now "
            f"{self.now}): it must come back as a join"
        )
        if self.told_master_lost and healthy and self.write_began is not None:
            finished = all(r in self.written for r in self.told_master_lost)
            assert finished or self.now >= self.write_began + self.settings.write_without_master, (
                "the write without a master ended before every worker answered and before its deadline"
            )

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: self.state is None)
    @rule(master_timeout=st.sampled_from([None, 6.0, 30.0]))
    def register(self, master_timeout):
        self.settings = _settings(master_timeout)
        first = machine.registered(1, GPUS, self.now, self.settings)
        self.state = first.state
        self.carry_out(first)
        assert self.live == set(range(GPUS)), "every worker starts at registration"

    @precondition(lambda self: self.state is not None)
    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 3.0, 8.0]))
    def time_passes(self, dt):
        self.now += dt
        self.feed(ev.Tick())
        if self.exited is None and self.state.orphaned_at is not None:
            assert self.last_try is not None and self.now - self.last_try <= self.settings.interval, (
                "a lost master is not tried every heartbeat interval"
            )

    @precondition(lambda self: self.state is not None)
    @rule(local_rank=st.integers(0, GPUS - 1), at_boundary=st.booleans())
    def master_assigns(self, local_rank, at_boundary):
        self.generation += 1
        assignment = pb.Assignment(
            generation=self.generation, rank=local_rank, world_size=GPUS, at_boundary=at_boundary
        )
        self.feed(ev.Assign(local_rank, assignment))

    @precondition(lambda self: self.state is not None)
    @rule()
    def master_asks_a_checkpoint(self):
        self.feed(ev.Checkpoint(pb.Checkpoint(dir="/ckpt", generation=self.generation)))

    @precondition(lambda self: self.state is not None)
    @rule()
    def master_restarts_the_workers(self):
        self.feed(ev.Restart("restart-mode recovery"))

    @precondition(lambda self: self.state is not None)
    @rule()
    def master_benches_the_node(self):
        self.feed(ev.Bench("3.1x slower than the median"))

    @precondition(lambda self: self.state is not None)
    @rule(at_boundary=st.booleans())
    def master_shuts_down(self, at_boundary):
        if self.exited is None and self.state.writing is None:
            self.causes.add("shutdown")
        self.feed(ev.Shutdown(pb.Shutdown(reason="done", at_boundary=at_boundary)))

    @precondition(lambda self: self.state is not None)
    @rule(how=st.sampled_from(["stream broke", "silent"]))
    def master_dies(self, how):
        if self.master_up:
            self.master_up = False
            self.down_since = self.now if self.down_since is None else self.down_since
        self.feed(ev.MasterLost(self.state.session, f"the master is gone ({how})"))

    @precondition(lambda self: self.state is not None)
    @rule()
    def master_forgets_the_node(self):
        """Declared lost (a partition, a host too busy to heartbeat): heartbeats answer NOT_FOUND."""
        self.master_knows_node = False
        if self.down_since is None:
            self.down_since = self.now
        self.feed(ev.MasterLost(self.state.session, "the master no longer knows this node"))

    @precondition(lambda self: self.state is not None and not self.master_up)
    @rule(restarted=st.booleans())
    def master_comes_back(self, restarted):
        self.master_up = True
        if restarted:
            self.master_knows_node = False

    @precondition(lambda self: self.state is not None)
    @rule(what=st.sampled_from(["loss", "fatal"]))
    def a_thread_of_an_earlier_registration_speaks(self, what):
        state_before = (self.state.orphaned_at, self.state.writing, self.state.exit_code)
        stale = self.state.session - 1 if isinstance(self.state.session, int) else 0
        event = ev.MasterLost(stale, "old stream") if what == "loss" else ev.Fatal(stale, "old reports thread")
        effects = self.feed(event)
        assert not [e for e in effects if not isinstance(e, (fx.Supervise, fx.TryMaster))], effects
        assert (self.state.orphaned_at, self.state.writing, self.state.exit_code) == state_before

    @precondition(lambda self: self.state is not None)
    @rule(signum=st.sampled_from([signal.SIGTERM, signal.SIGINT]))
    def a_signal_arrives(self, signum):
        s = self.state
        notice = signum == signal.SIGTERM and s.leave_by is None and s.orphaned_at is None and s.writing is None
        self.causes.add("notice" if notice and self.master_up else "signal")  # a notice ends the node in time
        before = s.leave_by
        self.feed(ev.Signal(signum))
        if s.leave_by is not None and before is None:
            assert self.master_up, "a notice counted as taken by a master that is down"

    @precondition(lambda self: self.state is not None)
    @rule(local_rank=st.integers(0, GPUS - 1))
    def a_worker_crashes(self, local_rank):
        if local_rank in self.live:
            self.crashed.add(local_rank)
            self.causes.add("crash")
        self.feed(ev.WorkerEnded(local_rank))

    @precondition(lambda self: self.state is not None)
    @rule()
    def the_reports_thread_fails(self):
        self.causes.add("fatal")
        self.feed(ev.Fatal(self.state.session, "the reports thread failed"))

    @precondition(lambda self: self.told_master_lost and self.exited is None)
    @rule(data=st.data(), ok=st.booleans())
    def a_worker_writes_its_share(self, data, ok):
        waiting = sorted(self.told_master_lost - set(self.written))
        if not waiting:
            return
        local_rank = data.draw(st.sampled_from(waiting))
        self.written[local_rank] = ok
        share = ev.Share(12, "/run/ckpt/step-12") if ok else ev.Share(12, "/run/ckpt/step-12", "disk full")
        self.feed(ev.Saved(local_rank, share))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def the_machines_workers_are_the_running_processes(self):
        if self.state is not None and self.exited is None:
            assert self.state.workers == self.live, f"machine: {self.state.workers}, running: {self.live}"

    @invariant()
    def every_wait_has_a_deadline(self):
        if self.state is None or self.exited is not None:
            return
        if self.state.orphaned_at is not None:
            assert self.settings.master_timeout is not None, "waiting for a master with no master_timeout"
        if self.state.writing is not None:
            assert self.state.writing.deadline <= self.now + self.settings.write_without_master

    def teardown(self):
        """The chaos stops: time runs on; the node is exited or back to plain training, never waiting."""
        if self.state is None or self.exited is not None:
            return
        for _ in range(80):
            self.now += 1.0
            self.feed(ev.Tick())
            if self.exited is not None:
                break
        assert self.exited is not None or not self.state.waiting, (
            f"still waiting after 80 s of quiet: orphaned at {self.state.orphaned_at}, "
            f"leave by {self.state.leave_by}, writing {self.state.writing}"
        )


TestAgentMachine = AgentModel.TestCase
TestAgentMachine.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=list(Phase) if SHRINK else [Phase.explicit, Phase.reuse, Phase.generate],
)


# ---------------------------------------------------------------------- orders worth keeping as plain tests
def _registered(master_timeout: float | None = 30.0):
    settings_ = _settings(master_timeout)
    first = machine.registered(1, GPUS, 0.0, settings_)
    return first.state, settings_


def test_a_master_lost_after_a_restart_and_before_the_next_assignment_is_an_error_not_a_crash():
    """Restart mode killed the workers; the master dies before assigning fresh ones: nothing can write the step.
    The loop before the machine indexed the first of no answers (IndexError); now it exits 1 and says why."""
    state, s = _registered(master_timeout=None)
    machine.step(state, ev.Assign(0, pb.Assignment(generation=1)), 0.1, s)
    machine.step(state, ev.Restart("restart-mode recovery"), 0.2, s)
    out = machine.step(state, ev.MasterLost(1, "the stream broke"), 0.3, s)
    assert state.exit_code == ExitCode.ERROR and fx.Exit(ExitCode.ERROR) in out.effects
    assert any("no worker running" in e.text for e in out.effects if isinstance(e, fx.Log))


def test_not_found_then_a_new_registration_is_a_join_and_the_workers_train_on():
    state, s = _registered()
    machine.step(state, ev.Assign(0, pb.Assignment(generation=3)), 0.1, s)
    lost = machine.step(state, ev.MasterLost(1, "the master no longer knows this node"), 0.2, s)
    assert fx.HoldReports() in lost.effects and fx.TryMaster() in lost.effects
    back = machine.step(state, ev.MasterAnswers(2, adopted=False), 0.4, s)
    assert [e for e in back.effects if isinstance(e, fx.Rejoin)] == [fx.Rejoin(2, False, pytest.approx(0.2))]
    assert state.session == 2 and state.orphaned_at is None and state.exit_code is None
    assert state.workers == {0, 1}, "the workers are not touched: they train on"


def test_the_write_without_a_master_exits_3_with_the_resume_command_once_every_share_is_in():
    state, s = _registered(master_timeout=None)
    machine.step(state, ev.Assign(0, pb.Assignment(generation=1)), 0.1, s)
    out = machine.step(state, ev.MasterLost(1, "the stream broke"), 0.2, s)
    assert out.effects[-2:] == (
        fx.CollectShares(),
        fx.SendAll(pb.WorkerCommand(master_lost=pb.MasterLost(reason="the stream broke"))),
    )
    machine.step(state, ev.Assign(1, pb.Assignment(generation=2)), 0.3, s)  # ignored while writing
    assert state.exit_code is None
    machine.step(state, ev.Saved(0, ev.Share(7, "/r/step-7")), 1.0, s)
    done = machine.step(state, ev.Saved(1, ev.Share(7, "/r/step-7")), 1.1, s)
    assert state.exit_code == ExitCode.NO_REPLICAS
    assert any("--resume /r/step-7" in e.text for e in done.effects if isinstance(e, fx.Log))


def test_the_notices_grace_ends_the_node_when_no_shutdown_comes():
    state, s = _registered()
    asked = machine.step(state, ev.Signal(signal.SIGTERM), 1.0, s)
    assert fx.AskLeave() in asked.effects
    machine.step(state, ev.LeaveAnswered(True), 1.0, s)
    assert state.leave_by == 21.0
    assert machine.step(state, ev.Tick(), 20.9, s).state.exit_code is None
    assert machine.step(state, ev.Tick(), 21.1, s).state.exit_code == ExitCode.ERROR
