"""``scripts/gpu_profile.py`` (issue 52 item 4) runs its whole path on the CPU with a tiny Llama, so the script a
lent GPU runs in one call is correct by construction: the engine and the plain transformers loop train the
same samples (equal first losses), both are timed, and the profiler's summary is there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_profile  # noqa: E402


def test_the_profile_script_runs_both_systems_on_the_same_samples(tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = gpu_profile.main(
        [
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--profile-steps",
            "1",
            "--json",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().out
    r = json.loads(out.read_text())
    # bf16 autocast (plain) against bf16 compute copies (engine): the same training, to bf16's rounding.
    assert abs(r["engine"]["losses"][0] - r["plain"]["losses"][0]) < 1e-2
    assert r["engine"]["parameters"] == r["plain"]["parameters"]  # the same model, every parameter trained
    for name in ("engine", "plain"):
        assert len(r[name]["step_s"]) == 2 and r[name]["finite"] and "update_s" in r[name]["parts_s_per_step"]
    assert r["engine_over_plain"] > 0 and r["engine_profile"]["top_host_ops"]
    assert "engine / plain" in capsys.readouterr().out
