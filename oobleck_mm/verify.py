"""Trust a run: replay it on the single-process reference trainer and compare the parameters.

    oobleck-launch verify --config FILE --steps N --against DIR [--from DIR0] [--tolerance T]

``DIR`` is a checkpoint of the run (``--save-final``, a periodic or a
below-threshold checkpoint). The reference trainer runs the same global steps
from the same seed on the same global batches (from step 0, or from the
checkpoint ``--from`` names: a long run is checked over the window that
matters, a recovery, in minutes) and every layer's largest absolute and relative
difference is printed. First the checkpoint's manifest is checked (each layer
file's size and the sha256 its writer recorded, as ``--resume`` and ``export``
do: a flipped byte in an optimizer moment is no parameter difference). In a
float64 run Adam's moments are compared too, each relative to its largest
value in the layer. Exit 0 when the largest is within the tolerance, 1 when not, 2 on a bad
config, flag or checkpoint (a damaged one included).

The default tolerance fits the run's arithmetic. A float64 run (compute and
master weights) must equal the reference to 1e-9: any larger difference is a
logic error. In float32 and the half types two correct runs that merely add
the same numbers in another order drift apart, chaotically, by an amount that
grows with the steps (about 1e-7 after 12 tiny_mm steps, 5e-4 after 600), so no
fixed number fits. ``verify`` measures that drift for this very run: a second
reference, identical but accumulating each step's microbatches in reverse
order (the same sum, another rounding), trains alongside the first in its own
process, and the tolerance is ``NOISE_FACTOR`` times their largest difference
(never below ``FLOOR_ULPS`` units of the compute dtype at the parameters'
scale). A distributed run differs from the reference the same way (pipelines
sum their gradients separately before the all-reduce), so a correct run, with
or without recoveries, lands within it; a lost or repeated update does not
(docs/recovery.md shows both).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from typing import TYPE_CHECKING

from oobleck_mm.errors import ExitCode, UserError

if TYPE_CHECKING:
    from oobleck_mm.runtime.reference import ReferenceTrainer

# torch and the runtime are imported where they are used: `oobleck-launch` builds this command's
# parser on every start, and an agent must not pay seconds of imports to read its flags.

FLOAT64_TOLERANCE = 1e-9
"""A float64 run's bound: reduction order moves float64 results by ~1e-15 here; a logic error by far more."""
NOISE_FACTOR = 10.0
"""Tolerance = this times the reference's drift under a reversed summation order. Measured on tiny_mm
(float32): a fault-free 4-pipeline run's drift is 0.6x that noise after 12 steps and 1.5x after 600."""
FLOOR_ULPS = 64
"""The tolerance is at least this many units in the last place of the compute dtype at the largest
parameter's magnitude: early steps can drift less than one rounding of a large weight."""


@dataclass(frozen=True, slots=True)
class LayerDiff:
    name: str
    abs_diff: float
    """Largest |reference - run| over the layer's tensors."""
    ref_max: float
    """Largest |reference| over the layer's tensors: the scale ``relative`` divides by."""
    worst_tensor: str
    noise: float | None = None
    """Largest |reference - reversed-order reference| over the layer (float32 and half types)."""

    @property
    def relative(self) -> float:
        return self.abs_diff / self.ref_max if self.ref_max > 0 else self.abs_diff


