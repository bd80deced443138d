"""End to end in mixed precision: a killed node on pipelines of different depths, against the reference.

Float32 compute with float64 masters must equal the reference trainer running the same mode to 1e-9
after the recovery (the machinery's exact mode); bfloat16 compute with float32 masters within 1e-3
of the bf16 reference. The final checkpoint holds masters in the master dtype.
"""

from __future__ import annotations

import pytest
import torch

from harness import assert_matches_reference, kill_node1_of_the_deeper_pipeline, write_config
from oobleck_mm.runtime.checkpoint import load_params

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize(
    "dtype,master,memory,tolerance", [("float32", "float64", 8_000_000, 1e-9), ("bfloat16", "float32", 4_500_000, 1e-3)]
)
def test_mixed_precision_recovers_from_a_killed_node(launches, tmp_path, dtype, master, memory, tolerance):
    config = write_config(tmp_path, nodes=5, memory=memory, training={"dtype": dtype, "master_dtype": master})
    final = tmp_path / "final"
    kill_node1_of_the_deeper_pipeline(launches, tmp_path, config, final)
    assert_matches_reference(config, 8, final, tolerance)
    assert load_params(final, "llm.head")["out.weight"].dtype == getattr(torch, master)
