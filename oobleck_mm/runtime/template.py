"""The warm worker template: the standard library's ``forkserver`` with a worker's imports done once.

One home for how a process that trains is started without paying torch's
imports again: an agent's workers (``oobleck_mm/agent/workers.py``), the ranks of
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

TEMPLATE_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
"""Variables every template starts with, whatever its caller's environment: torch asks NVML, not the
CUDA driver, whether there is a GPU. Asking the driver (``torch._C._cuda_getDeviceCount``) registers
torch's fork handler, and every fork of the template then fails at its first CUDA call with "Cannot
re-initialize CUDA in forked subprocess" (seen on an H200: ``oobleck-launch local``'s shared template
was started with the agents' environment, which lacked it)."""
TEMPLATE_ENV_DEFAULTS = {"OPENBLAS_NUM_THREADS": "1"}
"""Variables a template starts with unless its caller set them: numpy's OpenBLAS starts no thread per
core in a process that only forks."""

TEMPLATE_JOB_ENV = "OOBLECK_TEMPLATE_JOB"
"""Set for a template that knows its job (``oobleck-launch local``'s shared one): the job file whose layers'
code (an HF model's ``transformers`` modules) the preload imports too (``worker_preload``)."""

WORKER_PRELOAD = "oobleck_mm.runtime.worker_preload"
"""What the template imports for the engine's workers (torch, torch._dynamo, the engine, DeepSpeed's
schedules where there is no GPU)."""


TEMPLATE_EXIT = "oobleck_mm.runtime.template_exit"
"""The template's last import: at exit it skips torch's teardown (1.2 s of CPU; the module says why)."""


def warm_context(extra_preload: list[str] | None = None) -> BaseContext:
    """The ``forkserver`` context; its template imports ``WORKER_PRELOAD``, ``extra_preload`` and
    ``TEMPLATE_EXIT``.

    The first call before the template starts decides what it imports, so every caller gets the
    engine's imports whatever else it asked for: a test whose stand-in worker starts the template
    first must not leave the engine's ranks to import torch after each fork. The caller's
    environment takes ``TEMPLATE_ENV`` (and ``TEMPLATE_ENV_DEFAULTS`` where unset): the template and
    every fork of it inherit them.
    """
    os.environ.update(template_environ(os.environ))
    ctx = multiprocessing.get_context("forkserver")
    global _preload
    if _preload is None:
        extra = [m for m in extra_preload or () if m not in (WORKER_PRELOAD, TEMPLATE_EXIT)]
        _preload = [WORKER_PRELOAD, *extra, TEMPLATE_EXIT]  # TEMPLATE_EXIT last: its handler runs first
        ctx.set_forkserver_preload(_preload)
    return ctx


_preload: list[str] | None = None


def template_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` as a template must start with it (``TEMPLATE_ENV``, ``TEMPLATE_ENV_DEFAULTS``)."""
    return {**TEMPLATE_ENV_DEFAULTS, **environ, **TEMPLATE_ENV}


def gpu_build() -> bool:
    """Whether torch was built for a GPU (CUDA or ROCm): ``WORKER_PRELOAD``'s test of whether DeepSpeed's
    import could initialise a GPU driver, asked of nothing but the build (``worker_preload`` says why)."""
    import torch

    return torch.version.cuda is not None or torch.version.hip is not None


def target_preload(target: str | None) -> list[str] | None:
    """What a template imports besides ``WORKER_PRELOAD`` for workers that run ``target``
    ("module:function"; None: the engine's own worker, whose imports ``WORKER_PRELOAD`` has)."""
    return [target.partition(":")[0]] if target else None


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


# ---------------------------------------------------------------------- one template for a local run's nodes
SHARED_TEMPLATE = "shared"
"""``oobleck-launch local --worker-start``'s default: its agents fork their workers from one template for
all its simulated nodes; its other values are the agents' own (a template per agent, as on a cluster,
or fresh interpreters)."""
SHARED_TEMPLATE_ENV = "OOBLECK_WORKER_TEMPLATE"
"""Set by ``oobleck-launch local`` for its agents: the address (and, where Python asks for one, the
key) of the warm template all its simulated nodes fork their workers from."""


def start_shared_template(environ: Mapping[str, str], extra_preload: list[str] | None = None) -> str:
    """Starts this process's warm template for other processes' use; returns the value of
    ``SHARED_TEMPLATE_ENV`` that points them at it.

    ``oobleck-launch local`` runs N simulated nodes on one machine. With a template per agent each
    node pays torch's imports (2-4 s of CPU) on the cores the others train on, a joining node
    included, which a real node pays on its own machine. One template, started here while the
    master starts, pays them once per run. The template inherits ``environ`` (the agents'
    environment: torch's OpenMP reads ``OMP_NUM_THREADS`` when it loads). It ends with this
    process (the forkserver's "alive" pipe).

    The standard library has no public way to share a forkserver between processes that did not
    start it; its client side is small and stable (Python 3.8-3.13; 3.14 adds a key, passed
    along too), so the fields it reads are set in ``use_shared_template``.
    """
    warm_context(extra_preload)
    from multiprocessing import forkserver

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(template_environ(environ))
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    server = forkserver._forkserver
    key = getattr(server, "_forkserver_authkey", None)
    address = server._forkserver_address  # a path, or "\0name" in Linux's abstract namespace (no NUL in a variable)
    return ("@" + address[1:] if address.startswith("\0") else address) + (f"#{key.hex()}" if key else "")


def template_pid() -> int:
    """The pid of this process's own running template (after ``start_shared_template``)."""
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


def use_shared_template(value: str) -> None:
    """Points this process's ``forkserver`` context at the template another process started
    (``start_shared_template``'s value): each ``Process`` it starts is then a fork of that
    template. The template is not this process's child, so it is not restarted from here: its
    owner (the launcher) outlives it."""
    import multiprocessing.resource_tracker as resource_tracker
    from multiprocessing import forkserver

    address, _, key = value.partition("#")
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not os.path.exists(address):
        raise FileNotFoundError(f"{SHARED_TEMPLATE_ENV}: no worker template listens at {address}")
    server = forkserver._forkserver
    with server._lock:
        global _own
        if _own is None:
            _own = (
                server._forkserver_address,
                server._forkserver_alive_fd,
                getattr(server, "_forkserver_authkey", None),
            )
        server._forkserver_address = address
        if key:
            server._forkserver_authkey = bytes.fromhex(key)
        if server._forkserver_alive_fd is None:
            # The fork's copy of this fd is its own "alive" end for a forkserver of its own (workers
            # start none); the shared template's life is tied to its owner's end, not to ours.
            server._forkserver_alive_fd = os.open(os.devnull, os.O_RDONLY)
    # ensure_running would waitpid() a process that is not our child: keep only its resource tracker.
    server.ensure_running = resource_tracker.ensure_running


_own: tuple | None = None
"""What ``use_shared_template`` replaced (this process's own template's address, alive fd and key)."""


def leave_shared_template() -> None:
    """Undoes ``use_shared_template``: the next ``Process`` is a fork of this process's own template
    (the one it ran before, or one started then)."""
    from multiprocessing import forkserver

    global _own
    server = forkserver._forkserver
    with server._lock:
        server.__dict__.pop("ensure_running", None)
        if _own is None:
            return
        if server._forkserver_alive_fd not in (None, _own[1]):
            os.close(server._forkserver_alive_fd)  # the stand-in use_shared_template opened
        server._forkserver_address, server._forkserver_alive_fd = _own[0], _own[1]
        if hasattr(server, "_forkserver_authkey"):
            server._forkserver_authkey = _own[2]
        _own = None