@dataclass(frozen=True, slots=True)
class Verdict:
    layers: tuple[LayerDiff, ...]
    tolerance: float
    basis: str
    """Where the tolerance comes from, in words."""
    warning: str = ""
    """Said after the verdict when the tolerance is too wide to see one lost update."""

    @property
    def worst(self) -> LayerDiff:
        return max(self.layers, key=lambda d: d.abs_diff)

    @property
    def ok(self) -> bool:
        return self.worst.abs_diff <= self.tolerance

    def format(self) -> str:
        width = max(len(d.name) for d in self.layers)
        noisy = any(d.noise is not None for d in self.layers)
        head = f"{'layer':<{width}}  {'max |diff|':>10}  {'max |ref|':>9}  {'relative':>9}" + (
            "  noise" if noisy else ""
        )
        lines = [head]
        for d in self.layers:
            noise = f"  {d.noise:.2e}" if d.noise is not None else ""
            lines.append(f"{d.name:<{width}}  {d.abs_diff:>10.2e}  {d.ref_max:>9.3g}  {d.relative:>9.2e}{noise}")
        w = self.worst
        lines.append(
            f"largest parameter difference {w.abs_diff:.3e} at {w.name}.{w.worst_tensor}: "
            f"{'within' if self.ok else 'OUTSIDE'} tolerance {self.tolerance:.1e} ({self.basis})"
        )
        if self.warning:
            lines.append(self.warning)
        return "\n".join(lines)


def compare(
    job, steps: int, directory: str, progress=print, start_dir: str | None = None, tolerance: float | None = None
) -> Verdict:
    """The run's checkpoint ``directory`` against the reference after ``steps`` global steps."""
    import torch

    from oobleck_mm.precision import compute_dtype, master_dtype
    from oobleck_mm.runtime.checkpoint import load_layer
    from oobleck_mm.runtime.checkpoint_meta import check_layer_files, read_meta

    meta = read_meta(directory)
    # The manifest first: sizes and the sha256 each writer recorded (a flipped byte in an optimizer moment
    # is no parameter difference, and --resume and export refuse such a folder: so does verify, issue 54).
    check_layer_files(directory, meta, progress)
    if meta["step"] != steps:
        progress(f"note: the checkpoint is at step {meta['step']}, comparing after {steps} reference steps")
    exact = compute_dtype(job.training) == master_dtype(job.training) == torch.float64
    noise_run = None
    if tolerance is None and not exact:
        noise_run = _NoiseReference(job, steps, start_dir)  # in parallel with the reference below
    try:
        trainer = _reference(job, directory, start_dir)
        first = trainer.start_step
        for step in range(first, steps):
            loss = trainer.train_step(step)
            if (step - first) % 50 == 0 or step == steps - 1:
                progress(f"reference step {step + 1}/{steps}: loss {loss:.6f}")
        noise = noise_run.result() if noise_run is not None else None
    finally:
        if noise_run is not None:
            noise_run.close()
    layers = []
    for i, spec in enumerate(trainer.specs):
        held = load_layer(directory, job, i, trainer.specs)
        saved = held.module.state_dict()
        reference = trainer.layer_state(i)
        if exact:  # Adam's moments too: a lost or repeated update moves them as it moves the parameters
            saved = {**saved, **_moments(held.module, held.optimizer)}
            reference = {**reference, **_moments(trainer.layers[i], trainer.optimizers.get(i))}
            # Relative to the layer's largest value of the same moment: exp_avg_sq is ~1e-8 here, and an
            # absolute 1e-9 would pass it 10% off. Not to each tensor's own: a key projection's bias gets an
            # exactly-zero gradient in exact arithmetic (softmax ignores a per-query constant), so its moments
            # are rounding noise (~1e-17) that two correct runs do not share. Float64 moments are otherwise
            # exact up to reduction order, as the parameters are.
            moment_keys = [k for k in reference if k.startswith("optimizer.")]
            largest: dict[str, float] = {}
            for key in moment_keys:
                kind = key.rsplit(".", 1)[1]
                if reference[key].numel():
                    largest[kind] = max(largest.get(kind, 0.0), reference[key].abs().max().item())
            for key in moment_keys:
                scale = largest.get(key.rsplit(".", 1)[1]) or 1.0
                ref = reference.pop(key) / scale
                reference[f"{key} (relative)"] = ref
                if key in saved:
                    saved[f"{key} (relative)"] = saved.pop(key).to(ref.dtype) / scale
        worst, where, scale, drift = 0.0, "", 0.0, None
        for key, ref in reference.items():
            if key not in saved:
                raise UserError(
                    f"{directory}: layer {spec.name!r} has no tensor {key!r}; is it this model's checkpoint?"
                )
            diff = (saved[key].to(ref.dtype) - ref).abs().max().item() if ref.numel() else 0.0
            scale = max(scale, ref.abs().max().item() if ref.numel() else 0.0)
            if diff >= worst:
                worst, where = diff, key
            if noise is not None:
                other = (noise[spec.name][key] - ref).abs().max().item() if ref.numel() else 0.0
                drift = max(drift or 0.0, other)
        layers.append(LayerDiff(spec.name, worst, scale, where, drift))
    if tolerance is not None:
        return Verdict(tuple(layers), tolerance, "--tolerance")
    if exact:
        return Verdict(tuple(layers), FLOAT64_TOLERANCE, "float64: equal up to reduction order")
    measured = max(d.noise or 0.0 for d in layers)
    floor = FLOOR_ULPS * torch.finfo(compute_dtype(job.training)).eps * max(d.ref_max for d in layers)
    basis = (
        f"{job.training.dtype}: {NOISE_FACTOR:g} x the reference's own drift under a reversed summation "
        f"order, {measured:.1e}"
        + (f"; at least {FLOOR_ULPS} ulps, {floor:.1e}" if floor > NOISE_FACTOR * measured else "")
    )
    tolerance = max(NOISE_FACTOR * measured, floor)
    return Verdict(tuple(layers), tolerance, basis, _blind_spot(job, steps, tolerance))


