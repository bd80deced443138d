# Two entry points, each doing all of its set-up on a fresh machine:
#   make run   -- virtual environment + project, then the main job
#   make test  -- the same plus the MindtPy chain, SLURM and Chromium, then ruff, the import contracts and the suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, CPU build: an unpinned torch would pull a multi-GB CUDA build.
# On a GPU cluster, set TORCH_SPEC to your own torch (or leave the one you have:
# an importable torch is never replaced).
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup bytecode minlp slurm chromium run test test-fast bench gpu-check proto clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m oobleck_mm.balance.search   # compile the balancer's kernels once (numba's disk cache)
	touch $@

# The project's bytecode, written once here for every process to read: where PYTHONDONTWRITEBYTECODE is set
# (the environment of the machines this project is developed on sets it) no process writes its own, and each
# compiled every module of the project it imported from source (0.09 CPU-s an agent, 0.17 a master; a suite
# run starts ~600 such processes). A module edited since is compiled in memory again: a stale file is never read.
bytecode: setup
	$(PY) -m compileall -q oobleck_mm tests scripts examples > /dev/null

minlp: setup
	bash scripts/install_minlp.sh $(PY)

# A real SLURM for the launch file's test (Debian packages; needs root: elsewhere that test skips).
slurm:
	bash scripts/install_slurm.sh

# Debian's Chromium for the status page's browser test (needs root: elsewhere that check skips).
chromium:
	bash scripts/install_chromium.sh

# The main job: pipelines of different depths, the balancer on, a node killed and one joining.
RUN_ARGS := local --config configs/mission.yaml --inject kill:node4@step10,join@step12

run: bytecode
	$(VENV)/bin/oobleck-launch $(RUN_ARGS)

# Two test processes (pytest-xdist): the multi-process tests leave a core idle half the time
# (waits on heartbeats, timeouts, joins), and every test must pass next to other load anyway.
TEST_WORKERS ?= 2

test: bytecode minlp slurm chromium
	$(VENV)/bin/ruff check .              # lint (settings in pyproject.toml)
	$(VENV)/bin/ruff format --check .     # the formatter's layout, no hand-kept exceptions
	$(VENV)/bin/lint-imports --no-cache   # the package graph's contracts (.importlinter)
	$(PY) -m pytest tests -q -p no:cacheprovider --durations=30 -n $(TEST_WORKERS) --dist worksteal

# The edit loop: the unit tests only (under a minute on 2 cores); `make test` stays the whole suite.
test-fast: bytecode
	$(PY) -m pytest tests/unit -q -p no:cacheprovider -x

bench: setup
	$(PY) scripts/bench_planner.py --json benchmarks/bench_planner.json

# On a machine with a GPU: every CUDA test, then a short bench, one summary (scripts/gpu_check.py).
gpu-check: setup
	$(PY) scripts/gpu_check.py --json gpu_check.json

proto: setup
	bash oobleck_mm/protocol/regen.sh $(PY)

clean:
	rm -rf $(VENV) build *.egg-info
