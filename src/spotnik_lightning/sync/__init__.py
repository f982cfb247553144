"""Synchronisation built from ring primitives: the bucketed gradient all-reduce (S-SGD), model
averaging (SMA) and one-sided averaging with a peer's served model (AD-PSGD)."""

from spotnik_lightning.sync.adpsgd import ADPSGD, cycle
from spotnik_lightning.sync.primitives import (
    average_all,
    average_with_snapshot,
    complete_optimizer_state,
    publish_model,
)
from spotnik_lightning.sync.reducer import GradientReducer
from spotnik_lightning.sync.sma import SMA

MODES = ("ssgd", "sma", "adpsgd")
"""Synchronisation modes by name; their codes in the commit vote are ``index + 1`` (0: none)."""

__all__ = ["ADPSGD", "MODES", "SMA", "GradientReducer", "average_all", "average_with_snapshot",
           "complete_optimizer_state", "cycle", "publish_model"]
