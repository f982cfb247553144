"""Spotnik's metrics on Lightning's loggers and progress bar (added by the strategy to every fit)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


class SpotnikMetrics(pl.Callback):
    """Logs, after every training batch: ``spotnik/world`` and ``spotnik/epoch`` (membership size
    and epoch, also on the progress bar), ``spotnik/changes`` (membership changes seen),
    ``spotnik/retried_steps``, ``spotnik/recovery_ms`` (the last discard-to-resume time) and
    ``spotnik/vote_ms`` (the last commit vote's duration). Values are local (no collective): every
    member holds the same ones, except ``vote_ms``, each member's own."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        s = self.strategy
        if s.ring is None or s._left:
            return
        c = s.counters
        pl_module.log_dict({"spotnik/world": float(s.ring.size), "spotnik/epoch": float(s.ring.epoch)},
                           prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
        pl_module.log_dict({"spotnik/changes": float(c.changes), "spotnik/retried_steps": float(c.retried_steps),
                            "spotnik/recovery_ms": float(c.last_recovery_ms), "spotnik/vote_ms": float(c.vote_ms)},
                           on_step=True, on_epoch=False, batch_size=1)
