"""Multimodal partitioning measured with the planner's exact times (issue 49 item 4).

    python scripts/bench_modality.py frozen [--json out.json]
    python scripts/bench_modality.py placement [--models sss,lls] [--nodes N] [--json out.json]
    python scripts/bench_modality.py lookahead [--models lls,llm] [--json out.json]
    python scripts/bench_modality.py plans [--models lls,sss] [--json out.json]

``frozen`` reproduces Cornstarch's Table 3.2 (dissertation §3.5.3): each of its MLLM configurations
(``configs/cornstarch_mllm_{sss,mmm,lll}.yaml``: encoders and LLM frozen, only the projectors train, on the
paper's 6 nodes of four A40s) planned twice by our planner, with the same memory limits and the same
frozen parts:

- **frozen-aware**: the stage costs of eq. 3.2 (a frozen layer skips its weight gradients; a layer with
  nothing trainable before it skips its input gradients), which the planner uses by default;
- **unaware**: every layer's backward priced as if the whole model trained (``ModelProfile.frozen_aware``
  off: ``B = B_w + B_d``), as Megatron-style partitioning does; memory stays that of the true status.

Both plans (templates, cuts, pipelines and batch split, each chosen by the planner under its own costs)
are then timed under the true, frozen-aware costs: the exact 1F1B iteration time of every pipeline
(``planning.pipeline_time``) plus the gradient all-reduce. Printed per configuration: the slowest pipeline's
largest per-stage forward and backward among the stages that hold encoder layers and among the LLM's
stages (the paper's "Per-Stage Fwd/Bwd, Enc/LLM" columns), the iteration time, and aware / unaware beside
the paper's ratio; then the same for one pipeline over every node with the whole batch through it (as a
pipeline-parallel baseline runs). These are the planner's predicted times on the configured accelerator, not a
measurement on GPUs.

``placement`` times each model's encoders as branches on stages of their own against the chain (encoders
one after another, colocated where a stage holds both), one pipeline over the config's nodes with the
whole batch through it, by the exact 1F1B time (``planning.branches``): MLLM-10B, Cornstarch's SSS, MMM,
LLL, and MLLM-LLS and MLLM-LLM (LLL's large encoders with the small and medium LLM). Target: branches
>= 1.2x the chain where the encoders are large (MLLM-LL*), and the chosen placement never the slower.

``lookahead`` is a what-if, not a schedule the runtime runs: the same chain and branched templates, with
their *frozen prefix* (stages whose layers and inputs are all frozen: Cornstarch's encoders below their
trained projectors) running its forwards ahead into the next iteration, which it may (its outputs depend on
no update): unbounded buffers, no share in the step's last collective (an upper bound), the other stages
1F1B as now, iterations separated by that collective. Printed: each template's steady iteration period
(the 4th iteration's) in lock-step (equal to the planner's exact time) and with the lookahead.

``plans`` is what a user of each model gets: the planner's whole plan over the config's nodes (templates,
pipelines, batch split) with ``planning.placement: chain`` and with ``auto`` (branches wherever a template's
exact time says so), each timed as the planner times it (the slowest pipeline's exact 1F1B time plus the
gradient all-reduce), to set beside ``placement``'s one pipeline over every node; and the same plan under
the ``lookahead`` what-if. MLLM-10B is not in its default list: ``auto`` times a branched template for every
node count of its 16 nodes at 5,120 microbatches (more than 15 minutes here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oobleck_mm.config import load_config  # noqa: E402
from oobleck_mm.planning.costs import ClusterSpec, LayerPrefix, effective_layers, stage_cost  # noqa: E402
from oobleck_mm.planning.plan import Plan, gradient_allreduce_s  # noqa: E402
from oobleck_mm.planning.planner import plan_job  # noqa: E402
from oobleck_mm.planning.stage_mapping import map_stages  # noqa: E402
from oobleck_mm.planning.template import PipelineTemplate  # noqa: E402
from oobleck_mm.profiling.analytical import profile_from_config  # noqa: E402

PAPER_TABLE_3_2 = {
    # model: (aware iteration s, unaware iteration s, improvement) from Table 3.2
    "sss": (21.81, 25.67, 1.18),
    "mmm": (70.37, 173.01, 2.46),
    "lll": (143.76, 247.79, 1.72),
}


def repriced(template: PipelineTemplate, prefix: LayerPrefix, cluster: ClusterSpec) -> PipelineTemplate:
    """``template``'s cuts, GPUs and recomputation with each stage's times from ``prefix`` (the true costs)."""
    stages = []
    for s in template.stages:
        cost = stage_cost(prefix, cluster, s.layer_start, s.layer_end, len(s.gpus), s.recompute)
        stages.append(
            dataclasses.replace(s, forward_s=cost.forward_s, backward_s=cost.backward_s, grad_bytes=cost.grad_bytes)
        )
    return dataclasses.replace(template, stages=tuple(stages))


def timed(plan: Plan, prefix: LayerPrefix, cluster: ClusterSpec, seam: int) -> dict:
    """``plan`` under the true costs: its iteration time and its slowest pipeline's per-stage times."""
    templates = [repriced(p.template, prefix, cluster) for p in plan.pipelines]
    times = [t.iteration_time(p.num_microbatches) for t, p in zip(templates, plan.pipelines)]
    allreduce = gradient_allreduce_s(templates, cluster)
    slowest = templates[max(range(len(times)), key=times.__getitem__)]
    encoder = [s for s in slowest.stages if s.layer_start < seam]
    llm = [s for s in slowest.stages if s.layer_start >= seam]
    ms = 1e3
    return {
        "iteration_s": max(times) + allreduce,
        "allreduce_s": allreduce,
        "pipelines": [f"{p.template.num_stages} stages x {p.num_microbatches} mb" for p in plan.pipelines],
        "cuts": [[(s.layer_start, s.layer_end) for s in t.stages] for t in templates],
        "enc_fwd_ms": max((s.forward_s for s in encoder), default=0.0) * ms,
        "enc_bwd_ms": max((s.backward_s for s in encoder), default=0.0) * ms,
        "llm_fwd_ms": max((s.forward_s for s in llm), default=0.0) * ms,
        "llm_bwd_ms": max((s.backward_s for s in llm), default=0.0) * ms,
    }