def _moments(module, optimizer) -> dict:
    """Adam's state per trainable parameter of ``module``, keyed ``optimizer.<k>.<name>`` (k: its position),
    without the step count. A parameter ``optimizer`` does not own (a tied LM head's weight in the reference)
    has no entry: its owner's layer compares it."""
    from oobleck_mm.runtime.update import trainable_params

    if optimizer is None:
        return {}
    return {
        f"optimizer.{k}.{name}": value.detach()
        for k, param in enumerate(trainable_params(module))
        for name, value in optimizer.state.get(param, {}).items()
        if name != "step"
    }


def checkpoint_windows(checkpoints_dir: str, final_dir: str | None = None) -> list[tuple[str | None, str, int]]:
    """(start checkpoint or None for step 0, end checkpoint, end step) for every window between the
    complete periodic checkpoints in ``checkpoints_dir`` (``stepNNNNNNNN`` with ``meta.json``), then
    from the last of them to ``final_dir``."""
    from oobleck_mm.runtime.checkpoint_meta import read_meta

    found = []
    if os.path.isdir(checkpoints_dir):
        for name in sorted(os.listdir(checkpoints_dir)):
            path = os.path.join(checkpoints_dir, name)
            if name.startswith("step") and os.path.exists(os.path.join(path, "meta.json")):
                found.append((int(read_meta(path)["step"]), path))
    if final_dir:
        found.append((int(read_meta(final_dir)["step"]), final_dir))
    found.sort()
    windows, start = [], None
    for step, path in found:
        windows.append((start, path, step))
        start = path
    return windows


def compare_windows(
    job, windows: list[tuple[str | None, str, int]], progress=print, tolerance: float | None = None
) -> list[Verdict]:
    """``compare`` over each window: a long run judged where it can fail for a defect, never for drift.

    Over hundreds of steps a correct run drifts from the reference by reduction order alone (float64:
    past 1e-9 after ~190 tiny_mm steps); started from the run's own checkpoint, each window replays only
    its own steps, so the float64 bound (and the measured noise of the other dtypes) holds per window,
    and a lost or repeated update in any window still shows."""
    verdicts = []
    for start, end, step in windows:
        progress(f"window {os.path.basename(start) if start else 'step 0'} -> {os.path.basename(end)} (step {step})")
        verdicts.append(compare(job, step, end, progress=lambda line: None, start_dir=start, tolerance=tolerance))
    return verdicts


