#!/usr/bin/env python
"""Train from Python: your records as a HuggingFace ``datasets.Dataset``, a job as a dict, a node killed.

    python examples/python_api.py [--run-dir runs/python_api] [--steps 12]

The records are made here in memory (random pictures with a caption each); ``oobleck_mm.local`` writes
them once into the run folder, every rank reads them from there (``data.kind: hf_datasets``), and the
embedded cluster (a master, three agents and their workers) trains the built-in tiny multimodal model,
loses node2 at step 5 and goes on with the two others. The trained parameters are then checked against
the single-process reference trainer (``oobleck_mm.verify``). Exit 0 when all of it held.

``oobleck_mm.local`` starts other processes, so the call sits under ``if __name__ == "__main__":`` (as
with multiprocessing); ``model=`` takes your own builder function the same way (``examples/custom_model.py``).
"""

from __future__ import annotations

import argparse
import io
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

import oobleck_mm  # noqa: E402
from oobleck_mm import verify  # noqa: E402

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 230), "yellow": (230, 220, 40)}


def captioned_pictures(count: int, seed: int = 0) -> datasets.Dataset:
    """``count`` rows: a 32 px picture of a coloured square on noise, and a caption naming the colour."""
    rng = random.Random(seed)
    images, captions = [], []
    for _ in range(count):
        colour = rng.choice(sorted(COLOURS))
        pixels = np.random.default_rng(rng.randrange(2**31)).integers(0, 80, (32, 32, 3), dtype=np.uint8)
        x, y = rng.randrange(0, 16), rng.randrange(0, 16)
        pixels[y : y + 16, x : x + 16] = COLOURS[colour]
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "PNG")
        images.append([{"bytes": out.getvalue(), "path": None}])
        captions.append(f"A {colour} square" + rng.choice(("", " on a dark background", ", a little off centre")))
    features = datasets.Features({"caption": datasets.Value("string"), "image": datasets.List(datasets.Image())})
    return datasets.Dataset.from_dict({"caption": captions, "image": images}, features=features)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default=None, help="the run's folder (default runs/tiny_mm-<time>-<pid>)")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    job = {
        "model": {  # the built-in model: a small vision tower, projector and LLM
            "name": "tiny_mm",
            "vision": {"num_layers": 2, "hidden": 32, "num_heads": 2, "patch_size": 8},
            "projector": {"num_layers": 1},
            "llm": {"num_layers": 4, "hidden": 64, "num_heads": 4, "vocab_size": 261},
        },
        "data": {"image_size": 32, "max_seq_len": 96},
        "training": {"global_batch": 8, "microbatch_size": 2, "dtype": "float32"},
        "fault_tolerance": {"f": 1, "heartbeat_interval": "200ms", "heartbeat_timeout": "1s"},
        "cluster": {"nodes": 3},
    }
    run = oobleck_mm.local(
        job,
        nodes=3,
        steps=args.steps,
        dataset=captioned_pictures(64),
        columns={"text": "caption"},  # a caption per row: trained on as the answer to its picture
        inject=["kill:node2@step5"],
        run_dir=args.run_dir,
        save_final=Path(args.run_dir or root / "runs" / "python_api") / "final",
        tensorboard=False,
    )
    if not run.ok:
        print(f"the run ended with exit {run.exit_code}; see {run.run_dir}", file=sys.stderr)
        return run.exit_code
    lost = [e["node"] for e in run.events("lost")]
    print(f"trained {args.steps} steps; nodes lost and recovered from: {lost}; run folder {run.run_dir}")
    return verify.main(["--config", run.config, "--steps", str(args.steps), "--against", run.final])


if __name__ == "__main__":
    sys.exit(main())
