"""What went wrong, and the exit code that says so: the one definition every process uses.

Two kinds of failure, and the CLI tells them apart by type alone:

- ``UserError``: something the user wrote or asked for is wrong or impossible (a
  config field, a flag, a checkpoint that does not fit the job, a model that fits
  no device). The message names the bad value and what would be valid; the CLI
  prints it as one line and exits ``ExitCode.BAD_INPUT``. ``ConfigError`` and
  the planner's infeasibility errors are subclasses.
- anything else is a bug in this project: the CLI exits ``ExitCode.ERROR`` and
  the traceback goes to the log.

``UserError`` subclasses ``ValueError`` so that code (and tests) that caught a
``ValueError`` for a bad value keeps working. A leaf: imports nothing else of
the project, so every package, ``config`` included, may import it.
"""

from __future__ import annotations

import enum


class UserError(ValueError):
    """A mistake the user can fix; the message names the value and what would be valid."""


class ExitCode(enum.IntEnum):
    """Exit codes of ``oobleck-launch`` and of the master's job (the agent's too)."""

    OK = 0
    ERROR = 1
    """A failure of the run or a bug (the message or the log says which)."""
    BAD_INPUT = 2
    """A ``UserError``: bad config, flag or checkpoint; an agent the master refused (token, name)."""
    NO_REPLICAS = 3
    """Fewer than (f+1)*n0 nodes left: the survivors wrote a checkpoint; the message says how to resume."""
