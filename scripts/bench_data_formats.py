#!/usr/bin/env python
"""Records/s a rank reads from each data format: LLaVA JSON with image files, a ``datasets`` folder with the
images inside, Parquet, and WebDataset tar shards.

    python scripts/bench_data_formats.py [--records 20000] [--loads 2000] [--json OUT]

The same ``--records`` LLaVA-style records (a question with an image in nine of ten, answers of 15-150
words; 64 distinct 24-48 px PNGs, as LLaVA's mixes reuse their images) are written four ways (the shards:
10 tars of ``.json`` turns and ``.png`` members, indexed on first read, index kept out of the timing's
cache: ``data.cache_dir: null``), then each
is read in a fresh process (as a rank is) by both readers: the built-in model's byte-level one and a tiny
HF LLaVA's own tokenizer and image processor (``data.cache_dir: null``: every rank's cost without the
node's cache). Two figures each: the records built per second (what a rank does before its first step)
and samples loaded per second (``dataset[i]`` for ``--loads`` random indices: pixels decoded and resized),
and, beside it, the same samples' layouts per second (``dataset.layout(i)``: text and media placeholders, no
pixels: what the stages after the encoders' input layers read, ``TrainingData.microbatch(media=False)``).
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import random
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = ("the", "a", "red", "square", "circle", "picture", "shows", "blue", "next", "to", "small", "green", "on")


def write_all(folder: Path, count: int) -> dict[str, str]:
    """The records as a JSON file with image files, a save_to_disk folder and a Parquet file."""
    import datasets
    import numpy as np
    from PIL import Image

    rng = random.Random(0)
    (folder / "images").mkdir(parents=True)
    pool = []
    for k in range(64):
        side = rng.randint(24, 48)
        pixels = np.random.default_rng(k).integers(0, 256, (side, side + rng.randint(-8, 8), 3), dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "PNG")
        pool.append(out.getvalue())
        (folder / "images" / f"{k}.png").write_bytes(pool[-1])
    rows, table = [], {"id": [], "conversations": [], "image": []}
    for i in range(count):
        k = rng.randrange(64) if rng.random() < 0.9 else None
        turns = [
            {"from": "human", "value": ("<image>\n" if k is not None else "") + "What is in the picture?"},
            {"from": "gpt", "value": " ".join(rng.choice(WORDS) for _ in range(rng.randint(15, 150))) + "."},
        ]
        rows.append({"id": f"s{i}", "conversations": turns, **({"image": f"images/{k}.png"} if k is not None else {})})
        table["id"].append(f"s{i}")
        table["conversations"].append(turns)
        table["image"].append([{"bytes": pool[k], "path": None}] if k is not None else [])
    (folder / "data.json").write_text(json.dumps(rows))
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "conversations": datasets.List({"from": datasets.Value("string"), "value": datasets.Value("string")}),
            "image": datasets.List(datasets.Image()),
        }
    )
    ds = datasets.Dataset.from_dict(table, features=features)
    ds.save_to_disk(str(folder / "folder"))
    ds.to_parquet(str(folder / "data.parquet"))
    per_shard = -(-count // 10)
    (folder / "shards").mkdir()
    for k in range(0, count, per_shard):
        with tarfile.open(folder / "shards" / f"part-{k // per_shard:02d}.tar", "w") as tar:
            for row in rows[k : k + per_shard]:
                members = [(".json", json.dumps({"conversations": row["conversations"]}).encode())]
                if "image" in row:
                    members.append((".png", (folder / row["image"]).read_bytes()))
                for ext, data in members:
                    info = tarfile.TarInfo(row["id"] + ext)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return {
        "llava_json": str(folder / "data.json"),
        "hf_datasets folder": str(folder / "folder"),
        "hf_datasets parquet": str(folder / "data.parquet"),
        "webdataset shards": str(folder / "shards" / "part-{00..09}.tar"),
    }


def _one(raw: dict, loads: int, out) -> None:
    """A fresh process (a rank): build the dataset, then load ``loads`` random samples."""
    from oobleck_mm.config import config_from_dict
    from oobleck_mm.data.loader import build_dataset

    job = config_from_dict(raw)
    began = time.perf_counter()
    dataset = build_dataset(job)
    built = time.perf_counter() - began
    rng = random.Random(1)
    indices = [rng.randrange(len(dataset)) for _ in range(loads)]
    began = time.perf_counter()
    for i in indices:
        dataset[i]
    loaded = time.perf_counter() - began
    began = time.perf_counter()
    for i in indices:
        dataset.layout(i)
    out.put((len(dataset), built, loaded, time.perf_counter() - began))


def run(raw: dict, loads: int) -> tuple:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_one, args=(raw, loads, out))
    proc.start()
    result = out.get(timeout=3600)
    proc.join(60)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20_000)
    ap.add_argument("--loads", type=int, default=2_000)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from oobleck_mm.model.tiny_hf import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        began = time.perf_counter()
        paths = write_all(tmp / "data", args.records)
        print(f"wrote {args.records} records four ways in {time.perf_counter() - began:.1f} s", flush=True)
        model = make_tiny_model(tmp / "model", text="llama", vision="clip")
        readers = {
            "byte-level (tiny_mm)": lambda data: {
                **_tiny_mm(),
                "data": {**data, "image_size": 32, "max_seq_len": 512, "cache_dir": None},
            },
            "HF tokenizer + image processor": lambda data: {
                "model": {"huggingface": str(model)},
                "data": {**data, "max_seq_len": 512, "cache_dir": None},
                "training": {"global_batch": 16, "microbatch_size": 2},
            },
        }
        for reader, make in readers.items():
            for kind, path in paths.items():
                data = {"kind": kind.split()[0], "path": path, "mean_text_tokens": 100, "mean_images_per_sample": 0.9}
                n, built, loaded, laid_out = run(make(data), args.loads)
                row = {
                    "reader": reader,
                    "format": kind,
                    "records": n,
                    "build_s": round(built, 2),
                    "records_per_s": round(n / built),
                    "samples_loaded_per_s": round(args.loads / loaded),
                    "layouts_loaded_per_s": round(args.loads / laid_out),
                }
                rows.append(row)
                print(
                    f"{reader:<32} {kind:<20} built {n} records in {built:6.2f} s ({n / built:8.0f}/s); "
                    f"loaded {args.loads / loaded:6.0f} samples/s, {args.loads / laid_out:6.0f} layouts/s "
                    f"(x{loaded / laid_out:.1f})",
                    flush=True,
                )
    for reader in readers:
        base = next(r for r in rows if r["reader"] == reader and r["format"] == "llava_json")
        for r in rows:
            if r["reader"] == reader and r is not base:
                print(
                    f"{reader}: {r['format']} vs llava_json: build x{r['records_per_s'] / base['records_per_s']:.2f}, "
                    f"load x{r['samples_loaded_per_s'] / base['samples_loaded_per_s']:.2f}"
                )
    if args.json:
        command = "python scripts/bench_data_formats.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.json).write_text(json.dumps({"command": command.strip(), "rows": rows}, indent=1) + "\n")
    return 0


def _tiny_mm() -> dict:
    import yaml

    raw = yaml.safe_load((ROOT / "configs" / "tiny_mm.yaml").read_text())
    return {k: v for k, v in raw.items() if k != "data"}


if __name__ == "__main__":
    sys.exit(main())
