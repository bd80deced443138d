"""A pytest plugin: the CPU-seconds each test cost the machine, its processes and everything they started.

    PYTHONPATH=scripts OOBLECK_TEST_CPU_DIR=/tmp/cpu pytest tests -n 2 -p pytest_cpu_per_test
    cat /tmp/cpu/*.tsv | sort -rn | head -40      # CPU-s, wall-s, test id

The suite is CPU-bound on 2 cores (two tests at a time, each several processes), so what a test costs the
suite is its CPU, not its wall time, which the other test's load inflates. Each xdist worker moves itself
into a cgroup v1 ``cpuacct`` group of its own, which every process it forks or spawns inherits (launchers,
agents, workers forked from its worker template, the reference trainer in the test process); a test's CPU
is that group's usage across it. Needs root and a cgroup v1 ``cpuacct`` hierarchy (this project's 2-core
host); elsewhere it says so once and records nothing. A process a test leaves running is charged to the
tests after it.
"""

from __future__ import annotations

import os
import time

import pytest

CPUACCT = "/sys/fs/cgroup/cpuacct"
_group: str | None = None


def pytest_configure(config):
    global _group
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if not os.environ.get("OOBLECK_TEST_CPU_DIR") or config.pluginmanager.hasplugin("dsession"):
        return  # xdist's controller runs no test
    group = f"{CPUACCT}/oobleck_tests_{worker}"
    try:
        os.makedirs(group, exist_ok=True)
        with open(f"{group}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    except OSError as error:
        print(f"pytest_cpu_per_test: no per-test CPU ({group}: {error})")
        return
    _group = group


def _usage_s() -> float:
    with open(f"{_group}/cpuacct.usage") as f:
        return int(f.read()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _group is None:
        yield
        return
    cpu, wall = _usage_s(), time.monotonic()
    yield
    cpu, wall = _usage_s() - cpu, time.monotonic() - wall
    folder = os.environ["OOBLECK_TEST_CPU_DIR"]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.tsv"), "a") as f:
        f.write(f"{cpu:.2f}\t{wall:.2f}\t{item.nodeid}\n")
