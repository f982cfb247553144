"""Synchronisation primitives on a :class:`RingGroup`, for model averaging.

Everything here moves *model state* (parameters, buffers, optimizer state), not gradients (the
gradient all-reduce is :class:`~spotnik_lightning.sync.reducer.GradientReducer`). Tensors are
flattened into one contiguous buffer per dtype, so a model of any shape costs one collective per
dtype. Ring errors (e.g. :class:`MembershipChanged`) propagate to the caller; on an error the
tensors are left untouched.

* :func:`average_all` — ``t ← (1/n) Σ_members t`` (ring all-reduce "avg"; bit-identical everywhere);
* :func:`average_pair` — ``t ← (t + t_peer) / 2`` with one peer (ring exchange; both sides compute
  the same float sum, so the pair ends bit-identical);
* :func:`pairing` — a perfect matching of the ranks derived only from ``(step, epoch)``, so every
  member computes the same pairs without communicating.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import torch

from spotnik_lightning.ring.group import RingGroup


def _groups(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    by: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() and t.numel():
            by.setdefault(t.dtype, []).append(t)
    return list(by.values())


def _flat(group: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in group])


def _unflat(group: list[torch.Tensor], flat: torch.Tensor) -> None:
    with torch.no_grad():
        off = 0
        for t in group:
            n = t.numel()
            t.copy_(flat[off:off + n].view_as(t))
            off += n


def average_all(ring: RingGroup, tensors: Iterable[torch.Tensor]) -> int:
    """Replace every floating tensor by its mean over the ring's members (non-floating tensors are
    skipped). One all-reduce per dtype, issued in a fixed order (dtypes in first-seen order), so
    every member must pass the same tensors in the same order. Returns the bytes reduced."""
    nbytes = 0
    flats = []
    for group in _groups(tensors):
        flat = _flat(group)
        ring.all_reduce(flat, "avg")
        flats.append((group, flat))
        nbytes += flat.numel() * flat.element_size()
    for group, flat in flats:  # only after every collective succeeded: all or nothing locally
        _unflat(group, flat)
    return nbytes


def average_pair(ring: RingGroup, tensors: Iterable[torch.Tensor], peer: int) -> int:
    """``t ← (t + t_peer) / 2`` for every floating tensor, with rank ``peer`` (which must call this
    with this member's rank and the same tensor layout). Returns the bytes sent."""
    nbytes = 0
    out = []
    for group in _groups(tensors):
        mine = _flat(group)
        theirs = torch.empty_like(mine)
        ring.exchange(mine, theirs, peer)
        out.append((group, mine.add_(theirs).div_(2)))
        nbytes += mine.numel() * mine.element_size()
    for group, flat in out:
        _unflat(group, flat)
    return nbytes


def pairing(step: int, epoch: int, ranks: Sequence[int]) -> dict[int, int | None]:
    """A random perfect matching of ``ranks`` that depends only on ``(step, epoch, ranks)``: each
    rank maps to its peer, or to None (the odd one out when ``len(ranks)`` is odd). Symmetric:
    ``p[p[r]] == r``."""
    order = sorted(ranks)
    random.Random(step * 1_000_003 + epoch * 7919 + len(order)).shuffle(order)
    out: dict[int, int | None] = {}
    for i in range(0, len(order) - 1, 2):
        a, b = order[i], order[i + 1]
        out[a], out[b] = b, a
    if len(order) % 2:
        out[order[-1]] = None
    return out
