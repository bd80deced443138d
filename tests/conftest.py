"""Fixtures of every test that starts processes; ``tests/harness.py`` is their one harness.

(This file's folder is on ``sys.path`` for the whole suite, so ``from harness import ...`` works in
tests/e2e and tests/integration alike.)"""

from __future__ import annotations

import os

import pytest

# One torch thread per process, the suite over: xdist's workers, every rank an in-process test spawns and
# every process they start inherit it (a test that wants more sets its own). The suite runs two tests at a
# time on two cores, each of several processes; with torch's default of a thread per core, each process's
# OpenMP threads spin-wait for cores the others hold: test_engine_prefetch, test_engine_world_of_one and
# test_worker_generations cost 80 CPU-s alone against 32 CPU-s with one thread (x2.5), and worse beside
# another test. Set before anything imports torch (its OpenMP reads it when it loads). The launches' workers
# already default to 1 (``oobleck-launch local``).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def launches():
    """``harness.Launch`` runs a test started: a failed test must not leave its cluster running."""
    started = []
    yield started
    for run in started:
        run.kill_all()


@pytest.fixture
def paced(monkeypatch):
    """The processes this test starts pace their steps (``harness.PACE``): for a job that trains only until the
    test has seen what it waits for (a loss, a notice, a stop), every step past the pace trains for nothing."""
    from harness import PACE

    monkeypatch.setenv("OOBLECK_HOLD_AT", PACE)


@pytest.fixture
def procs(tmp_path):
    """Single agents and masters a test starts (``harness.Procs``): killed at teardown, and none may survive."""
    from harness import Procs

    started = Procs(tmp_path)
    yield started
    started.cleanup()


_MADE_REFERENCE_CACHE: list[str] = []


def pytest_configure(config):
    """One folder for the reference trainer's states this run (``harness.REFERENCE_CACHE_ENV``), made by the
    first process (xdist's controller, whose workers inherit its environment) and removed by it at the end."""
    import os
    import tempfile

    from harness import REFERENCE_CACHE_ENV

    # Every worker template this process starts (``run_local``'s, the launches': ``harness.suite_template``)
    # imports the tests' model code too (``tests/template_preload.py``); only the first call decides. By the
    # name the template finds from the repository's root (its ``sys.path[0]``, the working directory: Python
    # 3.11's forkserver takes no ``sys.path`` from its starter), where the suite runs.
    from oobleck_mm.runtime.template import warm_context

    warm_context(["tests.template_preload"])

    if not os.environ.get(REFERENCE_CACHE_ENV):
        os.environ[REFERENCE_CACHE_ENV] = tempfile.mkdtemp(prefix="oobleck-test-references-")
        _MADE_REFERENCE_CACHE.append(os.environ[REFERENCE_CACHE_ENV])


def pytest_unconfigure(config):
    import shutil

    for folder in _MADE_REFERENCE_CACHE:
        shutil.rmtree(folder, ignore_errors=True)