def _blind_spot(job, steps: int, tolerance: float) -> str:
    """A warning when one Adam update (about the learning rate per weight) fits inside the tolerance:
    chaotic float32 drift over a long run can be as large as a lost or repeated step."""
    from oobleck_mm.runtime.optim import lr_at

    lr = lr_at(job.training, max(0, steps - 1))
    if steps == 0 or tolerance < lr:
        return ""
    return (
        f"note: the tolerance is wider than one update at the last step's learning rate ({lr:.1e}): over "
        f"{steps} {job.training.dtype} steps a run one update off would pass too. Check a window of the run "
        "with --from CHECKPOINT, or rerun it in float64 (--set training.dtype=float64)"
    )


def _reference(job, directory: str, start_dir: str | None, reverse: bool = False) -> ReferenceTrainer:
    from oobleck_mm.runtime.checkpoint_meta import read_meta
    from oobleck_mm.runtime.reference import ReferenceTrainer

    trainer = ReferenceTrainer(job, reverse_microbatches=reverse)
    names = [s.name for s in trainer.specs]
    if read_meta(directory)["layer_names"] != names:
        raise UserError(f"{directory}: layers {read_meta(directory)['layer_names']} are not this model's {names}")
    if start_dir:
        trainer.load_checkpoint(start_dir)
    return trainer


