"""SMA: synchronous model averaging every ``k`` steps.

Update rule for member ``i`` at committed step ``s`` (learning rate and optimizer as configured,
e.g. SGD with momentum; the optimizer state stays local):

    x_i ← opt_step(x_i, g_i)                 (local gradient of the member's slice, no all-reduce)
    if s % k == 0:  x_i ← (1/n) Σ_j x_j      (parameters and floating buffers; one all-reduce per dtype)

With ``k = 1`` and plain SGD this equals S-SGD up to float rounding; larger ``k`` trades
consistency for fewer (model-sized) collectives. All members average at the same committed step
counts (the counts are agreed by the commit vote), so the collective sequence stays consistent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spotnik_lightning.api import ConfigError
from spotnik_lightning.ring.group import RingGroup
from spotnik_lightning.sync.primitives import average_all


class SMA:
    """Periodic model averaging. :meth:`after_step` runs the averaging at the steps it is due."""

    name = "sma"

    def __init__(self, period: int = 4) -> None:
        if period < 1:
            raise ConfigError(f"SMA period must be >= 1, got {period}")
        self.period = period

    def due(self, step: int) -> bool:
        return step % self.period == 0

    def after_step(self, ring: RingGroup, tensors: Sequence[torch.Tensor], step: int) -> bool:
        """Average ``tensors`` over the ring if ``step`` is an averaging step; returns whether it
        averaged. Ring errors propagate (the tensors are then unchanged)."""
        if not self.due(step):
            return False
        average_all(ring, tensors)
        return True
