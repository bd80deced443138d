"""A master starts (and restarts) without importing torch: it listens ~1 s sooner.

The master checks the job (``check_runnable``), checks generated data
(``data/check.py``) and opens its metrics before it listens; none of it needs
torch on the master's machine. The limits check imported it (~1 s idle, 2-3 s
beside a busy job), so did the data check through the data package, and so did
opening TensorBoard through ``torch.utils.tensorboard`` (now tensorboard's own event
writer, ``oobleck_mm.master.metrics.TensorBoardWriter``: 2.2 s of CPU less per master). Checked in a fresh interpreter (a
subprocess): the test process has imported torch already.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_mm.yaml"


def test_the_masters_start_imports_no_torch(tmp_path):
    code = (
        "import sys; import oobleck_mm.master.server, oobleck_mm.master.local; from oobleck_mm.runtime.limits import check_runnable; "
        "from oobleck_mm.config.loading import load_config; from oobleck_mm.master.metrics import MetricsSink; "
        "from oobleck_mm.master.server import _check_data; "
        f"job = load_config({str(CONFIG)!r}); check_runnable(job, workers_here=False); _check_data(job, print); "
        f"sink = MetricsSink({str(tmp_path)!r}); sink._tb.add_scalar('a', 1.0, 1); sink._tb.add_text('b', 'c', 1); "
        "sink.close(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", f"torch was imported before the master listens: {out.stderr[-2000:]}"