class _NoiseReference:
    """The reversed-order reference in a child process (the two share the machine's cores)."""

    def __init__(self, job, steps: int, start_dir: str | None) -> None:
        from oobleck_mm.config import dump_config

        self._tmp = tempfile.TemporaryDirectory(prefix="oobleck-verify-")
        config = os.path.join(self._tmp.name, "job.yaml")
        with open(config, "w", encoding="utf-8") as fh:
            dump_config(job, fh)
        self._out = os.path.join(self._tmp.name, "states.pt")
        from oobleck_mm.runtime.template import warm_process

        # A fork of the warm template, never of this process (torch's threads): a fresh interpreter's
        # imports once per process, none when the template already runs (a test process, a second verify).
        self._proc = warm_process(_noise_main, config, steps, start_dir, self._out)
        self._proc.start()

    def result(self) -> dict:
        import torch

        self._proc.join()
        if self._proc.exitcode != 0 or not os.path.exists(self._out):
            raise RuntimeError(f"the reversed-order reference failed (exit code {self._proc.exitcode})")
        return torch.load(self._out, weights_only=True)

    def close(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._tmp.cleanup()


def _noise_main(config: str, steps: int, start_dir: str | None, out: str) -> None:
    import torch

    from oobleck_mm.config import load_config
    from oobleck_mm.runtime.reference import ReferenceTrainer

    job = load_config(config)
    trainer = ReferenceTrainer(job, reverse_microbatches=True)
    if start_dir:
        trainer.load_checkpoint(start_dir)
    for step in range(trainer.start_step, steps):
        trainer.train_step(step)
    states = {spec.name: trainer.layer_state(i) for i, spec in enumerate(trainer.specs)}
    torch.save(states, out)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="python -m oobleck_mm.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's job config YAML")
    parser.add_argument("--deepspeed", default=None, metavar="FILE", help="the run's DeepSpeed JSON config, if any")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="the run's --set overrides, if any",
    )
    parser.add_argument("--steps", type=int, required=True, help="global steps the run had trained at DIR")
    parser.add_argument("--against", required=True, metavar="DIR", help="the run's checkpoint to check")
    parser.add_argument(
        "--from",
        dest="start",
        default=None,
        metavar="DIR0",
        help="start the reference from this earlier checkpoint of the same run (its step), "
        "not from step 0: checks the steps in between",
    )
    parser.add_argument(
        "--windows",
        default=None,
        metavar="CHECKPOINTS",
        help="judge the run window by window: between each pair of complete periodic checkpoints "
        "in this folder (<run dir>/checkpoints; keep them all with --set "
        "fault_tolerance.keep_checkpoints=0), then from the last one to --against",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest allowed difference (default: 1e-9 for float64 runs; for float32 and "
        f"the half types {NOISE_FACTOR:g} x the run's own reordering drift, measured)",
    )
    return parser


def main(argv=None, args: argparse.Namespace | None = None) -> int:
    args = args if args is not None else build_parser().parse_args(argv)
    from oobleck_mm.config import load_config
    from oobleck_mm.runtime.checkpoint_meta import read_meta

    start = time.perf_counter()
    try:
        job = load_config(args.config, args.deepspeed, args.overrides)
        # The run's schedule: a run launched with --steps N (or resumed to it) decays its learning rate over N
        # steps, whatever the file says; the checkpoint records N. Replayed over the file's steps instead, a
        # correct run read ~5e-5 off (a scaled-down mllm_10b: --steps 20 against the file's 100).
        ran = ((read_meta(args.against).get("config") or {}).get("training") or {}).get("steps")
        set_here = any(o.split("=", 1)[0].strip() == "training.steps" for o in args.overrides)
        if ran is not None and int(ran) != job.training.steps and not set_here:
            print(
                f"note: the run's schedule is over {int(ran)} steps (its checkpoint's training.steps), not the "
                f"file's {job.training.steps}: replayed so",
                file=sys.stderr,
            )
            job = load_config(args.config, args.deepspeed, [*args.overrides, f"training.steps={int(ran)}"])
        # The samples the run left out (the master's check, data.skip_bad_samples) are left out here too.
        recorded = (read_meta(args.against).get("config") or {}).get("data") or {}
        if recorded.get("excluded_samples"):
            job.data.excluded_samples = tuple(recorded["excluded_samples"])
        # The planning shape the master measured over the data (data.check.measure_shape), when the file
        # left it to be measured: the same numbers, not a second pass over the data.
        for key in ("mean_text_tokens", "mean_images_per_sample"):
            if getattr(job.data, key) is None and recorded.get(key) is not None:
                setattr(job.data, key, float(recorded[key]))
        from oobleck_mm.data.check import ensure_shape

        ensure_shape(job, lambda line: print(line, file=sys.stderr, flush=True))
        if args.steps < 0:
            raise UserError(f"--steps: must be >= 0, got {args.steps}")
        if args.tolerance is not None and not args.tolerance >= 0:
            raise UserError(f"--tolerance: must be >= 0, got {args.tolerance}")
        if args.start and read_meta(args.start)["step"] > args.steps:
            raise UserError(
                f"--from: {args.start} is at step {read_meta(args.start)['step']}, after --steps {args.steps}"
            )
        say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        if args.windows:
            if not os.path.isdir(args.windows):
                raise UserError(f"--windows: {args.windows!r} is not a folder of periodic checkpoints")
            windows = [w for w in checkpoint_windows(args.windows, args.against) if w[2] <= args.steps]
            verdicts = compare_windows(job, windows, progress=say, tolerance=args.tolerance)
            for (first, _, step), v in zip(windows, verdicts):
                print(
                    f"steps {int(read_meta(first)['step']) if first else 0}..{step}: largest difference "
                    f"{v.worst.abs_diff:.3e} ({'within' if v.ok else 'OUTSIDE'} {v.tolerance:.1e})"
                )
            ok = all(v.ok for v in verdicts)
            print(f"{len(verdicts)} windows, {'all within tolerance' if ok else 'NOT all within tolerance'}")
            print(f"verified in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            return ExitCode.OK if ok else ExitCode.ERROR
        verdict = compare(job, args.steps, args.against, start_dir=args.start, tolerance=args.tolerance, progress=say)
    except UserError as error:  # a bad config, flag or checkpoint; anything else is a bug and raises
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    print(verdict.format())
    print(f"verified in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return ExitCode.OK if verdict.ok else ExitCode.ERROR


if __name__ == "__main__":
    from oobleck_mm.lifetime import end_now

    end_now(int(main()))  # nothing to release: torch's teardown took 1.3 s after the verdict
