"""``scripts/check_context_parallel.py``'s premise, without its 20-worker launches (run by hand; figures in
docs/benchmarks.md): at each model's cap the long samples fit no plain mapping and fit four lanes on the
check's nodes, the longest plain sample it reports is one that fits, and the long ones are 4x longer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import check_context_parallel as check  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", ["builtin", "hf"])
def test_the_long_samples_fit_only_on_lanes_and_the_longest_plain_sample_fits(tmp_path, name):
    cap, tokens, _ = check.MODELS[name]
    plain = check.longest_plain(tmp_path, name, 6)
    assert check.fits(check.make_config(tmp_path, name, plain, 1, 6))[0]
    assert not check.fits(check.make_config(tmp_path, name, plain + check.STEP, 1, 6))[0]
    assert tokens >= check.AT_LEAST * (plain + check.STEP)  # issue 50: 4x the longest plain sample
    refused, why = check.fits(check.make_config(tmp_path, name, tokens, 1, 6))
    assert not refused and "does not fit" in why and str(cap) in why
    lanes, where = check.fits(check.make_config(tmp_path, name, tokens, check.LANES, 6))
    assert lanes and "fits on 2 node(s)" in where, where  # two pipelines of 2 and 3 nodes on the check's 5


def test_bad_arguments_name_what_is_valid(capsys):
    with pytest.raises(SystemExit):
        check.main(["--models", "gpt"])
    assert "--models: ['gpt'] unknown; valid: builtin, hf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check.main(["--steps", "2"])
    assert "--steps: must be >= 4" in capsys.readouterr().err
