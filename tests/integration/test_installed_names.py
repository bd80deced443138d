"""Issue 53 item 4: installing the project puts one name on a user's path, ``oobleck_mm``.

The master and the agent were top-level packages (``master``, ``agent``), which collide with anything else
of that name in a user's environment; they are ``oobleck_mm.master`` and ``oobleck_mm.agent`` now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_pip_install_puts_only_oobleck_mm_on_the_path(tmp_path):
    target = tmp_path / "site"
    # A real ``pip install .`` (the build backend the project declares, no index: its build requirements are
    # this environment's), into a folder of its own.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
    )
    names = sorted(p.name for p in target.iterdir() if not p.name.endswith((".dist-info", ".egg-info")))
    assert names in (["oobleck_mm"], ["bin", "oobleck_mm"]), names
    assert (target / "oobleck_mm" / "master" / "server.py").exists() and (
        target / "oobleck_mm" / "agent" / "agent.py"
    ).exists()
    # And what the installed entry point runs imports from there.
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.util as u, oobleck_mm.master.server, oobleck_mm.agent.agent;"
            " print(u.find_spec('master'), u.find_spec('agent'), oobleck_mm.master.server.__file__)",
        ],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.split()[:2] == ["None", "None"] and str(target) in found.stdout, found.stdout
