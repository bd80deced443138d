#!/usr/bin/env python
"""Loading a HuggingFace model's weights per stage (issue 11): peak RSS and load time per worker.

    python scripts/bench_hf_load.py [--json OUT] [--stages 4] [--hidden 1024] [--layers 8] [--repeats 3]
                                    [--compare-init]

Writes a random LLaVA (CLIP + Llama) with ``save_pretrained`` into a temporary
directory, then, in a fresh process per measurement (so ``ru_maxrss`` is that
worker's own peak), builds either every layer of the model (a worker holding the
whole model) or the layers of one stage of an even ``--stages``-stage cut (a
worker of a multi-stage plan), the way a worker does: ``build_layer`` per layer,
which reads only that layer's tensors from the safetensors file.

Printed per case: the parameter bytes held, the peak RSS, the peak minus the
process's RSS after importing torch and transformers (the interpreter's
overhead), and the load time. Target: a stage's worker peaks at its share of
the model plus the overhead, not at the whole model.

``--compare-init`` measures each case a second way, in turns with the first:
the layer built with its random initialisation (from a copy of the directory
without its safetensors files), then its tensors read in (``load_hf_weights``),
as every load did before ``oobleck_mm.model.skip_init``; it prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


DATA = {"mean_images_per_sample": 1, "image_size": 32, "max_seq_len": 256}


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    """VmHWM: the peak RSS since the last reset (``_reset_peak``)."""
    with open("/proc/self/status") as fh:
        line = next(x for x in fh if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> None:
    # Linux: writing 5 to clear_refs resets VmHWM to the current RSS. A spawned child's peak
    # otherwise starts at its parent's RSS at fork time, and import-time peaks would count too.
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _make_model(directory: str, text: dict) -> None:
    from oobleck_mm.model.tiny_hf import make_tiny_model

    make_tiny_model(directory, "llama", "clip", text_sizes=text)


def _worker(directory: str, layers: list[int], out, init_first: str | None = None) -> None:
    import torch  # noqa: F401  (the interpreter's overhead is measured after the imports a worker has)
    import transformers  # noqa: F401

    from oobleck_mm.config import config_from_dict
    from oobleck_mm.model.layers import build_layer, model_layer_specs

    job = config_from_dict({"model": {"huggingface": directory}, "data": DATA})
    specs = model_layer_specs(job)
    for name in ("vision.block0", "llm.block0"):  # import transformers' modeling modules (small layers' work only)
        with torch.device("meta"):
            build_layer(job, [s.name for s in specs].index(name), specs)
    base = _rss_mb()
    _reset_peak()
    t0 = time.perf_counter()
    if init_first is None:
        held = [build_layer(job, i, specs) for i in layers]
    else:  # the random init, then the read: what skip_init saves
        from oobleck_mm.model.hf_weights import load_hf_weights

        random_job = config_from_dict({"model": {"huggingface": init_first}, "data": DATA})
        held = [build_layer(random_job, i, specs) for i in layers]
        for layer in held:
            load_hf_weights(layer, directory)
    seconds = time.perf_counter() - t0
    nbytes = sum(p.numel() * p.element_size() for m in held for p in m.parameters())
    out.send(
        {
            "layers": [specs[i].name for i in layers],
            "param_mb": nbytes / 2**20,
            "base_rss_mb": base,
            "peak_rss_mb": _peak_rss_mb(),
            "load_s": seconds,
        }
    )


def measure(directory: str, layers: list[int], init_first: str | None = None) -> dict:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_worker, args=(directory, layers, send, init_first))
    p.start()
    try:
        result = recv.recv()
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024, help="text model width (default 1024)")
    ap.add_argument("--layers", type=int, default=8, help="text model blocks (default 8)")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per case; the median is reported")
    ap.add_argument(
        "--compare-init",
        action="store_true",
        help="also measure each case with the random init run before the read (the earlier path)",
    )
    args = ap.parse_args(argv)

    from oobleck_mm.config import config_from_dict
    from oobleck_mm.model.layers import model_layer_specs

    with tempfile.TemporaryDirectory(prefix="bench_hf_load_") as tmp:
        text = {
            "hidden_size": args.hidden,
            "intermediate_size": 4 * args.hidden,
            "num_hidden_layers": args.layers,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
        }
        directory = str(Path(tmp) / "llava")
        maker = mp.get_context("spawn").Process(target=_make_model, args=(directory, text))  # keeps this process small
        maker.start()
        maker.join()
        size_mb = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors")) / 2**20
        config_only = str(Path(tmp) / "config-only")
        shutil.copytree(directory, config_only, ignore=shutil.ignore_patterns("*.safetensors*"))
        job = config_from_dict({"model": {"huggingface": directory}, "data": DATA})
        n = len(model_layer_specs(job))
        cut = [round(i * n / args.stages) for i in range(args.stages + 1)]
        cases = {"whole model": list(range(n))}
        for s in range(args.stages):
            cases[f"stage {s} of {args.stages}"] = list(range(cut[s], cut[s + 1]))
        print(f"model: {n} layers, safetensors {size_mb:.1f} MiB; {args.repeats} fresh processes per case", flush=True)
        rows = []
        for name, layers in cases.items():
            ways = {"load": None, "init+load": config_only} if args.compare_init else {"load": None}
            runs = {way: [] for way in ways}
            for _ in range(args.repeats):  # the ways take turns: the machine's load hits both alike
                for way, init_first in ways.items():
                    runs[way].append(measure(directory, layers, init_first))
            row = {"case": name}
            for way, results in runs.items():
                r = sorted(results, key=lambda x: x["peak_rss_mb"])[len(results) // 2]
                suffix = "" if way == "load" else "_init_first"
                row.update(
                    {
                        "layers": f"{r['layers'][0]}..{r['layers'][-1]}",
                        "param_mb": round(r["param_mb"], 1),
                        f"peak_rss_mb{suffix}": round(r["peak_rss_mb"], 1),
                        f"base_rss_mb{suffix}": round(r["base_rss_mb"], 1),
                        f"peak_minus_base_mb{suffix}": round(r["peak_rss_mb"] - r["base_rss_mb"], 1),
                        f"load_s{suffix}": round(sorted(x["load_s"] for x in results)[len(results) // 2], 3),
                    }
                )
            rows.append(row)
            print(
                f"  {name:<14} {row['layers']:<34} params {row['param_mb']:7.1f} MiB  peak RSS {row['peak_rss_mb']:7.1f} "
                f"MiB  (+{row['peak_minus_base_mb']:.1f} over {row['base_rss_mb']:.0f} after imports)  "
                f"load {row['load_s']:.3f} s",
                flush=True,
            )
            if args.compare_init:
                row["init_first_over_load"] = round(row["load_s_init_first"] / max(row["load_s"], 1e-9), 2)
                print(
                    f"  {'':<14} {'random init first (earlier path)':<34} {'':20} peak RSS "
                    f"{row['peak_rss_mb_init_first']:7.1f} MiB  (+{row['peak_minus_base_mb_init_first']:.1f})  "
                    f"load {row['load_s_init_first']:.3f} s  = {row['init_first_over_load']:.2f}x",
                    flush=True,
                )
    whole = rows[0]
    largest = max(rows[1:], key=lambda r: r["peak_minus_base_mb"])
    print(
        f"largest stage: +{largest['peak_minus_base_mb']:.1f} MiB for {largest['param_mb']:.1f} MiB of parameters "
        f"({largest['peak_minus_base_mb'] / whole['peak_minus_base_mb']:.2f} of the whole model's "
        f"+{whole['peak_minus_base_mb']:.1f} MiB)"
    )
    if args.json:
        command = "python scripts/bench_hf_load.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.json).write_text(
            json.dumps({"command": command.strip(), "safetensors_mb": round(size_mb, 1), "cases": rows}, indent=1)
            + "\n"
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