def frozen(names: list[str]) -> dict:
    out = {}
    for name in names:
        job = load_config(str(ROOT / "configs" / f"cornstarch_mllm_{name}.yaml"))
        cluster = ClusterSpec.from_config(job.cluster)
        aware = profile_from_config(job)
        unaware = dataclasses.replace(aware, frozen_aware=False)
        truth = LayerPrefix(effective_layers(aware))
        seam = next(i for i, layer in enumerate(aware.layers) if layer.name == "llm.embed")
        nodes = [f"n{i}" for i in range(job.cluster.nodes)]
        row = {}
        for label, profile in (("aware", aware), ("unaware", unaware)):
            plan = plan_job(job, profile, nodes).plan
            row[label] = timed(plan, truth, cluster, seam)
        row["improvement"] = row["unaware"]["iteration_s"] / row["aware"]["iteration_s"]
        # As a pipeline-parallel baseline runs it: one pipeline over every node, the whole batch through it.
        microbatches = job.training.global_batch // job.training.microbatch_size
        deep = {}
        for label, profile in (("aware", aware), ("unaware", unaware)):
            template = map_stages(profile, cluster, job.cluster.nodes, microbatches)
            deep[label] = repriced(template, truth, cluster).iteration_time(microbatches)
        row["one_pipeline"] = {
            "stages": template.num_stages,
            "microbatches": microbatches,
            "aware_s": deep["aware"],
            "unaware_s": deep["unaware"],
            "improvement": deep["unaware"] / deep["aware"],
        }
        row["paper"] = dict(zip(("aware_s", "unaware_s", "improvement"), PAPER_TABLE_3_2[name]))
        out[name] = row
        for label in ("aware", "unaware"):
            r = row[label]
            print(
                f"MLLM-{name.upper()} {label:>7}: per-stage fwd enc {r['enc_fwd_ms']:8.1f} ms, llm "
                f"{r['llm_fwd_ms']:7.1f} ms; bwd enc {r['enc_bwd_ms']:8.1f} ms, llm {r['llm_bwd_ms']:8.1f} ms; "
                f"iteration {r['iteration_s']:7.2f} s ({', '.join(r['pipelines'])})",
                flush=True,
            )
        one = row["one_pipeline"]
        print(
            f"MLLM-{name.upper()} one pipeline of {one['stages']} stages x {one['microbatches']} mb: aware "
            f"{one['aware_s']:.2f} s, unaware {one['unaware_s']:.2f} s: x{one['improvement']:.2f}",
            flush=True,
        )
        print(
            f"MLLM-{name.upper()} frozen-aware vs unaware (the planner's plans): x{row['improvement']:.2f} "
            f"(paper x{row['paper']['improvement']:.2f}: {row['paper']['aware_s']} s vs {row['paper']['unaware_s']} s)",
            flush=True,
        )
    return out


