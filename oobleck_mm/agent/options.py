"""How an agent is started (``oobleck-launch agent`` flags as ``AgentOptions``) and what it reads of the job."""

from __future__ import annotations

from dataclasses import dataclass

from oobleck_mm.agent.workers import DEFAULT_WORKER_START, DEFAULT_WORKER_TARGET
from oobleck_mm.config import FaultToleranceConfig, parse_config_text, section_from_dict
from oobleck_mm.errors import UserError


@dataclass(frozen=True, slots=True)
class AgentOptions:
    master: str
    """HOST:PORT of the master."""
    token: str
    node: str
    gpus: int = 0
    """Workers to run; 0: as many as the job's cluster.gpus_per_node."""
    worker_target: str = DEFAULT_WORKER_TARGET
    """"module:function" each worker process runs (see agent.workers.worker_entry)."""
    connect_timeout_s: float = 60.0
    """How long registration waits for the master to come up."""
    worker_start: str = DEFAULT_WORKER_START
    """``forkserver`` (forks of a pre-imported worker template) or ``spawn`` (agent.workers)."""
    left_exit_code: int = 0
    """Exit code when the master planned this node out after its preemption notice while the job goes on.
    0 by default; a Kubernetes Job counts a pod that exits 0 as one of its completions and never replaces
    it, so its manifest gives a code its ``podFailurePolicy`` ignores (the pod is replaced, nothing is
    counted against the Job's retries)."""


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UserError(f"--master: expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def fault_tolerance_of(config_yaml: str) -> FaultToleranceConfig:
    """The job's fault-tolerance section (every timeout the agent uses derives from it)."""
    raw = parse_config_text(config_yaml) or {}
    return section_from_dict(FaultToleranceConfig, raw.get("fault_tolerance"), "fault_tolerance")
