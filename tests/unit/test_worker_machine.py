"""The worker's state machine (``oobleck_mm.runtime.worker_machine``) under random event orders (hypothesis).

``WorkerModel`` plays the worker's shell and its world: the agent's commands (assignments of new, older and
joining generations, checkpoints, shutdowns, ``MasterLost``, the agent's end), set-ups that succeed, are
interrupted by a newer command or fail, steps that complete (with a switch, a checkpoint due) or fail (a
peer died; out of memory), writes that a dead peer cuts short. Each answered effect is answered by a drawn
event; after every event the worker's guarantees hold (``worker_machine``'s docstring):

- a share written in the background is finished before the worker stops or says done;
- ``MasterLost`` is answered: the step written together inside a generation, "nothing" between them;
- a failed step discards its gradients and abandons the iteration before anything else; out of memory stops;
- steps run in order from the agreed start, never past the last, none after the stop;
- at a switch the next command is taken before any further step; a group is left before the next set-up.

The suite runs a shallow profile; ``python scripts/bench_machine.py --machine worker`` runs 5,000 sequences
and its mutants (each guard removed once) must each fail this file.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from oobleck_mm.protocol import oobleck_pb2 as pb
from oobleck_mm.runtime import worker_machine as wm

EXAMPLES = int(os.environ.get("OOBLECK_MACHINE_EXAMPLES", "150"))
SHRINK = os.environ.get("OOBLECK_MACHINE_SHRINK", "1") != "0"
STEPS = 6

ANSWERED = (wm.NextCommand, wm.AwaitSwitch, wm.SetUp, wm.Train, wm.SaveFinal)


def _assignment(generation: int, data) -> pb.WorkerCommand:
    return pb.WorkerCommand(
        assignment=pb.Assignment(
            generation=generation,
            steps=STEPS,
            checkpoint_interval=data.draw(st.sampled_from([0, 2, 3])),
            checkpoint_after_first_step=data.draw(st.booleans()),
            checkpoint_dir=data.draw(st.sampled_from(["", "/ckpt"])),
            checkpoint_async=data.draw(st.booleans()),
            save_final_dir=data.draw(st.sampled_from(["", "/final"])),
        )
    )


def _command(data, generation: int) -> pb.WorkerCommand | None:
    kind = data.draw(st.sampled_from(["assignment", "assignment", "checkpoint", "shutdown", "master_lost", "gone"]))
    if kind == "assignment":
        return _assignment(generation, data)
    if kind == "checkpoint":
        return pb.WorkerCommand(checkpoint=pb.Checkpoint(dir="/below", generation=generation - 1))
    if kind == "shutdown":
        return pb.WorkerCommand(shutdown=pb.Shutdown(reason="done", at_boundary=data.draw(st.booleans())))
    if kind == "master_lost":
        return pb.WorkerCommand(master_lost=pb.MasterLost(reason="gone"))
    return None


class WorkerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = wm.WorkerState()
        self.queue: list[wm.Effect] = [wm.NextCommand()]
        """Effects not carried out yet; an answered one waits at the front for ``answer``."""
        self.generation = 0
        self.stopped = False
        self.in_flight = 0
        """Background shares handed over and not finished (``FinishShares``)."""
        self.master_lost_inside: bool | None = None
        """A MasterLost was delivered (inside a generation: True); it must be answered before the stop."""
        self.answered_master_lost = False
        self.failed_step = False
        self.out_of_memory = False
        self.switch_pending = False
        self.joined = False
        """The worker is in a generation's group (left by ``LeaveGroup`` or ``Abort``)."""
        self.start: int | None = None
        self.last_trained: int | None = None
        self.steps = STEPS
        self.agent_gone = False
        self.last_effect = None

    # ------------------------------------------------------------------ the shell, played
    def feed(self, event: wm.Event) -> None:
        assert not self.stopped, f"an event after the stop: {event}"
        transition = wm.step(self.state, event)
        self.queue = list(transition.effects)
        self.run_until_answered()

    def run_until_answered(self) -> None:
        while self.queue and not isinstance(self.queue[0], ANSWERED):
            self.carry_out(self.queue.pop(0))
        if self.queue:
            self.check_before(self.queue[0])

    def check_before(self, effect) -> None:
        assert not self.stopped, f"{effect} after the stop"
        if self.out_of_memory:
            assert isinstance(effect, wm.OutOfMemory), f"{effect} after a step out of memory: the worker must stop"
        if self.failed_step:
            assert isinstance(effect, wm.Abort) and effect.discard, (
                f"a failed step answered with {effect}: its iteration must be abandoned, its gradients discarded"
            )
        if isinstance(effect, wm.Train):
            assert not self.switch_pending, "a step trained at a switch before the next command was taken"
            assert self.start is not None, "a step trained before the generation's start was agreed"
            expected = self.start if self.last_trained is None else self.last_trained + 1
            assert effect.step == expected, f"step {effect.step} trained, expected {expected}"
            assert effect.step < self.steps, f"step {effect.step} trained past the last ({self.steps - 1})"
        if isinstance(effect, wm.SetUp):
            assert not self.joined, "a new set-up while still in the previous generation's group"

    def carry_out(self, effect) -> None:
        self.check_before(effect)
        self.last_effect = effect
        if isinstance(effect, wm.WriteShare) and effect.background:
            self.in_flight += 1
        elif isinstance(effect, wm.FinishShares):
            self.in_flight = 0
        elif isinstance(effect, wm.ReportDone):
            assert self.in_flight == 0, "done said while a background share is still being written"
        elif isinstance(effect, (wm.LeaveGroup, wm.Abort)):
            self.failed_step = self.switch_pending = False
            self.joined = False
            self.start = self.last_trained = None
        elif isinstance(effect, wm.WriteWithoutMaster):
            assert self.master_lost_inside, "a write without the master outside a generation"
            assert self.in_flight == 0, "two writers at once: the background share was not finished first"
            self.answered_master_lost = True
        elif isinstance(effect, wm.ReportNothing):
            assert self.master_lost_inside is False, "MasterLost inside a generation answered with nothing"
            self.answered_master_lost = True
        elif isinstance(effect, wm.OutOfMemory):
            assert self.out_of_memory, "stopped for memory without an out-of-memory step"
            self.stopped = True
        elif isinstance(effect, wm.Stop):
            if not self.agent_gone and not self.out_of_memory:
                assert self.in_flight == 0, "stopped while a background share is still being written"
            if self.master_lost_inside is not None:
                assert self.answered_master_lost, "MasterLost never answered with a CheckpointDone"
            self.stopped = True

    # ------------------------------------------------------------------ answers
    @rule(data=st.data())
    def answer(self, data):
        if self.stopped or not self.queue:
            return
        effect = self.queue.pop(0)
        self.carry_out(effect)
        if isinstance(effect, wm.NextCommand):
            self.feed(wm.Taken(self.deliver(data, inside=False)))
        elif isinstance(effect, wm.AwaitSwitch):
            self.switch_pending = False
            if data.draw(st.booleans()):
                self.feed(wm.SwitchCommand(None, arrived=False))
            else:
                self.feed(wm.SwitchCommand(self.deliver(data, inside=True)))
        elif isinstance(effect, wm.SetUp):
            self.steps = effect.command.assignment.steps
            how = data.draw(st.sampled_from(["adopted", "adopted", "interrupted", "failed"]))
            if how == "adopted":
                self.joined = True
                self.start = data.draw(st.integers(0, STEPS))
                self.feed(wm.Adopted(self.start))
            elif how == "interrupted":
                self.feed(wm.Interrupted(self.deliver(data, inside=False)))
            else:
                self.feed(wm.SetUpFailed("a peer died in the state copy", 0))
        elif isinstance(effect, wm.Train):
            self.last_trained = effect.step
            outcome = data.draw(st.sampled_from(["done", "done", "done", "switch", "failed", "oom"]))
            if outcome == "failed":
                self.failed_step = True
                self.feed(wm.StepFailed(effect.step, "Connection closed by peer"))
            elif outcome == "oom":
                self.out_of_memory = True
                self.feed(wm.StepFailed(effect.step, "CUDA out of memory", out_of_memory=True))
            else:
                self.switch_pending = outcome == "switch" and effect.step + 1 < self.steps
                self.feed(wm.StepDone(effect.step, outcome == "switch", checkpoint_due=data.draw(st.booleans())))
        elif isinstance(effect, wm.SaveFinal):
            if data.draw(st.booleans()):
                self.feed(wm.FinalSaved())
            else:
                self.feed(wm.WriteFailed(self.steps, "final save: a peer died"))

    def deliver(self, data, inside: bool) -> pb.WorkerCommand | None:
        self.generation += 1
        command = _command(data, self.generation)
        if command is None:
            self.agent_gone = True
        elif command.WhichOneof("command") == "master_lost":
            self.master_lost_inside = inside
        return command

    @rule()
    def a_sync_write_is_cut_short(self):
        """A peer dies inside a save every rank takes part in: the shell answers that write with WriteFailed,
        and what the machine listed after it is not done."""
        write = self.last_effect
        if self.stopped or not isinstance(write, wm.WriteShare) or write.background:
            return
        self.queue = []
        self.feed(wm.WriteFailed(write.step, "checkpoint: a peer died"))

    @invariant()
    def the_worker_always_has_something_to_do_or_stopped(self):
        assert self.stopped or self.queue, "the machine left the worker with nothing to do: it would hang"