LLM_SIZES = {
    # Cornstarch Table 3.1's Llama-3 sizes, as configs/cornstarch_mllm_{sss,mmm,lll}.yaml write them
    "s": ["model.llm.num_layers=16", "model.llm.hidden=2048", "model.llm.num_heads=32", "model.llm.ffn_hidden=8192"],
    "m": ["model.llm.num_layers=32", "model.llm.hidden=4096", "model.llm.num_heads=32", "model.llm.ffn_hidden=14336"],
    "l": [],
}
PLACEMENT_MODELS = {
    # name: (config, overrides); MLLM-LLS and MLLM-LLM: the large encoders of MLLM-LLL with a smaller LLM
    "mllm_10b": ("mllm_10b.yaml", []),
    "sss": ("cornstarch_mllm_sss.yaml", []),
    "mmm": ("cornstarch_mllm_mmm.yaml", []),
    "lll": ("cornstarch_mllm_lll.yaml", []),
    "lls": ("cornstarch_mllm_lll.yaml", LLM_SIZES["s"]),
    "llm": ("cornstarch_mllm_lll.yaml", LLM_SIZES["m"]),
}
BRANCH_TARGET = 1.2


def placement_model(name: str):
    """(job, cluster, profile, microbatches: the whole batch through one pipeline) of a ``PLACEMENT_MODELS`` entry."""
    path, sets = PLACEMENT_MODELS[name]
    job = load_config(str(ROOT / "configs" / path), overrides=sets)
    microbatches = job.training.global_batch // job.training.microbatch_size
    return job, ClusterSpec.from_config(job.cluster), profile_from_config(job), microbatches


def placement(names: list[str], nodes: int | None) -> dict:
    """Per model: one pipeline over the config's nodes (or ``nodes``) with the whole batch through it, as
    the chain and with the encoders as branches (``planning.branches.place``), by the exact 1F1B time."""
    from oobleck_mm.planning.branches import place

    out = {}
    for name in names:
        path, sets = PLACEMENT_MODELS[name]
        job, cluster, profile, microbatches = placement_model(name)
        count = nodes or job.cluster.nodes
        started = time.perf_counter()
        chosen = place(profile, cluster, count, microbatches)
        row = {
            "config": path,
            "sets": sets,
            "nodes": count,
            "gpus_per_node": cluster.gpus_per_node,
            "microbatches": microbatches,
            "chain_s": chosen.chain_s,
            "branches_s": chosen.branched_s,
            "faster": chosen.faster,
            "reason": chosen.reason,
            "branches_vs_chain": chosen.chain_s / chosen.branched_s if chosen.branched_s and chosen.chain_s else None,
            "branches": chosen.branched.describe() if chosen.branched is not None else None,
            "search_s": time.perf_counter() - started,
        }
        out[name] = row
        ratio = f"x{row['branches_vs_chain']:.3f}" if row["branches_vs_chain"] else "-"
        print(
            f"{'MLLM-10B' if name == 'mllm_10b' else 'MLLM-' + name.upper()} on {count} x {cluster.gpus_per_node} GPUs, {microbatches} microbatches: chain "
            f"{chosen.chain_s:.4g} s, branches {chosen.branched_s or float('nan'):.4g} s: branches/chain {ratio}; "
            f"{chosen.faster} chosen ({row['search_s']:.1f} s to search)",
            flush=True,
        )
    return out


