"""The planner's answers to requests no plan can meet: the user's to fix (``UserError``), each with its numbers."""

from __future__ import annotations

from oobleck_mm.errors import UserError


class InfeasiblePlan(UserError):
    """No plan exists: the model fits no device, or the templates cannot cover the node counts."""


class TooFewNodes(InfeasiblePlan):
    """Fewer nodes than ``(f + 1) * n0``: f + 1 replicas of the smallest pipeline do not fit.

    At start-up the user's mistake; during a run the job's end below the threshold
    (the master checkpoints and exits 3), so callers tell it apart by type.
    """

    def __init__(self, message: str, live_nodes: int, needed: int) -> None:
        super().__init__(message)
        self.live_nodes = live_nodes
        self.needed = needed