TestWorkerMachine = WorkerModel.TestCase
TestWorkerMachine.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=list(Phase) if SHRINK else [Phase.explicit, Phase.reuse, Phase.generate],
)


# ---------------------------------------------------------------------- orders worth keeping as plain tests
def _run(state, event):
    return list(wm.step(state, event).effects)


def test_a_shutdown_after_a_background_share_waits_for_it_before_the_worker_stops():
    state = wm.WorkerState()
    a = pb.WorkerCommand(
        assignment=pb.Assignment(
            generation=1, steps=2, checkpoint_interval=1, checkpoint_dir="/c", checkpoint_async=True
        )
    )
    assert _run(state, wm.Taken(a)) == [wm.SetUp(a)]
    assert _run(state, wm.Adopted(0)) == [wm.Train(0)]
    effects = _run(state, wm.StepDone(0, switch=True))
    assert effects == [wm.Committed(1, 0), wm.WriteShare(1, background=True), wm.AwaitSwitch()]
    shutdown = pb.WorkerCommand(shutdown=pb.Shutdown(reason="end"))
    assert _run(state, wm.SwitchCommand(shutdown)) == [wm.LeaveGroup(), wm.FinishShares("shut down (end)"), wm.Stop()]


def test_master_lost_at_a_switch_writes_the_step_every_rank_stopped_at():
    state = wm.WorkerState()
    a = pb.WorkerCommand(assignment=pb.Assignment(generation=4, steps=10, checkpoint_dir="/c"))
    _run(state, wm.Taken(a))
    _run(state, wm.Adopted(3))
    _run(state, wm.StepDone(3, switch=True))
    lost = pb.WorkerCommand(master_lost=pb.MasterLost(reason="gone"))
    assert _run(state, wm.SwitchCommand(lost)) == [
        wm.FinishShares("the master is lost"),
        wm.WriteWithoutMaster(4),
        wm.LeaveGroup(),
        wm.Stop(),
    ]


