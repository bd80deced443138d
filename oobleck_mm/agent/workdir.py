"""An agent's private folder (the job config its workers read), and the clean-up of those SIGKILLed agents left."""

from __future__ import annotations

import os
import shutil
from typing import Callable

WORK_DIR_PREFIX = "oobleck-agent-"
"""An agent's private folder (the job config its workers read): ``oobleck-agent-NODE-PID-XXXX``."""


def remove_stale_work_dirs(root: str, pid_alive: Callable[[int], bool]) -> list[str]:
    """Removes the folders under ``root`` of agents that are gone (a SIGKILLed agent cannot clean up)."""
    removed = []
    for name in os.listdir(root):
        parts = name[len(WORK_DIR_PREFIX) :].rsplit("-", 2) if name.startswith(WORK_DIR_PREFIX) else []
        if len(parts) == 3 and parts[1].isdigit() and not pid_alive(int(parts[1])):
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def write_private(path: str, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path
