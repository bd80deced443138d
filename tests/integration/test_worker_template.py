"""The worker template (``oobleck_mm/agent/workers.py``, ``--worker-start forkserver``): what a forked worker inherits.

A stand-in agent process (its own template, as a real agent has) starts the
template with the real worker preload, forks a probe worker from it, kills the
template, forks another: each probe reports what it found. On a machine with
a GPU the probe also makes CUDA its device and computes there (a child of a
template that had touched the CUDA driver could not).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def probe(conn, config_path: str, node: str, local_rank: int) -> None:
    """A worker target: reports what this process inherited from its parent, then exits."""
    import torch

    parent = psutil.Process(os.getppid())
    found = {
        "pid": os.getpid(),
        "parent": parent.pid,
        "grandparent": parent.ppid(),
        "parent_threads": parent.num_threads(),
        "preloaded": "oobleck_mm.runtime.worker_preload" in sys.modules,
        "deepspeed_imported": "deepspeed" in sys.modules,
        "cuda_initialised_at_start": torch.cuda.is_initialized(),
        "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
        "cuda_sum": None,
    }
    if torch.cuda.is_available():  # on a GPU: the device first (as runtime.worker.device_for), then work
        torch.cuda.set_device(local_rank)
        found["cuda_sum"] = torch.ones(4, device="cuda").sum().item()
    conn.send_bytes(json.dumps(found).encode())


AGENT = f"""
import json, os, sys, time
import psutil
sys.path[:0] = sys.argv[1:]
from multiprocessing import forkserver
from oobleck_mm.agent.workers import Worker, start_worker_template

os.environ["OMP_NUM_THREADS"] = "4"  # a user's many threads per worker must not be the template's
os.environ.pop("OPENBLAS_NUM_THREADS", None)
start_worker_template("forkserver")  # the real preload: torch, DeepSpeed, the engine
found = []
for round in range(2):
    w = Worker("{__name__}:probe", "job.yaml", "n", 0)
    assert w.conn.poll(120), "no report from the probe"
    found.append(json.loads(w.conn.recv_bytes()))
    w.process.join(30)
    found[-1]["exitcode"] = w.process.exitcode
    if round == 0:  # the template dies: the next start must bring up another
        template = psutil.Process(found[-1]["parent"])
        template.kill()
        while template.status() != psutil.STATUS_ZOMBIE:  # dead, and left for ensure_running to reap
            time.sleep(0.01)
print(json.dumps({{"agent": os.getpid(), "found": found}}), flush=True)
"""


def test_a_forked_worker_inherits_the_imports_and_nothing_that_a_fork_breaks_and_a_dead_template_is_replaced():
    # Only what this test started is killed at the end: pytest's own children (multiprocessing's resource
    # tracker) stay, else the next test to use multiprocessing in this process warns "resource_tracker:
    # process died unexpectedly" (the suite's one warning, seen at a CLI test).
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, *sys.path], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = agent.communicate(timeout=240)
    finally:
        for child in psutil.Process().children(recursive=True):
            if child.pid not in before:
                child.kill()
    assert agent.returncode == 0, err
    report = json.loads(out.splitlines()[-1])
    first, second = report["found"]
    for found in (first, second):
        assert found["grandparent"] == report["agent"]  # a fork of the agent's template, not of the agent
        assert found["preloaded"], "the worker paid the imports itself"
        assert found["parent_threads"] == 1, "a template with threads cannot fork safely"
        assert found["cuda_initialised_at_start"] is False and found["nvml_check"] == "1"
        assert found["exitcode"] == 0
        import torch

        from oobleck_mm.runtime.template import gpu_build

        # DeepSpeed's import initialises the CUDA driver: the template has it only with a CPU build of torch.
        assert found["deepspeed_imported"] is not gpu_build()
        if torch.cuda.is_available():
            assert found["cuda_sum"] == 4.0
    assert second["parent"] != first["parent"], "the killed template was not replaced"


SHARED = """
import json, os, sys
import psutil
sys.path[:0] = sys.argv[1:]
from oobleck_mm.runtime.template import start_shared_template

