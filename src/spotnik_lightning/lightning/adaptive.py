"""AdaptiveSync: a Lightning callback that switches the synchronisation mode by a policy.

After every training batch the callback measures this member's step time and per-worker
throughput (samples of its own slice per second, averaged over the last ``window`` steps) and
calls ``policy(metrics) -> name | None`` with::

    {"step", "world", "sync", "step_s", "throughput", "baseline", "ratio"}

``baseline`` is the per-worker throughput of the first full window measured with one worker (or,
if the run never had one worker, of the first full window at all); ``ratio = throughput/baseline``.
A returned name different from the mode in effect becomes :meth:`SpotnikStrategy.request_sync`;
the switch then happens at the next step boundary all members agree on (the lowest rank's request
wins, so give every member the same policy). The baseline is part of the callback state, so a
joiner receives it with the rest of the checkpoint state.

Logged: ``spotnik/sync`` (1 ssgd, 2 sma, 3 adpsgd) every step; a ``spotnik_sync_request {...}``
log line per request here and the strategy's ``spotnik_sync_switch {...}`` line per switch.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from spotnik_lightning.api import ConfigError
from spotnik_lightning.lightning.syncing import CODES

log = logging.getLogger("spotnik.lightning")

Policy = Callable[[dict[str, Any]], "str | None"]


class WorldSizeThreshold:
    """``low`` (default ``"adpsgd"``) from ``n`` workers on, ``high`` (default ``"ssgd"``) below."""

    def __init__(self, n: int, low: str = "adpsgd", high: str = "ssgd") -> None:
        if n < 1:
            raise ConfigError(f"WorldSizeThreshold needs n >= 1, got {n}")
        self.n, self.low, self.high = n, low, high

    def __call__(self, m: dict[str, Any]) -> str | None:
        return self.low if m["world"] >= self.n else self.high


class ThroughputTrigger:
    """The Spotnik paper's trigger (§3.3): while in ``high`` (S-SGD), switch to ``low`` (AD-PSGD)
    when the per-worker throughput falls below ``fraction`` of its one-worker baseline; switch
    back when the world shrinks below the size at which it switched (hysteresis: in ``low`` the
    throughput no longer says whether ``high`` would be fast again)."""

    def __init__(self, fraction: float = 0.4, low: str = "adpsgd", high: str = "ssgd", window: int = 5) -> None:
        if not 0 < fraction < 1:
            raise ConfigError(f"fraction must be in (0, 1), got {fraction}")
        self.fraction, self.low, self.high, self.window = fraction, low, high, window
        self.switched_at: int | None = None

    def __call__(self, m: dict[str, Any]) -> str | None:
        if m["sync"] == self.high and m["ratio"] is not None and m["ratio"] < self.fraction:
            self.switched_at = m["world"]
            return self.low
        if m["sync"] == self.low and self.switched_at is not None and m["world"] < self.switched_at:
            self.switched_at = None
            return self.high
        return None


def _local_samples(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return _local_samples(batch[0])
    if isinstance(batch, dict) and batch:
        return _local_samples(next(iter(batch.values())))
    return 1


class AdaptiveSync(pl.Callback):
    """Drive :class:`SpotnikStrategy`'s sync mode with ``policy`` (see the module doc).
    ``window``: steps averaged for the throughput (default: the policy's ``window`` or 5)."""

    def __init__(self, policy: Policy, window: int | None = None) -> None:
        self.policy = policy
        self.window = int(window or getattr(policy, "window", 5))
        self.baseline: float | None = None
        self.requests: list[dict] = []
        self._times: deque[tuple[float, int]] = deque(maxlen=self.window)
        self._world = 0
        self._t = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        strategy = trainer.strategy
        if not hasattr(strategy, "request_sync"):
            return
        world = strategy.world_size
        if world != self._world:  # a new membership: measure afresh
            self._times.clear()
            self._world = world
        self._times.append((time.perf_counter() - self._t, _local_samples(batch)))
        pl_module.log("spotnik/sync", float(CODES[strategy.sync_mode]), on_step=True, prog_bar=True)
        if len(self._times) < self.window:
            return
        step_s = sum(t for t, _ in self._times) / len(self._times)
        throughput = sum(n for _, n in self._times) / max(sum(t for t, _ in self._times), 1e-9)
        if self.baseline is None and (world == 1 or trainer.global_step >= self.window):
            self.baseline = throughput
        metrics = {"step": trainer.global_step, "world": world, "sync": strategy.sync_mode, "step_s": step_s,
                   "throughput": throughput, "baseline": self.baseline,
                   "ratio": throughput / self.baseline if self.baseline else None}
        want = self.policy(metrics)
        if want and want != strategy.sync_mode and want != strategy.sync_requested:
            strategy.request_sync(want)
            entry = {**metrics, "request": want}
            self.requests.append(entry)
            log.info("spotnik_sync_request %s", json.dumps(entry, sort_keys=True, default=str))

    def state_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.baseline = state_dict.get("baseline")
