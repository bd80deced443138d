"""Emulated accelerators: run a job on CPU workers as if on real GPUs (``cluster.emulate``, docs/emulation.md).

- ``truth``: the true seconds of every stage's work and transfer on the emulated
  accelerator (the real model's roofline, perturbed by stated factors and noise);
- ``clock``: deadline-paced waits that take no CPU, and the lateness record that
  says whether the host kept the deadlines (a run that did not is invalid).
"""
