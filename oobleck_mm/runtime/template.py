"""The warm worker template: the standard library's ``forkserver`` with a worker's imports done once.

One home for how a process that trains is started without paying torch's
imports again: an agent's workers (``agent/workers.py``), the ranks of
``runtime.worker.run_local`` (the tests' multi-process groups, the benches).
The template is an interpreter of its own (never a fork of a caller that may
hold gRPC's or torch's threads), single-threaded, CUDA untouched
(``worker_preload``'s docstring says why that holds on a GPU too); each
``Process`` of the returned context is a fork of it.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Mapping
from multiprocessing.context import BaseContext

WORKER_PRELOAD = "oobleck_mm.runtime.worker_preload"
"""What the template imports for the engine's workers (torch, torch._dynamo, the engine, DeepSpeed's
schedules where there is no GPU)."""


def warm_context(extra_preload: list[str] | None = None) -> BaseContext:
    """The ``forkserver`` context; its template imports ``WORKER_PRELOAD`` and ``extra_preload``.

    The first call before the template starts decides what it imports, so every caller gets the
    engine's imports whatever else it asked for: a test whose stand-in worker starts the template
    first must not leave the engine's ranks to import torch after each fork. The variables set
    here are inherited by the template and every fork of it: torch asks NVML, not the CUDA driver,
    whether there is a GPU (a driver initialised before a fork is unusable in the child), and
    numpy's OpenBLAS starts no thread per core in a process that only forks.
    """
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    ctx = multiprocessing.get_context("forkserver")
    global _preload
    if _preload is None:
        _preload = [WORKER_PRELOAD, *(m for m in extra_preload or () if m != WORKER_PRELOAD)]
        ctx.set_forkserver_preload(_preload)
    return ctx


_preload: list[str] | None = None


def with_environ(environ: Mapping[str, str], target: Callable, *args) -> None:
    """A fork's entry that first takes ``environ`` as its environment, then runs ``target(*args)``.

    A fork of the template inherits the environment the template started with, not its caller's
    of now (a spawned process would see the latter): a caller that set a variable since (a test's
    fault injection, a hold point) passes ``dict(os.environ)`` through here.
    """
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def warm_process(target: Callable, *args, daemon: bool = True) -> multiprocessing.Process:
    """A ``Process`` (not started) forked from the warm template that runs ``target(*args)`` with the
    caller's environment as it is now (``with_environ``)."""
    return warm_context().Process(target=with_environ, args=(dict(os.environ), target, *args), daemon=daemon)