environ = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
environ["OPENBLAS_NUM_THREADS"] = "3"  # the caller's choice stays
start_shared_template(environ)
template, = (p for p in psutil.Process().children() if "forkserver" in " ".join(p.cmdline()))
print(json.dumps(template.environ()), flush=True)
"""


def test_the_shared_template_asks_nvml_whatever_environment_its_agents_have():
    """``oobleck-launch local``'s template starts with the agents' environment, which lacks torch's NVML
    switch: a template that asked the CUDA driver instead left every worker forked from it unable to
    use CUDA ("Cannot re-initialize CUDA in forked subprocess", on an H200)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    out = subprocess.run(
        [sys.executable, "-c", SHARED, *sys.path], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    template_env = json.loads(out.stdout.splitlines()[-1])
    assert template_env.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"
    assert template_env.get("OPENBLAS_NUM_THREADS") == "3"


ASKS = """
import json, sys
sys.path[:0] = sys.argv[1:]
import torch
torch.version.cuda = "13.0"  # the path of a GPU build (on a CPU build, asking never reaches a driver)
asked = []
for name in ("is_available", "device_count", "init", "get_device_properties", "get_device_capability"):
    setattr(torch.cuda, name, lambda *a, _name=name, **k: asked.append(_name) or 0)
import oobleck_mm.runtime.worker_preload
print(json.dumps(asked), flush=True)
"""


def test_the_template_never_asks_whether_there_is_a_gpu():
    """Even NVML's answer to ``torch.cuda.is_available`` starts a driver thread in the asking process (an
    H200's template had two threads), and a template must fork from one: its preload decides from
    torch's build alone. This checks the preload of a GPU build, whose engine imports stay out."""
    out = subprocess.run([sys.executable, "-c", ASKS, *sys.path], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []


def tiny_llava_config(tmp_path: Path) -> Path:
    """The tiny HF LLaVA (SigLIP + Qwen2, tied) saved under ``tmp_path``, and a job file for it."""
    import yaml

    from oobleck_mm.model.tiny_hf import make_tiny_model

    raw = yaml.safe_load((ROOT / "configs" / "llava_tiny.yaml").read_text())
    raw["model"]["huggingface"] = make_tiny_model(tmp_path / "tiny_llava", "qwen2", "siglip", tie=True)
    config = tmp_path / "llava.yaml"
    config.write_text(yaml.safe_dump(raw))
    return config


LAYER_CODE = """
import json, sys, yaml
sys.path[:0] = sys.argv[2:]
from oobleck_mm.config import load_config
from oobleck_mm.model.layers import import_layer_code, model_layer_specs

job = load_config(sys.argv[1])
specs = model_layer_specs(job)
before = [m for m in sys.modules if m.startswith("transformers.models.") and ".modeling_" in m]
kinds = import_layer_code(job, specs)
after = sorted(m for m in sys.modules if m.startswith("transformers.models.") and ".modeling_" in m)
print(json.dumps({"before": before, "after": after, "kinds": kinds,
                  "distinct": len({(s.modality, s.kind) for s in specs})}), flush=True)
"""


def test_a_worker_imports_its_hf_models_code_before_it_is_ready(tmp_path):
    """``import_layer_code`` (a worker's start-up, before ``WorkerReady``): one layer of each kind on the meta
    device, so that an HF model's modules are imported there and not in the layers a joiner builds to receive
    a state copy, while a recovery's survivors wait (0.73 s -> 0.03 s for the tiny LLaVA's 11 layers)."""
    config = tiny_llava_config(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", LAYER_CODE, str(config), *sys.path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.splitlines()[-1])
    assert found["before"] == []
    assert "transformers.models.qwen2.modeling_qwen2" in found["after"]
    assert "transformers.models.siglip.modeling_siglip" in found["after"]
    assert found["kinds"] == found["distinct"]


TEMPLATE_PRELOAD = """
import json, os, sys
sys.path[:0] = sys.argv[1:]
import oobleck_mm.runtime.worker_preload
search = sys.modules.get("oobleck_mm.balance.search")
print(json.dumps({"models": sorted(m for m in sys.modules if m.startswith("transformers.models.") and ".modeling_" in m),
                  "kernels": len(search._search.signatures) if search is not None else 0,
                  "threads": len(os.listdir("/proc/self/task"))}))
import oobleck_mm.runtime.template_exit  # the template's last import: it ends at once (and flushes the line above)
"""


def test_a_local_runs_template_imports_its_hf_models_code(tmp_path):
    """``oobleck-launch local``'s shared template knows the job (``TEMPLATE_JOB_ENV``): its preload imports the
    job's layer code, so a worker forked from it skips ``import_layer_code``'s imports (a joiner of the tiny HF
    LLaVA ready 0.11-0.20 s after its injection instead of 1.6-2.2 s), and, for a job with the balancer on,
    loads the balancer's numba kernels that a joiner's ``StepBalancer`` would otherwise load beside its peers'
    training; without starting a thread (a fork keeps only the thread that forks)."""
    import yaml

    from oobleck_mm.runtime.template import TEMPLATE_JOB_ENV, template_environ

    config = tiny_llava_config(tmp_path)
    raw = yaml.safe_load(config.read_text())
    assert raw["balance"]["enabled"], "llava_tiny.yaml balances its batches"
    unbalanced = tmp_path / "unbalanced.yaml"
    unbalanced.write_text(yaml.safe_dump({**raw, "balance": {**raw["balance"], "enabled": False}}))
    started = {}
    for case, extra in (
        ("job", {TEMPLATE_JOB_ENV: str(config)}),
        ("unbalanced", {TEMPLATE_JOB_ENV: str(unbalanced)}),
        ("none", {}),
    ):
        # As a template starts (``template_environ``): without OPENBLAS_NUM_THREADS=1 numpy's OpenBLAS starts
        # a thread per core at the HF model's import (the test passed only after another test in its process
        # had set it). The three side by side: each is mostly imports.
        env = template_environ({**{k: v for k, v in os.environ.items() if k != TEMPLATE_JOB_ENV}, **extra})
        started[case] = subprocess.Popen(
            [sys.executable, "-c", TEMPLATE_PRELOAD, *sys.path],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    found = {}
    try:
        for case, proc in started.items():
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err
            found[case] = json.loads(out.splitlines()[-1])
    finally:
        for proc in started.values():
            proc.kill()
            proc.wait()
    assert "transformers.models.qwen2.modeling_qwen2" in found["job"]["models"]
    assert found["job"]["kernels"] > 0 and found["unbalanced"]["kernels"] == 0, found
    assert found["job"]["threads"] == found["none"]["threads"], "the kernels' loading started a thread"
    # A cluster agent's template does not know the job: its workers import it.
    assert found["none"]["models"] == [] and found["none"]["kernels"] == 0


QUICK_EXIT = """
import atexit, sys
sys.path[:0] = sys.argv[2:]
atexit.register(lambda: open(sys.argv[1], "w").close())  # stands in for torch's teardown, registered before
import oobleck_mm.runtime.template_exit
print("said before the exit")  # a pipe: buffered until the exit flushes it
raise SystemExit  # as the forkserver leaves when its alive pipe reaches EOF
"""


def test_a_template_ends_without_tearing_torch_down_and_says_what_it_printed(tmp_path):
    """The template's last import (``template_exit``) ends it at once when it exits: the handlers registered
    before it (torch's, at its import) and the modules' teardown never run (1.2 s of CPU, with the launcher's
    output pipes held open: each ``oobleck-launch local`` read to its end took 9.3 s instead of 10.4)."""
    from oobleck_mm.runtime import template

    saved, template._preload = template._preload, None  # what a first start in a process would preload
    try:
        template.warm_context(["some.target", template.TEMPLATE_EXIT])
        assert template._preload == [template.WORKER_PRELOAD, "some.target", template.TEMPLATE_EXIT]
    finally:
        template._preload = saved
        multiprocessing.get_context("forkserver").set_forkserver_preload(saved or [])
    ran = tmp_path / "teardown-ran"
    out = subprocess.run(
        [sys.executable, "-c", QUICK_EXIT, str(ran), *sys.path], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout == "said before the exit\n", (out.returncode, out.stdout, out.stderr)
    assert not ran.exists(), "a handler registered before the template's exit ran"


END_NOW = """
import atexit, sys
sys.path[:0] = sys.argv[2:]
atexit.register(lambda: open(sys.argv[1], "w").close())
import torch
from oobleck_mm.lifetime import end_now
print("the verdict")
print("verified", file=sys.stderr)
end_now(3)
"""


def test_a_finished_command_ends_at_once_with_its_code_and_its_output(tmp_path):
    """``lifetime.end_now`` (a finished ``verify`` or ``export``, a template): the code and every line printed
    arrive, and no exit handler runs (torch's teardown took 1.3 s after a verdict); ``oobleck-launch verify``
    ends through it with its own exit status and message."""
    ran = tmp_path / "teardown-ran"
    out = subprocess.run(
        [sys.executable, "-c", END_NOW, str(ran), *sys.path], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert (out.returncode, out.stdout, out.stderr) == (3, "the verdict\n", "verified\n")
    assert not ran.exists()
    bad = subprocess.run(
        [sys.executable, "-m", "oobleck_mm.cli", "verify", "--config", str(tmp_path / "none.yaml"), "--steps", "1"]
        + ["--against", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "none.yaml' does not exist" in bad.stderr, (bad.returncode, bad.stderr)
