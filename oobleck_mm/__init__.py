"""oobleck_mm: fault-tolerant, elastic training of multimodal models on spot capacity.

From Python: ``oobleck_mm.local(config, ...)`` runs a job on the embedded local cluster and
``oobleck_mm.launch(config, ...)`` the master of a real one (``oobleck_mm.api``); the command line is
``oobleck-launch`` (``oobleck_mm.cli``). Importing the package imports nothing else: every submodule of
the library is loaded by whoever needs it.
"""

from __future__ import annotations

__all__ = ["Run", "launch", "local"]


def __getattr__(name: str):
    # Lazily: ``import oobleck_mm.config`` in a worker must not load the API's command line.
    if name in __all__:
        from oobleck_mm import api

        return getattr(api, name)
    raise AttributeError(f"module 'oobleck_mm' has no attribute {name!r}")
