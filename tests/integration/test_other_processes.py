"""What a second process must see the same, and what a fresh interpreter does or does not import.

Each test here starts a Python subprocess (``tests/unit`` starts none): the
command line's exit codes as a user meets them, the import graph's leaves
(the CLI's parser without torch, the config without the rest of the
project), and determinism across processes (samples, batches, the balancer
with and without numba).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_mm.yaml")
sys.path.insert(0, str(ROOT / "tests" / "unit"))  # their helpers: one home, in the unit tests of each concept
from test_balance import make_problem, mllm  # noqa: E402,F401  (the fixture is used by name)
from test_data import dataset  # noqa: E402

from oobleck_mm.balance.balancer import ALGORITHMS  # noqa: E402
from oobleck_mm.data.sampler import GlobalBatchSampler  # noqa: E402


def test_bad_config_exits_2_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(TINY).read_text().replace("microbatch_size: 2", "microbatch_size: -2"))
    proc = subprocess.run(
        [sys.executable, "-m", "oobleck_mm.cli", "plan", "--config", str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert "training.microbatch_size" in proc.stderr and "-2" in proc.stderr


def test_reading_the_command_line_imports_no_torch():
    """Every agent, including a joining node's, parses its flags first: seconds of torch imports there
    delay every join (a join that misses the end of training never happens)."""
    code = (
        "import sys; from oobleck_mm.cli import build_parser; build_parser().parse_args(['agent', '--master', "
        "'h:1']); heavy = sorted(m for m in ('torch', 'numpy', 'grpc') if m in sys.modules); print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_config_imports_no_other_project_module():
    """The leaf of the import graph, checked here as in `make test`'s lint-imports run."""
    code = (
        "import sys, oobleck_mm.config; "
        "print(sorted(m for m in sys.modules if m.startswith(('oobleck_mm', 'master', 'agent'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == str(
        [
            "oobleck_mm",
            "oobleck_mm.config",
            "oobleck_mm.config.cluster",
            "oobleck_mm.config.data",
            "oobleck_mm.config.deepspeed",
            "oobleck_mm.config.devices",
            "oobleck_mm.config.emulation",
            "oobleck_mm.config.fault_tolerance",
            "oobleck_mm.config.huggingface",
            "oobleck_mm.config.job",
            "oobleck_mm.config.loading",
            "oobleck_mm.config.model",
            "oobleck_mm.config.shape",
            "oobleck_mm.config.training",
            "oobleck_mm.config.validation",
            "oobleck_mm.config.values",
            "oobleck_mm.errors",
        ]
    )


def test_another_process_generates_the_same_samples():
    code = (
        "import sys, yaml, json; sys.path.insert(0, 'tests/unit'); from test_data import dataset; "
        "ds = dataset('tiny_mm_audio'); s = [ds[i] for i in (0, 17, 4000)]; "
        "print(json.dumps([[x.tokens.tolist(), [float(im.sum()) for im in x.images + x.audio]] for x in s]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    ds = dataset("tiny_mm_audio")
    here = [[x.tokens.tolist(), [float(im.sum()) for im in x.images + x.audio]] for x in (ds[0], ds[17], ds[4000])]
    assert json.loads(out.stdout) == here


def test_another_process_computes_the_same_batches():
    steps = [0, 7, 31, 250]
    code = (
        "import json; from oobleck_mm.data.sampler import GlobalBatchSampler as S; "
        f"s = S(777, 24, 11); print(json.dumps([list(s.batch(k)) for k in {steps}]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    here = GlobalBatchSampler(777, 24, 11)
    assert json.loads(out.stdout) == [list(here.batch(k)) for k in steps]


def test_without_numba_the_same_code_gives_the_same_placement(mllm, tmp_path):
    """Ranks must agree even if one ran the pure-Python fallback (``NUMBA_DISABLE_JIT=1``)."""
    problem = make_problem(mllm, [2, 4, 3], [6, 12, 9], seed=13)
    compiled = ALGORITHMS["ours"](problem)
    script = tmp_path / "plain.py"
    script.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests' / 'unit')!r})\n"
        "from test_balance import make_problem, CONFIGS\n"
        "from oobleck_mm.balance.balancer import ALGORITHMS\n"
        "from oobleck_mm.balance.cost_model import CostCoefficients, CostModel\n"
        "from oobleck_mm.config import load_config\n"
        "from oobleck_mm.data.dataset import ModelInputs\n"
        "from oobleck_mm.config.shape import layer_specs\n"
        "from oobleck_mm.profiling.analytical import profile_from_config\n"
        "job = load_config(CONFIGS / 'mllm_10b.yaml')\n"
        "model = CostModel.from_profile(profile_from_config(job), layer_specs(job.model, job.data))\n"
        "mllm = (model, CostCoefficients.initial(3e-5), ModelInputs.from_model(job.model))\n"
        "p = ALGORITHMS['ours'](make_problem(mllm, [2, 4, 3], [6, 12, 9], seed=13))\n"
        "print(json.dumps([p.pipeline.tolist(), p.microbatch.tolist()]))\n"
    )
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    pipeline, microbatch = json.loads(out.stdout.strip().splitlines()[-1])
    assert pipeline == compiled.pipeline.tolist() and microbatch == compiled.microbatch.tolist()


def test_a_worker_imports_numba_only_when_its_balancer_runs_ours():
    """numba is ~0.23 s of a worker's ~2.3 s start-up (scripts/bench_startup.py): a job without the
    balancer must not pay it, and one with it must still get the kernels (warm_up at its start)."""
    code = (
        "import sys, oobleck_mm.runtime.agent_worker, oobleck_mm.runtime.engine\n"
        "assert 'numba' not in sys.modules, 'the worker imported numba'\n"
        "from oobleck_mm.balance.balancer import balance\n"
        "assert 'numba' not in sys.modules, 'the balancer module imported numba'\n"
        "from oobleck_mm.balance import search\n"
        "print(search.njit.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("numba"), "the search's kernels are not numba's"
