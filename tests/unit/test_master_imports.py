"""The master and the launcher never import torch: they hold no tensor, and importing it costs each of their
processes ~2.5 CPU-s on a 2-core machine (a master per launch, a launcher per run; the suite starts ~100 of
each). What a master does with a job in a fresh interpreter: its modules, the data check, the data order
the checkpoints record, a checkpoint's ``meta.json`` written, then read back and checked as a ``--resume``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import zipfile

from harness import write_config

MASTER_WORK = textwrap.dedent(
    """
    import os, sys
    import oobleck_mm.cli, oobleck_mm.master.local, oobleck_mm.master.server
    from oobleck_mm.config import load_config
    from oobleck_mm.config.shape import layer_specs
    from oobleck_mm.data.check import check_samples
    from oobleck_mm.master.checkpointing import meta_sampler, resume_step, write_meta
    from oobleck_mm.runtime.checkpoint_meta import newest_checkpoint

    config, checkpoint, names = sys.argv[1], sys.argv[2], sys.argv[3]
    job = load_config(config)
    check_samples(job, print)
    with open(names + ".tmp", "w") as out:
        out.write("\\n".join(s.name for s in layer_specs(job.model, job.data)))
    os.replace(names + ".tmp", names)
    sys.stdin.readline()  # the test writes a shard per layer meanwhile
    write_meta(checkpoint, job, 3, meta_sampler(job))
    assert resume_step(checkpoint, job) == 3 and newest_checkpoint([checkpoint])[1] == 3
    print("torch imported:", "torch" in sys.modules)
    """
)


def test_the_master_and_the_launcher_never_import_torch(tmp_path):
    config = write_config(tmp_path, nodes=3, steps=4)
    checkpoint, names = tmp_path / "ckpt", tmp_path / "names.txt"
    proc = subprocess.Popen(
        [sys.executable, "-c", MASTER_WORK, config, str(checkpoint), str(names)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not names.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        (checkpoint / "layers").mkdir(parents=True)
        for name in names.read_text().split():  # a shard is a zip archive (torch.save's); its tensors never read
            with zipfile.ZipFile(checkpoint / "layers" / f"{name}.pt", "w") as shard:
                shard.writestr("data.pkl", b"")
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "torch imported: False" in out, out[-2000:]
