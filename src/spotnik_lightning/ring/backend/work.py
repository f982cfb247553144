"""The spotnik backend's :class:`SpotnikWork` and the small helpers its process group uses.

* reduce-op mapping and argument helpers (:func:`_reduce_op`, :func:`_as_list`, :func:`_cpu`,
  :func:`_opt`);
* ring calls on dense memory (:func:`_dense`, :func:`_all_reduce`, :func:`_broadcast`,
  :func:`_all_gather`, :func:`_gather_flat`, :func:`_send`, :func:`_recv`), which copy results back
  into tensors the ring cannot use directly; :func:`_reduce_scatter_one` (an all-reduce, then this
  rank's slice) and :func:`_check_rank`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from spotnik_lightning.api import ConfigError, SpotnikError
from spotnik_lightning.ring.group import RingGroup

if TYPE_CHECKING:
    from spotnik_lightning.ring.backend.process_group import ProcessGroupSpotnik


class SpotnikWork(dist.Work):
    """A finished collective. ``get_future()`` is already completed with the output tensors — even
    when the ring failed (see the fault contract in :mod:`spotnik_lightning.ring.backend`);
    :meth:`wait` raises that failure."""

    def __init__(self, pg: ProcessGroupSpotnik, name: str, result: list[torch.Tensor],
                 error: SpotnikError | None = None) -> None:
        super().__init__()
        self._pg, self._name, self._result, self._error = pg, name, result, error
        self._fut: torch.futures.Future = torch.futures.Future()
        self._fut.set_result(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Return True, or raise the ring error this collective hit (once observed, the process
        group no longer reports it from :meth:`ProcessGroupSpotnik.take_error`)."""
        if self._error is not None:
            self._pg._observed(self._error)
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """A completed future of the output tensors (never completed with an exception)."""
        return self._fut

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self._error is None

    def exception(self) -> SpotnikError | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        return self._result


# --------------------------------------------------------------------------- helpers

_OPS = {
    dist.ReduceOp.RedOpType.SUM: "sum",
    dist.ReduceOp.RedOpType.AVG: "avg",
    dist.ReduceOp.RedOpType.MIN: "min",
    dist.ReduceOp.RedOpType.MAX: "max",
    dist.ReduceOp.RedOpType.PRODUCT: "product",
}


def _reduce_op(op: object) -> str:
    """Map a torch ReduceOp (or RedOpType) to the ring's op name; ConfigError for the others."""
    kind = getattr(op, "op", op)
    if kind in _OPS:
        return _OPS[kind]
    raise ConfigError(f"the spotnik backend does not support reduce op {kind!r}; "
                      f"supported: SUM, AVG, MIN, MAX, PRODUCT")


def _as_list(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _cpu(tensors: Sequence[torch.Tensor], what: str) -> None:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{what}: expected tensors, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ConfigError(f"{what}: the spotnik backend takes CPU tensors, got one on {t.device}")
        if t.is_sparse:
            raise ConfigError(f"{what}: the spotnik backend does not support sparse tensors")


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the ring can use its memory directly, else a dense copy.

    ``is_contiguous()`` ignores the stride of size-1 dimensions, so a one-element view such as
    ``x[::2][:1]`` counts as contiguous while ``view(-1)`` keeps its stride 2; the ring's byte view of
    it then fails ("self.stride(-1) must be 1 to view Float as Byte"). Copy those, and every truly
    non-contiguous tensor.
    """
    if t.is_contiguous() and (t.numel() != 1 or t.reshape(-1).stride(0) == 1):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _opt(opts: object, name: str, default: object) -> object:
    return default if opts is None else getattr(opts, name, default)


# ---- ring calls on dense memory (results copied back into non-dense tensors)
def _all_reduce(ring: RingGroup, t: torch.Tensor, op: str) -> None:
    w = _dense(t)
    ring.all_reduce(w, op)
    if w is not t:
        t.copy_(w)


def _broadcast(ring: RingGroup, t: torch.Tensor, root: int) -> None:
    w = _dense(t)
    ring.broadcast(w, root)
    if w is not t:
        t.copy_(w)


def _all_gather(ring: RingGroup, out: torch.Tensor, inp: torch.Tensor) -> None:
    w = _dense(out)
    ring.all_gather(w, _dense(inp))
    if w is not out:
        out.copy_(w)


def _gather_flat(ring: RingGroup, inp: torch.Tensor) -> torch.Tensor:
    """Every member's ``inp`` (flattened), concatenated in rank order."""
    flat = torch.empty(ring.size * inp.numel(), dtype=inp.dtype)
    _all_gather(ring, flat, inp)
    return flat


def _send(ring: RingGroup, t: torch.Tensor, dst: int) -> None:
    ring.send(_dense(t), dst)


def _recv(ring: RingGroup, t: torch.Tensor, src: int) -> None:
    w = _dense(t)
    ring.recv(w, src)
    if w is not t:
        t.copy_(w)


def _reduce_scatter_one(ring: RingGroup, output: torch.Tensor, flat_input: torch.Tensor, op: str) -> None:
    n, rank = ring.size, ring.rank
    if flat_input.numel() != n * output.numel():
        raise ConfigError(f"reduce_scatter: input must hold {n} x {output.numel()} elements, "
                          f"got {flat_input.numel()}")
    _all_reduce(ring, flat_input, op)
    output.copy_(flat_input[rank * output.numel():(rank + 1) * output.numel()].view(output.shape))


def _check_rank(ring: RingGroup, r: int, what: str) -> None:
    if not 0 <= r < ring.size:
        raise ConfigError(
            f"{what}: rank {r} out of range for world size {ring.size} (epoch {ring.epoch})")