def frozen_prefix(template: PipelineTemplate, profile) -> list[bool]:
    """Per stage: its layers and every layer feeding it are frozen (it needs no backward at all)."""
    _, prevs, _ = _topology(template)
    prefix: list[bool] = []
    for s, stage in enumerate(template.stages):  # senders are numbered before their receivers
        own = all(not profile.layers[i].trainable for i in range(stage.layer_start, stage.layer_end))
        prefix.append(own and all(prefix[p] for p in prevs[s]))
    return prefix


def _topology(template: PipelineTemplate):
    """(next stage, sending stages, (stages, stage_id) of its TrainSchedule) per stage, as
    ``planning.branch_time.simulate_microbatches`` wires a chain or a branched template."""
    n = len(template.stages)
    if not template.branched:
        return (
            [s + 1 if s + 1 < n else None for s in range(n)],
            [[s - 1] if s else [] for s in range(n)],
            [(n, s) for s in range(n)],
        )
    ends = (*template.branches[1:], template.merge)
    depth = n - template.merge
    nexts, prevs, positions = [], [], []
    for start, end in zip(template.branches, ends):
        for s in range(start, end):
            nexts.append(s + 1 if s + 1 < end else template.merge)
            prevs.append([] if s == start else [s - 1])
            positions.append((end - start + depth, s - start))
    for s in range(template.merge, n):
        nexts.append(s + 1 if s + 1 < n else None)
        prevs.append([e - 1 for e in ends] if s == template.merge else [s - 1])
        positions.append((1 + depth, 1 + s - template.merge))
    return nexts, prevs, positions


def steady_period(template: PipelineTemplate, prefix: list[bool], microbatches: int, iterations: int = 4) -> float:
    """Seconds between the ends of the last two of ``iterations`` iterations. Stages of ``prefix`` run their
    forwards back to back across iterations (sends into unbounded buffers); the others run DeepSpeed's 1F1B
    instruction streams with blocking transfers, waiting for a prefix's output where they would receive it,
    and meet at a barrier (the step's last collective) after each iteration. No prefix: lock-step 1F1B, each
    iteration the planner's exact time."""
    from deepspeed.runtime.pipe import schedule as ds

    n, m = len(template.stages), microbatches
    nexts, prevs, positions = _topology(template)
    f = [s.forward_s for s in template.stages]
    b = [s.backward_s for s in template.stages]
    act = dict(enumerate(template.send_activation_s))
    grad = dict(enumerate(template.send_grad_s))
    ready: dict[tuple[int, int], float] = {}  # (prefix stage, microbatch across iterations) -> output ready
    for s in range(n):
        if prefix[s]:
            clock = 0.0
            for k in range(iterations * m):
                clock = max([clock] + [ready[(p, k)] + act[p] for p in prevs[s]]) + f[s]
                ready[(s, k)] = clock
    ops: dict[int, list[tuple]] = {s: [] for s in range(n) if not prefix[s]}
    for it in range(iterations):
        for s, stream in ops.items():
            stages, stage_id = positions[s]
            forwards = 0
            for step in ds.TrainSchedule(micro_batches=m, stages=stages, stage_id=stage_id):
                for cmd in step:
                    if isinstance(cmd, ds.ForwardPass):
                        stream.append(("compute", f[s]))
                        forwards += 1
                    elif isinstance(cmd, ds.BackwardPass):
                        stream.append(("compute", b[s]))
                    elif isinstance(cmd, ds.SendActivation):
                        stream.append(("send", ("act", s, nexts[s], it)))
                    elif isinstance(cmd, ds.RecvActivation):
                        for p in prevs[s]:  # (forwards counts the forward this receive feeds, from 0)
                            stream.append(
                                ("wait", ready[(p, it * m + forwards)] + act[p])
                                if prefix[p]
                                else ("recv", ("act", p, s, it))
                            )
                    elif isinstance(cmd, ds.SendGrad):
                        stream.extend(("send", ("grad", s, p, it)) for p in prevs[s] if not prefix[p])
                    elif isinstance(cmd, ds.RecvGrad):
                        stream.append(("recv", ("grad", nexts[s], s, it)))
            stream.append(("barrier", it))
    ends = _execute_streams(ops, lambda c: act[c[1]] if c[0] == "act" else grad[c[2]])
    return ends[-1] - (ends[-2] if len(ends) > 1 else 0.0)