def test_a_final_save_a_peer_cut_short_is_abandoned_and_the_next_generation_saves_it():
    state = wm.WorkerState()
    a = pb.WorkerCommand(assignment=pb.Assignment(generation=2, steps=1, save_final_dir="/f"))
    _run(state, wm.Taken(a))
    _run(state, wm.Adopted(0))
    assert _run(state, wm.StepDone(0, switch=False))[-1] == wm.SaveFinal()
    effects = _run(state, wm.WriteFailed(1, "final save: peer gone"))
    assert effects == [wm.Abort(2, 1, "final save: peer gone"), wm.NextCommand()]


def test_master_lost_between_generations_finishes_a_background_share_before_answering_nothing():
    """Found by the model at depth: a step-0 share in the background, the next step failed (abandoned), then
    MasterLost between generations. The share's own report must come before "nothing", the worker's last answer
    the agent keeps; before, the worker stopped with the write in flight."""
    state = wm.WorkerState()
    a = pb.WorkerCommand(
        assignment=pb.Assignment(
            generation=1, steps=4, checkpoint_after_first_step=True, checkpoint_dir="/c", checkpoint_async=True
        )
    )
    _run(state, wm.Taken(a))
    _run(state, wm.Adopted(0))
    assert wm.WriteShare(1, background=True, finish_first=True) in _run(state, wm.StepDone(0, switch=False))
    assert _run(state, wm.StepFailed(1, "peer gone")) == [wm.Abort(1, 1, "peer gone", discard=True), wm.NextCommand()]
    lost = pb.WorkerCommand(master_lost=pb.MasterLost(reason="gone"))
    assert _run(state, wm.Taken(lost)) == [wm.FinishShares("the master is lost"), wm.ReportNothing(), wm.Stop()]
