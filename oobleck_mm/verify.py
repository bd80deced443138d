"""Trust a run: replay it on the single-process reference trainer and compare the final parameters.

    python -m oobleck_mm.verify --config FILE --steps N --against DIR [--tolerance T]

``DIR`` is a checkpoint directory (``--save-final`` or a below-threshold
checkpoint). The reference trainer runs the same N global steps from the same
seed on the same global batches; the largest absolute parameter difference over
every layer is printed. Exit 0 when it is within the tolerance, 1 when not,
2 on a bad config or argument.
"""

from __future__ import annotations

import argparse
import sys

from oobleck_mm.config import load_config
from oobleck_mm.errors import ExitCode, UserError
from oobleck_mm.runtime.checkpoint import load_params, read_meta
from oobleck_mm.runtime.reference import ReferenceTrainer


def compare(job, steps: int, directory: str, progress=print) -> tuple[float, str]:
    """Largest |reference - saved| over all parameters after ``steps`` steps, and where it is."""
    meta = read_meta(directory)
    if meta["step"] != steps:
        progress(f"note: the checkpoint is at step {meta['step']}, comparing after {steps} reference steps")
    trainer = ReferenceTrainer(job)
    if meta["layer_names"] != [s.name for s in trainer.specs]:
        raise UserError(f"{directory}: layers {meta['layer_names']} are not this model's")
    for step, loss in trainer.train(steps):
        if step % 10 == 0 or step == steps - 1:
            progress(f"reference step {step}: loss {loss:.6f}")
    worst, where = 0.0, ""
    for i, spec in enumerate(trainer.specs):
        saved = load_params(directory, spec.name)
        for key, ref in trainer.layer_state(i).items():
            diff = (saved[key].to(ref.dtype) - ref).abs().max().item()
            if diff >= worst:
                worst, where = diff, f"{spec.name}.{key}"
    return worst, where


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oobleck_mm.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--deepspeed", default=None, metavar="FILE", help="the run's DeepSpeed JSON config, if any")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="the run's --set overrides, if any")
    parser.add_argument("--steps", type=int, required=True, help="global steps the run trained")
    parser.add_argument("--against", required=True, help="checkpoint directory of the run")
    parser.add_argument("--tolerance", type=float, default=1e-9)
    args = parser.parse_args(argv)
    try:
        job = load_config(args.config, args.deepspeed, args.overrides)
        if args.steps < 0:
            raise UserError(f"--steps: must be >= 0, got {args.steps}")
        worst, where = compare(job, args.steps, args.against)
    except UserError as error:  # a bad config, flag or checkpoint; anything else is a bug and raises
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    ok = worst <= args.tolerance
    print(f"largest parameter difference {worst:.3e} at {where}: "
          f"{'within' if ok else 'OUTSIDE'} tolerance {args.tolerance:.1e}")
    return ExitCode.OK if ok else ExitCode.ERROR


if __name__ == "__main__":
    sys.exit(main())