def _execute_streams(ops: dict[int, list[tuple]], seconds) -> list[float]:
    """``planning.branch_time._execute`` with two more operations: ``wait`` (until a time) and ``barrier``
    (every stream at once, at the latest arrival); returns each barrier's time."""
    pc = dict.fromkeys(ops, 0)
    clock = dict.fromkeys(ops, 0.0)
    waiting: dict[tuple, tuple[int, float]] = {}
    arrived: dict[int, float] = {}
    ends: list[float] = []
    while True:
        progressed = False
        for s, stream in ops.items():
            while pc[s] < len(stream):
                kind, what = stream[pc[s]]
                if kind in ("compute", "wait"):
                    clock[s] = clock[s] + what if kind == "compute" else max(clock[s], what)
                    pc[s] += 1
                    progressed = True
                    continue
                if kind == "barrier":
                    arrived[s] = clock[s]
                    if len(arrived) == len(ops):
                        ends.append(max(arrived.values()))
                        for k in ops:
                            clock[k], pc[k] = ends[-1], pc[k] + 1
                        arrived.clear()
                        progressed = True
                    break
                other = (what, "recv" if kind == "send" else "send")
                if other not in waiting:
                    waiting.setdefault((what, kind), (s, clock[s]))
                    break
                peer, peer_arrival = waiting.pop(other)
                done = max(waiting.pop((what, kind), (s, clock[s]))[1], peer_arrival) + seconds(what)
                clock[s] = clock[peer] = done
                pc[s] += 1
                pc[peer] += 1
                progressed = True
        if all(pc[s] == len(stream) for s, stream in ops.items()):
            return ends
        if not progressed:
            raise RuntimeError("deadlock in the lookahead streams")


def lookahead(names: list[str]) -> dict:
    """Per model: the ``placement`` templates' steady period in lock-step and with the frozen prefix ahead."""
    from oobleck_mm.planning.branches import place

    out = {}
    for name in names:
        job, cluster, profile, microbatches = placement_model(name)
        chosen = place(profile, cluster, job.cluster.nodes, microbatches)
        row = {}
        for label, template in (("chain", chosen.chain), ("branches", chosen.branched)):
            if template is None:
                continue
            template = template.to_template() if label == "branches" else template
            prefix = frozen_prefix(template, profile)
            lock = steady_period(template, [False] * len(prefix), microbatches)
            ahead = steady_period(template, prefix, microbatches)
            row[label] = {"lockstep_s": lock, "lookahead_s": ahead, "prefix_stages": sum(prefix)}
            print(
                f"MLLM-{name.upper()} {label}: {sum(prefix)} of {len(prefix)} stages a frozen prefix; lock-step "
                f"{lock:.4g} s, lookahead {ahead:.4g} s: x{lock / ahead:.3f}",
                flush=True,
            )
        if len(row) == 2:
            row["branches_vs_chain"] = {k: row["chain"][k] / row["branches"][k] for k in ("lockstep_s", "lookahead_s")}
            print(
                f"MLLM-{name.upper()} branches / chain: lock-step x{row['branches_vs_chain']['lockstep_s']:.3f}, "
                f"lookahead x{row['branches_vs_chain']['lookahead_s']:.3f}",
                flush=True,
            )
        out[name] = row
    return out


