"""Checkpoints for whole-cluster loss, at the Young/Daly interval for the observed revocation rate.

Losing single workers costs a SpotnikStrategy job almost nothing; only losing *every* worker needs a
checkpoint. :class:`YoungDalyCheckpoint` is Lightning's ``ModelCheckpoint`` whose step interval
follows Young/Daly's optimum ``sqrt(2 · C · MTTF)``: ``C`` is the measured cost of one checkpoint,
``MTTF`` the mean time between revocations seen by the ring (workers removed from the membership),
starting from a prior until revocations are observed. All members must save at the same steps
(saving has collectives), so rank 0 computes the interval and broadcasts it every
``update_every`` steps — a step boundary every member reaches.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint


def young_daly_steps(cost_s: float, mttf_s: float, step_s: float, lo: int = 1, hi: int = 100_000) -> int:
    """The Young/Daly interval ``sqrt(2 · cost · MTTF)`` in steps of ``step_s`` seconds, clamped."""
    if step_s <= 0:
        return hi
    return max(lo, min(hi, round(math.sqrt(2.0 * max(cost_s, 0.0) * max(mttf_s, 0.0)) / step_s)))


class YoungDalyCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint(every_n_train_steps=...)`` with the interval set by Young/Daly.

    Args: ``mttf_prior_s`` (mean time between revocations assumed before any is seen, default 1 h),
    ``initial_every`` (steps until the first measurement), ``update_every`` (how often, in steps,
    the interval is recomputed and agreed), ``min_every``/``max_every`` (clamps); the rest as for
    ``ModelCheckpoint``. ``interval`` holds the current interval in steps.
    """

    def __init__(self, *args: Any, mttf_prior_s: float = 3600.0, initial_every: int = 100, update_every: int = 50,
                 min_every: int = 1, max_every: int = 100_000, **kwargs: Any) -> None:
        kwargs.setdefault("save_top_k", 1)
        super().__init__(*args, every_n_train_steps=initial_every, **kwargs)
        self.mttf_prior_s, self.update_every = mttf_prior_s, update_every
        self.min_every, self.max_every = min_every, max_every
        self.interval = initial_every
        self.cost_s = 0.0
        self._t0 = time.monotonic()
        self._steps0 = 0

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        t = time.monotonic()
        super()._save_checkpoint(trainer, filepath)
        self.cost_s = time.monotonic() - t

    def revocations(self, trainer: pl.Trainer) -> int:
        """Workers removed from the ring since training started (0 without a SpotnikStrategy)."""
        ring = getattr(trainer.strategy, "ring", None)
        if ring is None:
            return 0
        return sum(len(e.removed) for e in ring.events if e.kind == "repair")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._t0, self._steps0 = time.monotonic(), trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step and step % self.update_every == 0:
            elapsed = time.monotonic() - self._t0
            steps = max(1, step - self._steps0)
            lost = self.revocations(trainer)
            mttf = elapsed / lost if lost else max(self.mttf_prior_s, elapsed)
            mine = young_daly_steps(self.cost_s, mttf, elapsed / steps, self.min_every, self.max_every)
            self.interval = int(trainer.strategy.broadcast(mine, src=0))  # every member saves at the same steps
            self._every_n_train_steps = self.interval
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
