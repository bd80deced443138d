"""The master's side of checkpoints: periodic ones, the round before a stop, meta.json, ``--resume`` checks.

One owner for checkpoint decisions, answering in values: ``CheckpointBook``
records the workers' shares of periodic checkpoints and says when one is
complete; ``CheckpointRound`` and ``round_verdict`` decide a stop's round. The
machine (``oobleck_mm.master.machine``) turns their answers into effects; the I/O
(``write_meta``, ``prune_checkpoints``, ``resume_step``) runs in the shell.

Below (f+1)*n0 nodes the job cannot keep training, but its state is still in
the survivors' memory. The master sends ``Checkpoint{dir, generation,
surviving_ranks}`` to the nodes that hold that generation; each worker writes
the layers whose lowest surviving holder it is (so each layer exactly once)
and answers ``CheckpointDone``. When every writer answered, the master writes
``meta.json`` (the step, the sampler position, the config): its presence marks
the checkpoint complete, and ``--resume DIR`` continues from it on any node count.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

from oobleck_mm.master.recovery import GenerationView, orphan_layers, surviving_ranks
from oobleck_mm.errors import UserError
from oobleck_mm.planning.layout import Gpu
from oobleck_mm.protocol import oobleck_pb2 as pb


@dataclass(slots=True)
class CheckpointRound:
    """One below-threshold checkpoint in progress."""

    directory: str
    gen: GenerationView
    writers: tuple[str, ...]
    """Nodes that hold ``gen`` and write their share."""
    reason: str
    """Why the job cannot continue (the planner's words)."""
    started: float
    """The master's clock when the round was requested."""
    deadline: float
    """The master's clock past which the round has failed."""
    reports: dict[Gpu, pb.CheckpointDone] = field(default_factory=dict)
    requested: bool = False
    """A graceful stop (SIGTERM to the master) rather than too few nodes."""

    @property
    def surviving(self) -> list[int]:
        return surviving_ranks(self.gen, self.writers)

    def command(self) -> pb.AgentEvent:
        c = pb.Checkpoint(
            dir=self.directory,
            generation=self.gen.number,
            surviving_ranks=self.surviving,
            at_boundary=len(self.surviving) == len(self.gen.ranks),
        )  # nobody lost: every rank steps on
        return pb.AgentEvent(checkpoint=c)

    def expected(self) -> set[Gpu]:
        return {gpu for gpu in self.gen.ranks if gpu[0] in self.writers}

    def record(self, gpu: Gpu, done: pb.CheckpointDone) -> None:
        if gpu in self.expected() and done.dir == self.directory:
            self.reports[gpu] = done

    def complete(self) -> bool:
        return self.expected() <= set(self.reports)

    def without(self, node: str) -> CheckpointRound | None:
        """The round again without a lost writer, or None if some layer then has no writer left."""
        writers = tuple(n for n in self.writers if n != node)
        if orphan_layers(self.gen.layout, surviving_ranks(self.gen, writers)):
            return None
        return CheckpointRound(
            self.directory, self.gen, writers, self.reason, self.started, self.deadline, requested=self.requested
        )

    def step(self) -> tuple[int | None, str]:
        """The step every writer reported (the next one to run), or None with what is wrong."""
        steps = {r.step for r in self.reports.values()}
        if len(steps) != 1 or min(steps) < 0:
            return None, f"workers reported steps {sorted(steps)} (-1: the worker did not hold the generation)"
        return steps.pop(), ""


@dataclass(frozen=True, slots=True)
class RoundPending:
    """Some writer has not answered and the deadline has not passed."""


@dataclass(frozen=True, slots=True)
class RoundFailed:
    message: str


@dataclass(frozen=True, slots=True)
class RoundWritten:
    step: int
    layers: int
    seconds: float


def round_verdict(r: CheckpointRound, now: float) -> RoundPending | RoundFailed | RoundWritten:
    """Where a round stands at clock ``now``."""
    if not r.complete():
        if now > r.deadline:
            return RoundFailed(
                f"the checkpoint to {r.directory} did not complete: "
                f"{len(r.reports)} of {len(r.expected())} workers answered"
            )
        return RoundPending()
    step, problem = r.step()
    if step is None:
        return RoundFailed(f"the checkpoint to {r.directory} is inconsistent: {problem}")
    return RoundWritten(step, sum(d.layers for d in r.reports.values()), now - r.started)


def round_directory(root: str, generation: int, step: int, avoid: str = "") -> str:
    """Where a round writes: named by the generation and the step, so a pure function can choose it.

    Two rounds of one run dir get the same name only for the same generation number and step; the
    only such pair that can hold different files is a job resumed from that very checkpoint and
    stopped before its first step, which ``avoid`` (the ``--resume`` directory) steers clear of.
    """
    path = os.path.join(root, f"checkpoint-g{generation}-step{step:08d}")
    candidate, k = path, 1
    while avoid and os.path.normpath(candidate) == os.path.normpath(avoid):
        candidate, k = f"{path}-{k}", k + 1
    return candidate


@dataclass(slots=True)
class CheckpointBook:
    """Periodic checkpoints: the newest complete one, and the shares of those still being written."""

    last: tuple[str, int] | None = None
    """(directory, step) of the newest complete periodic checkpoint: where the job stops when state is lost."""
    shares: dict[str, dict[Gpu, pb.CheckpointDone]] = field(default_factory=dict)
    """Checkpoint directory -> (node, gpu) -> its worker's CheckpointDone (live mode)."""
    last_timing: dict[str, float] = field(default_factory=dict)
    """Snapshot and write seconds of the newest complete one (the slowest worker's)."""
    last_generation: int = 0
    """The generation that wrote ``last`` (0: not known, a restarted master's journal)."""
    unreadable: set[str] = field(default_factory=set)
    """Checkpoints the master chose for a generation whose workers could not read them (never chosen again)."""

    def record_share(self, gens: Mapping[int, GenerationView], gpu: Gpu, done: pb.CheckpointDone) -> bool:
        """Live mode: one worker's share; True when it completed its checkpoint (every rank of the
        generation that took the snapshot wrote its share).

        A generation that changed before that (a failure, a join) never completes it: its
        directory stays without meta.json and goes with the next complete one.
        """
        gen = gens.get(done.generation)
        if gen is None or gpu not in gen.ranks:
            return False
        shares = self.shares.setdefault(done.dir, {})
        shares[gpu] = done
        if set(shares) != set(gen.ranks):
            return False
        del self.shares[done.dir]
        self.last_timing = {
            "snapshot_seconds": max(d.snapshot_seconds for d in shares.values()),
            "write_seconds": max(d.seconds for d in shares.values()),
        }
        if self.last is None or done.step > self.last[1]:
            self.last, self.last_generation = (done.dir, done.step), done.generation
        self.shares = {d: s for d, s in self.shares.items() if step_of(d) > done.step}  # older: abandoned
        return True

    def record_barrier_checkpoint(self, done: pb.CheckpointDone) -> bool:
        """Restart mode: one report means every rank passed the checkpoint's closing barrier."""
        if done.dir in self.unreadable:
            return False
        if done.step > 0 and (self.last is None or done.step > self.last[1]):
            self.last, self.last_generation = (done.dir, done.step), done.generation
            self.last_timing = {}
            return True
        return False


def cut_short(
    book: CheckpointBook, gens: Mapping[int, GenerationView], interval: int, next_step: int, lost: Collection[str]
) -> int | None:
    """The step of the newest periodic checkpoint that losing ``lost`` leaves without ``meta.json``, or None.

    Workers snapshot after every step that makes ``next_step`` a multiple of ``interval`` and write in
    the background; a writer lost before its share is on disk cuts that checkpoint short (issue 27
    9(iii): a 1,600-step soak with 34 recoveries completed 1 of its 8). The next generation then
    checkpoints after its first step (``Assignment.checkpoint_after_first_step``), so a loss costs at
    most one step of checkpointed progress, not a whole interval.

    Why not have the surviving replicas write the lost writer's layers of that step: they trained
    on past it, and each worker snapshots only the layers it owns. Snapshotting every held layer
    instead would double the host memory and the training thread's copy of every checkpoint (f+1
    copies of each layer), to save one extra checkpoint after a loss.
    """
    last = book.last[1] if book.last is not None else 0
    taken = (next_step // interval) * interval if interval > 0 else 0
    pending = {step_of(d): d for d in book.shares}
    step = max(taken, max(pending, default=0))
    if step <= last:
        return None
    shares = book.shares.get(pending.get(step, ""), {})
    generations = {done.generation for done in shares.values()}
    if len(generations) == 1 and (gen := gens.get(generations.pop())) is not None:
        if all(gpu in shares for gpu in gen.ranks if gpu[0] in lost):
            return None  # every lost writer's files are on disk: the survivors' shares complete it
    return step


def step_of(directory: str) -> int:
    """The step of a periodic checkpoint directory (``runtime.checkpoint_meta.periodic_checkpoint_dir``
    names them ``stepNNNNNNNN``)."""
    name = os.path.basename(directory)
    return int(name[4:]) if name.startswith("step") and name[4:].isdigit() else -1


def prune_checkpoints(directory: str, keep: int, pinned: Collection[str] = ()) -> None:
    """Keeps the ``keep`` newest complete periodic checkpoints up to ``directory`` (the one this master just
    completed) and removes older ones, complete or cut short (no meta.json), except ``pinned`` ones: a
    checkpoint a generation was told to load stays until it is loaded (issue 56: restart mode keeps one
    checkpoint, and a newer one that completed after the plan deleted the one the restarted workers were
    about to open)."""
    parent = os.path.dirname(directory)
    steps = (
        [s for s in map(step_of, (os.path.join(parent, n) for n in os.listdir(parent))) if s >= 0]
        if os.path.isdir(parent)
        else []
    )
    complete = {s for s in steps if os.path.exists(os.path.join(parent, f"step{s:08d}", "meta.json"))}
    for path in doomed_checkpoints(parent, steps, complete, keep, pinned, upto=step_of(directory)):
        shutil.rmtree(path, ignore_errors=True)


def doomed_checkpoints(
    parent: str,
    steps: Collection[int],
    complete: Collection[int],
    keep: int,
    pinned: Collection[str] = (),
    upto: int | None = None,
) -> list[str]:
    """What ``prune_checkpoints`` removes under ``parent`` (its ``stepN`` folders: ``steps``, of which
    ``complete`` have meta.json): every one older than the ``keep``-th newest complete one up to ``upto``,
    but ``pinned``.

    Why ``upto``: a checkpoint newer than the one the master just completed may be complete on disk
    (restart mode's rank 0 writes its meta.json) while the master has not heard of the checkpoints in
    between. A master that re-adopted its workers after its own loss hears of them in a burst: counting
    the newer one, the prune for step 20 removed step 22, which the master marked complete a moment
    later and then restarted from (exit 3, "checkpoint has no layer", in the restart-mode fault tour under
    load). So only what the master knows complete counts, and nothing newer is removed."""
    if upto is not None:
        complete = [s for s in complete if s <= upto]
    newest = sorted(complete, reverse=True)
    oldest_kept = newest[keep - 1] if len(newest) >= keep else (newest[-1] if newest else 0)
    keep_also = {os.path.normpath(p) for p in pinned}
    paths = (os.path.join(parent, f"step{s:08d}") for s in sorted(steps) if s < oldest_kept)
    return [p for p in paths if os.path.normpath(p) not in keep_also]


def meta_sampler(job):
    """The data order every ``meta.json`` of the job records. Building it reads the whole dataset (a file
    dataset's index: seconds for a large one), so ``start_meta_sampler`` does it in the background when the
    master starts; a master that did it under its lock at the first checkpoint answered nothing for 5 s
    ("the master did not run for 5.19s", when this also imported torch: the master no longer does)."""
    from oobleck_mm.config.shape import layer_specs
    from oobleck_mm.data.build import build_dataset
    from oobleck_mm.data.sampler import GlobalBatchSampler

    layer_specs(job.model, job.data)  # a ``model.builder``'s module imported here, not at the first checkpoint
    return GlobalBatchSampler(len(build_dataset(job)), job.training.global_batch, job.training.seed)


def start_meta_sampler(job) -> Future:
    """``meta_sampler(job)`` in a thread of its own (daemon: a job that ends first does not wait for it)."""
    future: Future = Future()

    def build() -> None:
        try:
            future.set_result(meta_sampler(job))
        except BaseException as exc:  # noqa: BLE001 - said when the first meta.json needs it
            future.set_exception(exc)

    threading.Thread(target=build, name="meta-sampler", daemon=True).start()
    return future


def write_meta(directory: str, job, step: int, sampler=None):
    """``meta.json`` of a checkpoint whose layer files the workers wrote; returns the sampler it used
    (pass it back next time: ``meta_sampler`` says what building it costs)."""
    from oobleck_mm.config.shape import layer_specs
    from oobleck_mm.runtime.checkpoint_meta import save_meta

    if sampler is None:
        sampler = meta_sampler(job)
    save_meta(directory, job, step, layer_specs(job.model, job.data), sampler)
    return sampler


def resume_step(directory: str, job, progress: Callable[[str], None] | None = None) -> int:
    """The step a checkpoint resumes at; ``UserError`` naming ``--resume`` if it does not fit the job.

    Checked before any worker starts: the metadata, the layer names, every layer file
    (present, the recorded size, readable), the model's shape sections and the
    training settings the data order depends on.
    """
    from oobleck_mm.config.shape import layer_specs
    from oobleck_mm.runtime.checkpoint_meta import check_layer_files, read_meta

    try:
        meta = read_meta(directory)
    except UserError as err:
        raise UserError(f"--resume: {err}") from None
    names = [s.name for s in layer_specs(job.model, job.data)]
    if meta["layer_names"] != names:
        raise UserError(f"--resume: {directory} holds layers {meta['layer_names']}, this job's model has {names}")
    try:
        check_layer_files(directory, meta, progress)  # before any worker loads a shard
    except UserError as err:
        raise UserError(f"--resume: {err}") from None
    shape_changes = _model_shape_changes(meta.get("config", {}).get("model", {}), job)
    if shape_changes:
        raise UserError(f"--resume: {directory} was trained with another model shape: {'; '.join(shape_changes)}")
    saved = meta.get("config", {}).get("training", {})
    for key in ("seed", "global_batch"):
        if key in saved and saved[key] != getattr(job.training, key):
            raise UserError(
                f"--resume: {directory} was trained with training.{key} = {saved[key]}, the config says "
                f"{getattr(job.training, key)}; the resumed run would not continue the same training"
            )
    step = int(meta["step"])
    if step >= job.training.steps:
        raise UserError(
            f"--resume: {directory} is at step {step} and the job has training.steps = {job.training.steps}; "
            f"nothing is left to run (raise --steps above {step})"
        )
    return step


SHAPE_SECTIONS = ("llm", "vision", "audio", "projector")
"""``model`` sections whose fields decide tensor shapes: a checkpoint only loads into equal ones."""


def _model_shape_changes(saved: dict, job) -> list[str]:
    """``model.llm.hidden: 64 in the checkpoint, 96 in the config`` for every shape field that differs."""
    changes = []
    for section in SHAPE_SECTIONS:
        if section not in saved:
            continue  # a checkpoint of an older version: the layer files' own shapes are the last check
        ours = getattr(job.model, section)
        ours = dataclasses.asdict(ours) if ours is not None else None
        theirs = saved[section]
        if (ours is None) != (theirs is None):
            changes.append(
                f"model.{section}: {'absent' if theirs is None else 'set'} in the checkpoint, "
                f"{'absent' if ours is None else 'set'} in the config"
            )
            continue
        for key in sorted(set(ours or {}) | set(theirs or {})):
            if (ours or {}).get(key) != (theirs or {}).get(key):
                changes.append(
                    f"model.{section}.{key}: {theirs.get(key)!r} in the checkpoint, {ours.get(key)!r} in the config"
                )
    return changes
