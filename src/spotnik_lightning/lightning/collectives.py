"""Lightning's collectives (``reduce``, ``barrier``, ``broadcast``, ``all_gather``) on the ring, as a
mixin of :class:`~spotnik_lightning.lightning.strategy.SpotnikStrategy`.

Outside a training step a membership change makes every member resync at once; members that had
completed the interrupted collective serve its result to those that had not, so all members agree
on every collective's result. After the member left the ring, or before a joiner's first step,
they are local.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch

from spotnik_lightning.api import ConfigError, MembershipChanged, SpotnikError

_EMPTY = torch.empty(0, dtype=torch.uint8)


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


class RingCollectives:
    """Mixin: needs ``ring``, ``_left``, ``_quiet``, ``_reducer``, ``_note_change``, ``_resync``;
    keeps ``_coll_done`` (collectives completed) and ``_coll_last`` (the last one's result, as bytes)."""

    ring: Any
    _left: bool
    _quiet: bool
    _reducer: Any
    _faults: Any
    _committer: Any
    _coll_done: int
    _coll_last: torch.Tensor

    def _collective(self, fn: Callable[[], Any], encode: Callable[[Any], torch.Tensor],
                    decode: Callable[[torch.Tensor], Any]) -> Any:
        """Run one of Lightning's collectives (``fn``, one or more ring operations) to completion.

        On a membership change the member resyncs at once (its first operation on the new
        membership, as for every member). Members that had already completed this collective
        serve its result — ``encode``d as bytes, kept from their last collective — to those
        that had not (``decode``); otherwise everybody runs ``fn`` again on the new membership.
        """
        committed = self._committer.committed if self._committer else 0
        self._faults.at("collective", committed)
        for _ in range(8):
            try:
                out = fn()
            except MembershipChanged as exc:
                self._note_change(exc)
                res = self._resync(voted=False, joiner=False)
                if res.served is None:
                    continue
                out = decode(res.served)
            self._coll_done += 1
            self._coll_last = encode(out)
            self._faults.at("collective_done", committed)
            return out
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
        base = tensor.detach().to(torch.float64 if tensor.is_floating_point() else tensor.dtype)

        def run() -> torch.Tensor:
            t, n = base.clone(), self.ring.size  # the membership this all-reduce runs on, if it completes
            self.ring.all_reduce(t, "sum" if op == "mean" else op)
            return t / n if op == "mean" else t

        t = self._collective(run, _tensor_bytes, lambda b: b.view(base.dtype).view(base.shape).clone())
        return t.to(tensor.dtype) if tensor.is_floating_point() else t

    def barrier(self, name: str | None = None) -> None:
        if self._distributed():
            self._collective(self.ring.barrier, lambda _: _EMPTY, lambda _: None)

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

        return self._collective(run, lambda o: torch.frombuffer(bytearray(pickle.dumps(o)), dtype=torch.uint8),
                                lambda b: pickle.loads(b.numpy().tobytes()))

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        if not self._distributed():
            return tensor.unsqueeze(0)

        def run() -> torch.Tensor:
            src = tensor.detach().contiguous()
            out = torch.empty(self.ring.size * src.numel(), dtype=src.dtype)
            self.ring.all_gather(out, src)
            return out.view(self.ring.size, *src.shape)

        return self._collective(run, _tensor_bytes,
                                lambda b: b.view(tensor.dtype).view(-1, *tensor.shape).clone())

    @contextmanager
    def block_backward_sync(self):  # noqa: ANN201 - a context manager
        if self._reducer is None:
            yield None
            return
        with self._reducer.disarmed():
            yield None
