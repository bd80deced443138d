#!/usr/bin/env python
"""Write a small random HuggingFace model to train with ``model.huggingface`` (nothing is downloaded).

    python examples/make_tiny_llava.py runs/models/tiny_llava                 # LLaVA: CLIP + Llama
    python examples/make_tiny_llava.py OUT --vision siglip --text qwen2       # LLaVA: SigLIP + Qwen2
    python examples/make_tiny_llava.py OUT --vision none --text mistral       # text-only Mistral

The directory is what ``save_pretrained`` writes (config.json, model.safetensors,
a small BPE tokenizer with Vicuna's chat template, the tower's image processor),
the same layout as a pretrained model on disk; ``configs/llava_tiny.yaml`` trains
the first one. Pass ``--shard 100KB`` for a sharded checkpoint with an index.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oobleck_mm.model.tiny_hf import TEXT_KINDS, VISION_KINDS, make_tiny_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write (created)")
    parser.add_argument("--text", choices=TEXT_KINDS, default="llama")
    parser.add_argument("--vision", choices=(*VISION_KINDS, "none"), default="clip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard", default=None, metavar="SIZE", help="max_shard_size, e.g. 100KB")
    args = parser.parse_args()
    vision = None if args.vision == "none" else args.vision
    out = make_tiny_model(args.out, text=args.text, vision=vision, seed=args.seed, max_shard_size=args.shard)
    kind = f"LLaVA ({args.vision} + {args.text})" if vision else f"{args.text} causal LM"
    print(f"wrote a random {kind} to {out}")


if __name__ == "__main__":
    main()
