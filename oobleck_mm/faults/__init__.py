"""Fault injection for local clusters: specs, trace replay, the injector thread, and the recovery report.

- ``spec``: ``--inject`` values (``kill:node1@step4`` ...) -> ``FaultEvent`` (pure)
- ``trace``: spot-instance traces + ``--time-scale`` -> ``FaultEvent`` timeline (pure)
- ``injector``: fires them at the processes of ``oobleck-launch local`` with real signals
- ``report``: per-failure recovery table and samples/s plot from the event log

How ``oobleck-launch local`` wires them: ``docs/recovery_harness.md``.
"""

from oobleck_mm.faults.spec import FaultEvent, parse_inject

__all__ = ["FaultEvent", "parse_inject"]
