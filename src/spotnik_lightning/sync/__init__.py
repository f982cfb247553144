"""Synchronisation built from ring primitives: the bucketed gradient all-reduce (S-SGD)."""

from spotnik_lightning.sync.reducer import GradientReducer

__all__ = ["GradientReducer"]
