"""The whole planning pipeline on random jobs: config -> analytical costs -> templates -> plan -> reconfiguration.

Each step has its own brute-force tests; this one checks that the steps fit
together on configs a user could write, and that the invariants every later
issue relies on hold at the end: every live node used once, >= f + 1
pipelines, the global batch conserved, every layer covered, memory respected.
"""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from oobleck_mm.config import config_from_dict
from oobleck_mm.errors import UserError
from oobleck_mm.planning.costs import ClusterSpec
from oobleck_mm.planning.planner import Failed, Planned, plan_fresh, plan_job, plan_reconfiguration
from oobleck_mm.planning.reconfigure import CannotKeepReplicas, Reconfiguration
from oobleck_mm.planning.stage_mapping import map_stages
from oobleck_mm.profiling.load import load_profile


@st.composite
def jobs(draw):
    with open("configs/tiny_mm.yaml") as f:
        raw = yaml.safe_load(f)
    raw["model"]["llm"]["num_layers"] = draw(st.integers(2, 10))
    raw["model"]["vision"]["num_layers"] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        raw["model"]["frozen"] = [draw(st.sampled_from(["vision", "llm", "projector"]))]
    gpus = draw(st.sampled_from([1, 2, 4]))
    raw["cluster"].update(
        nodes=draw(st.integers(2, 9)),
        gpus_per_node=gpus,
        max_gpus_per_stage=draw(st.sampled_from([d for d in (1, 2, 4) if d <= gpus])),
        # Tight enough that some jobs need several nodes per pipeline.
        device_memory=draw(st.sampled_from(["3MiB", "4MiB", "5MiB", "6MiB", "64MiB"])),
    )
    raw["fault_tolerance"]["f"] = draw(st.integers(0, min(2, raw["cluster"]["nodes"] - 1)))
    micro = draw(st.sampled_from([1, 2]))
    raw["training"].update(microbatch_size=micro, global_batch=micro * draw(st.integers(12, 40)))
    raw["planning"]["solver"] = "python"
    return config_from_dict(raw, source="<hypothesis>")


def check_plan(plan, live, f, job, template_set):
    assert sorted(plan.nodes) == sorted(live)
    assert plan.num_pipelines >= f + 1
    assert sum(p.num_microbatches for p in plan.pipelines) * plan.microbatch_size == job.training.global_batch
    assert all(p.num_microbatches >= 1 for p in plan.pipelines)
    for p in plan.pipelines:
        assert template_set.for_nodes(len(p.nodes)) == p.template


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(job=jobs(), data=st.data())
def test_random_jobs_plan_and_reconfigure_with_every_invariant(job, data):
    nodes = [f"node{i}" for i in range(job.cluster.nodes)]
    f = job.fault_tolerance.f
    try:
        result = plan_job(job, load_profile(job), nodes)
    except UserError as err:  # a job that cannot be planned is the user's to fix, and says why in numbers
        assert any(ch.isdigit() for ch in str(err)), err
        event("cannot be planned")
        return
    event(f"planned, n0 = {min(result.template_set.min_nodes, 3)}{'+' if result.template_set.min_nodes >= 3 else ''}")
    ts, cluster = result.template_set, ClusterSpec.from_config(job.cluster)
    num_layers = result.profile.num_layers
    # Templates: consecutive from n0, every GPU used once, layers covered in order, memory respected.
    assert ts.node_counts == tuple(range(ts.min_nodes, ts.min_nodes + len(ts.templates)))
    for t in ts.templates:
        gpus = [(s.node, g) for s in t.stages for g in s.gpus]
        assert sorted(gpus) == [(n, g) for n in range(t.num_nodes) for g in range(cluster.gpus_per_node)]
        assert [s.layer_start for s in t.stages] == [0] + [s.layer_end for s in t.stages[:-1]]
        assert t.stages[-1].layer_end == num_layers
        assert all(s.memory_bytes <= cluster.usable_memory_bytes for s in t.stages)
    if ts.min_nodes > 1:  # n0 is the fewest nodes that fit
        assert map_stages(result.profile, cluster, ts.min_nodes - 1) is None
    check_plan(result.plan, nodes, f, job, ts)

    lost = data.draw(st.lists(st.sampled_from(nodes), unique=True, max_size=3))
    joined = [f"new{i}" for i in range(data.draw(st.integers(0, 2)))]
    live = [n for n in nodes if n not in lost] + joined
    if len(live) > job.cluster.nodes:
        joined, live = [], [n for n in nodes if n not in lost]
    again = plan_job(job, load_profile(job), nodes, lost=lost, joined=joined).reconfiguration
    if not lost and not joined:
        assert again is None
    elif len(live) < (f + 1) * ts.min_nodes:
        assert isinstance(again, CannotKeepReplicas)
    elif isinstance(again, Reconfiguration):
        check_plan(again.plan, live, f, job, ts)
        assert all(m.src is not None and m.src[0] not in lost for m in again.moves)
    else:
        assert "lost every replica" in again.reason


def tiny(**cluster) -> object:
    with open("configs/tiny_mm.yaml") as f:
        raw = yaml.safe_load(f)
    raw["cluster"].update(cluster)
    raw["planning"]["solver"] = "python"
    return config_from_dict(raw)


def test_the_masters_planning_answers_with_one_of_three_typed_outcomes():
    job = tiny()
    nodes = ["a", "b", "c"]
    planned, templates = plan_fresh(job, load_profile(job), nodes)
    assert isinstance(planned, Planned) and templates is not None
    # the layout is the plan's, rank by rank
    assert sorted(planned.ranks.values()) == list(range(planned.layout.world_size))
    for instance, layout in zip(planned.plan.pipelines, planned.layout.pipelines):
        assert [planned.ranks[(instance.nodes[s.node], s.gpus[0])] for s in instance.template.stages] == list(
            layout.ranks
        )
    # below (f + 1) * n0 nodes: the job cannot keep its replicas (exit 3 territory, not a bad config)
    cannot, none = plan_fresh(job, load_profile(job), ["a"])
    assert isinstance(cannot, CannotKeepReplicas) and (cannot.live_nodes, cannot.needed) == (1, 2) and none is None
    # a model that fits no device: the user must change the config
    small = tiny(device_memory="1KiB")
    failed, _ = plan_fresh(small, load_profile(small), nodes)
    assert (
        isinstance(failed, Failed)
        and "does not fit" in failed.message
        and "cluster.device_memory 1024 bytes" in failed.message
    )
    # a reconfiguration, and losing too many: typed too
    again, _ = plan_reconfiguration(job, load_profile(job), templates, 3, planned.plan, ["c"], [])
    assert isinstance(again, Planned) and not again.fresh and sorted(again.plan.nodes) == ["a", "b"]
    gone, _ = plan_reconfiguration(job, load_profile(job), templates, 3, planned.plan, ["b", "c"], [])
    assert isinstance(gone, CannotKeepReplicas)