def plans(names: list[str]) -> dict:
    """Per model: the planner's plan over the config's nodes with the encoders chained and with placement
    ``auto``, by the planner's exact times."""
    out = {}
    for name in names:
        path, sets = PLACEMENT_MODELS[name]
        row = {"config": path, "sets": sets}
        for placement in ("chain", "auto"):
            job = load_config(str(ROOT / "configs" / path), overrides=[*sets, f"planning.placement={placement}"])
            cluster = ClusterSpec.from_config(job.cluster)
            started = time.perf_counter()
            profile = profile_from_config(job)
            plan = plan_job(job, profile, [f"n{i}" for i in range(job.cluster.nodes)]).plan
            templates = [p.template for p in plan.pipelines]
            slowest = max(t.iteration_time(p.num_microbatches) for t, p in zip(templates, plan.pipelines))
            allreduce = gradient_allreduce_s(templates, cluster)
            ahead = max(
                steady_period(t, frozen_prefix(t, profile), p.num_microbatches)
                for t, p in zip(templates, plan.pipelines)
            )
            row[placement] = {
                "iteration_s": slowest + allreduce,
                "lookahead_s": ahead + allreduce,
                "pipelines": [f"{t.describe()} x {p.num_microbatches} mb" for t, p in zip(templates, plan.pipelines)],
                "branched_pipelines": sum(1 for t in templates if t.branched),
                "plan_s": time.perf_counter() - started,
            }
        row["auto_vs_chain"] = row["chain"]["iteration_s"] / row["auto"]["iteration_s"]
        out[name] = row
        auto = row["auto"]
        print(
            f"{'MLLM-10B' if name == 'mllm_10b' else 'MLLM-' + name.upper()} on {job.cluster.nodes} x "
            f"{cluster.gpus_per_node} GPUs, the planner's plan: chain {row['chain']['iteration_s']:.4g} s, auto "
            f"{auto['iteration_s']:.4g} s (x{row['auto_vs_chain']:.3f}; {auto['branched_pipelines']} of "
            f"{len(auto['pipelines'])} pipelines branched): "
            + ", ".join(f"{n} x [{p}]" for p, n in Counter(auto["pipelines"]).items())
            + f"; with its frozen prefix ahead (the lookahead what-if) {auto['lookahead_s']:.4g} s",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("frozen", help="Cornstarch Table 3.2: frozen-aware vs unaware cuts")
    f.add_argument("--models", default=",".join(PAPER_TABLE_3_2), help="comma-separated: sss, mmm, lll")
    f.add_argument("--json", help="write the figures here")
    pl = sub.add_parser("placement", help="encoders as branches vs the chain, by the exact 1F1B time")
    pl.add_argument(
        "--models", default=",".join(PLACEMENT_MODELS), help=f"comma-separated: {', '.join(PLACEMENT_MODELS)}"
    )
    pl.add_argument("--nodes", type=int, default=None, help="nodes (default: each config's cluster.nodes)")
    pl.add_argument("--json", help="write the figures here")
    la = sub.add_parser("lookahead", help="what-if: the frozen prefix running ahead into the next iteration")
    la.add_argument("--models", default="lls,llm,lll", help=f"comma-separated: {', '.join(PLACEMENT_MODELS)}")
    la.add_argument("--json", help="write the figures here")
    pp = sub.add_parser("plans", help="the planner's whole plan with the encoders chained vs placement auto")
    pp.add_argument("--models", default="lls,llm,lll,mmm,sss", help=f"comma-separated: {', '.join(PLACEMENT_MODELS)}")
    pp.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    valid = PAPER_TABLE_3_2 if args.command == "frozen" else PLACEMENT_MODELS
    names = [m.strip().lower() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in valid]
    if unknown:
        parser.error(f"--models: {unknown} unknown; valid: {', '.join(valid)}")
    if args.command == "frozen":
        result = {"frozen": frozen(names)}
    elif args.command == "lookahead":
        result = {"lookahead": lookahead(names)}
    elif args.command == "plans":
        result = {"plans": plans(names)}
    else:
        result = {"placement": placement(names, args.nodes)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
