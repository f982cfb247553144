"""Lightning's collectives (``reduce``, ``barrier``, ``broadcast``, ``all_gather``) on the ring, as a
mixin of :class:`~spotnik_lightning.lightning.strategy.SpotnikStrategy`.

Outside a training step a membership change is handled by retrying the collective on the new
membership and resynchronising at the next step boundary (see docs/lightning.md for the one race
this leaves). After the member left the ring, or before a joiner's first step, they are local.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch

from spotnik_lightning.api import ConfigError, MembershipChanged, SpotnikError


class RingCollectives:
    """Mixin: needs ``ring``, ``_left``, ``_quiet``, ``_reducer`` and ``_note_change``."""

    ring: Any
    _left: bool
    _quiet: bool
    _reducer: Any
    _resync_needed: bool
    _faults: Any
    _committer: Any

    def _collective(self, fn: Callable[[], Any]) -> Any:
        """Run a ring collective; after a membership change, retry it on the new membership and
        resync at the next step boundary."""
        committed = self._committer.committed if self._committer else 0
        self._faults.at("collective", committed)
        for _ in range(8):
            try:
                out = fn()
                self._faults.at("collective_done", committed)
                return out
            except MembershipChanged as exc:
                self._note_change(exc)
                self._resync_needed = True
        raise SpotnikError("collective kept failing across 8 membership changes")

    def _distributed(self) -> bool:
        return self.ring is not None and not self._left and not self._quiet and self.ring.size > 1

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor) or not self._distributed():
            return tensor
        op = str(getattr(reduce_op, "name", reduce_op) or "mean").lower().replace("reduceop.", "")
        op = {"avg": "mean"}.get(op, op)
        if op not in ("sum", "mean", "max", "min"):
            raise ConfigError(f"SpotnikStrategy.reduce: unsupported reduce_op {reduce_op!r}")
        t = tensor.detach().clone().to(torch.float64 if tensor.is_floating_point() else tensor.dtype)
        self._collective(lambda: self.ring.all_reduce(t, "sum" if op == "mean" else op))
        if op == "mean":
            t = t / self.ring.size
        return t.to(tensor.dtype) if tensor.is_floating_point() else t

    def barrier(self, name: str | None = None) -> None:
        if self._distributed():
            self._collective(self.ring.barrier)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._distributed():
            return obj

        def run() -> Any:
            data = pickle.dumps(obj) if self.ring.rank == src else b""
            size = torch.tensor([len(data)], dtype=torch.int64)
            self.ring.broadcast(size, src)
            n = int(size.item())
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(n, dtype=torch.uint8)
            self.ring.broadcast(buf, src)
            return pickle.loads(buf.numpy().tobytes())

        return self._collective(run)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        if not self._distributed():
            return tensor.unsqueeze(0)

        def run() -> torch.Tensor:
            src = tensor.detach().contiguous()
            out = torch.empty(self.ring.size * src.numel(), dtype=src.dtype)
            self.ring.all_gather(out, src)
            return out.view(self.ring.size, *src.shape)

        return self._collective(run)

    @contextmanager
    def block_backward_sync(self):  # noqa: ANN201 - a context manager
        if self._reducer is None:
            yield None
            return
        with self._reducer.disarmed():
            yield None
