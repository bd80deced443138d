#!/usr/bin/env python
"""What a rank pays to get a LLaVA JSON dataset's records, with and without the node's record cache.

    python scripts/bench_data_cache.py [--records 665000] [--ranks 2] [--ranks-records 50000] [--json OUT]

A synthetic LLaVA-style file (``--records`` samples: a question with an image in
nine of ten, answers of 15-150 words) on a tiny HF LLaVA (Llama + CLIP, its own
tokenizer and chat template), read by ``HFLlavaJsonDataset``:

- one process, ``data.cache_dir: null``: every rank's cost before the cache;
- one process, an empty cache: the node's first rank (tokenize, then write);
- one process, that cache complete: each other rank of the node, and every joiner;

then ``--ranks`` processes at once (a node's ranks starting together) on
``--ranks-records`` samples, with no cache and with an empty one: the seconds
until the last rank has the records. Each figure is its own fresh process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = (
    "the",
    "a",
    "red",
    "square",
    "circle",
    "picture",
    "shows",
    "blue",
    "next",
    "to",
    "small",
    "large",
    "green",
    "triangle",
    "on",
    "left",
    "right",
    "above",
    "below",
    "image",
    "colour",
    "shape",
    "of",
    "and",
)


def write_records(path: Path, count: int, images: Path) -> None:
    rng = random.Random(0)
    names = sorted(p.name for p in images.iterdir())
    with open(path, "w") as fh:
        fh.write("[")
        for i in range(count):
            with_image = rng.random() < 0.9
            question = ("<image>\n" if with_image else "") + "What is in the picture?"
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 150))) + "."
            record = {
                "id": f"s{i}",
                "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}],
            }
            if with_image:
                record["image"] = f"images/{rng.choice(names)}"
            fh.write(("," if i else "") + json.dumps(record))
        fh.write("]")


def _one(raw: dict, out) -> None:
    """A fresh process (a rank): build the dataset, report (seconds, built it, samples, RSS MB)."""
    import psutil

    from oobleck_mm.config import config_from_dict
    from oobleck_mm.data.loader import build_dataset

    job = config_from_dict(raw)
    began = time.perf_counter()
    dataset = build_dataset(job)
    seconds = time.perf_counter() - began
    out.put((seconds, dataset.built, len(dataset), psutil.Process().memory_info().rss / 2**20))


def run(raw: dict, ranks: int = 1) -> list[tuple]:
    ctx = mp.get_context("spawn")  # a fresh interpreter each, as a worker is
    out = ctx.Queue()
    procs = [ctx.Process(target=_one, args=(raw, out)) for _ in range(ranks)]
    for p in procs:
        p.start()
    results = [out.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join(60)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=665_000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--ranks-records", type=int, default=50_000)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from oobleck_mm.model.tiny_hf import make_tiny_model

    rows = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = make_tiny_model(tmp / "model", text="llama", vision="clip")
        shutil.copytree(ROOT / "tests" / "fixtures" / "llava" / "images", tmp / "images")

        def job(records: int, cache) -> dict:
            path = tmp / f"data-{records}.json"
            if not path.exists():
                began = time.perf_counter()
                write_records(path, records, tmp / "images")
                print(
                    f"wrote {records} records ({path.stat().st_size / 2**20:.0f} MB) in "
                    f"{time.perf_counter() - began:.1f} s",
                    flush=True,
                )
            return {
                "model": {"huggingface": str(model)},
                "data": {
                    "kind": "llava_json",
                    "path": str(path),
                    "max_seq_len": 512,
                    "mean_text_tokens": 100,
                    "mean_images_per_sample": 0.9,
                    "cache_dir": cache,
                },
                "training": {"global_batch": 16, "microbatch_size": 2},
            }

        cache = str(tmp / "cache")
        for name, c in (
            ("no cache", None),
            ("empty cache (the node's first rank)", cache),
            ("complete cache (the node's other ranks, joiners)", cache),
        ):
            [(seconds, built, n, rss)] = run(job(args.records, c))
            rows[name] = {"seconds": round(seconds, 2), "built": built, "samples": n, "rss_mb": round(rss)}
            print(
                f"{args.records} records, {name}: {seconds:.2f} s (tokenized here: {built}), RSS {rss:.0f} MB",
                flush=True,
            )
        size = sum(f.stat().st_size for f in Path(cache).rglob("*") if f.is_file())
        rows["cache_mb"] = round(size / 2**20, 1)
        print(f"cache folder: {size / 2**20:.1f} MB", flush=True)
        for name, c in (("no cache", None), ("empty cache", str(tmp / "cache-ranks"))):
            began = time.perf_counter()
            results = run(job(args.ranks_records, c), args.ranks)
            wall = time.perf_counter() - began
            rows[f"{args.ranks} ranks at once, {name}"] = {
                "last_rank_s": round(max(r[0] for r in results), 2),
                "wall_s": round(wall, 2),
                "tokenized_by": sum(1 for r in results if r[1]),
            }
            print(
                f"{args.ranks} ranks at once on {args.ranks_records} records, {name}: the last had them after "
                f"{max(r[0] for r in results):.2f} s; {sum(1 for r in results if r[1])} tokenized",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": "python scripts/bench_data_cache.py "
                    + " ".join(argv if argv is not None else sys.argv[1:]),
                    **rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
