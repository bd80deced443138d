"""The runtime benchmark's bench network (``scripts/bench_runtime.py --link-mbit``): rank r of a system runs in
host r's network namespace (``tests/network.py``) and its collectives cross that host's link, which ``tc``
slows. Real namespaces, veth links and token buckets; skipped where this machine cannot make them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests")]
import bench_runtime  # noqa: E402
from _bench_peers import RunSpec, launch  # noqa: E402
from network import unavailable  # noqa: E402

from oobleck_mm.config import config_from_dict  # noqa: E402
from oobleck_mm.model.layers import model_layer_specs  # noqa: E402
from oobleck_mm.planning.layout import ExecutionPlan  # noqa: E402

pytestmark = pytest.mark.integration


def test_a_system_on_the_bench_network_trains_across_its_slowed_links(tmp_path):
    why = unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
    with open(ROOT / "configs/tiny_mm.yaml") as f:
        raw = yaml.safe_load(f)
    raw["training"]["global_batch"] = 8  # two pipelines of two microbatches of 2
    job = config_from_dict(raw)
    plan = ExecutionPlan.even(len(model_layer_specs(job)), [1, 1], [2, 2], job.training.microbatch_size)
    network, hosts = bench_runtime.bench_network(50, count=2)  # 50 Mbit/s: the all-reduce's packets queue
    try:
        reports = launch([RunSpec("ddp", job, plan, warmup=1, timed=1)], tmp_path, timeout_s=300, hosts=hosts)
        held = [network.throttled_packets(n) for n in network.nodes]
    finally:
        network.close()
    (ranks,) = reports
    assert len(ranks) == 2 and ranks[0]["losses"] == ranks[1]["losses"], "both ranks trained the same steps"
    # Without the namespaces the ranks would talk over this host's own interfaces and no bucket would fill.
    assert all(n > 0 for n in held), f"a link never held packets back: {held}"
