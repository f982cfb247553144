"""AD-PSGD (Lian et al. 2018) on the ring: a local step, then one-sided averaging with a random
peer's *served* model, so no member ever waits for its peer to reach the same point.

Update rule for member ``i`` at committed step ``s`` (``x`` = parameters and floating buffers;
optimizer state stays local):

    x_i ← opt_step(x_i, g_i)                      (local gradient of i's slice, no all-reduce)
    publish(x_i, version=s)                       (a copy into i's served cache: no communication)
    p    = successor of i in cycle(s, epoch, C_i)  (a random live peer, see below)
    x̃_p  = p's latest published snapshot, of version v_p ≥ s − max_staleness (default 1)
    x_i  ← (x_i + x̃_p) / 2                        (only x_i changes: one-sided)

``x̃_p`` is p's model right after one of its local steps (before p's own averaging of that step):
version s if p published it before i asked, else s − 1. It is served by p's ring I/O threads; p's
training thread takes no part and is never blocked. ``cycle(s, epoch, C)`` is a random cyclic order
of the candidate ranks ``C`` drawn from ``(s, epoch)``, so each member's peer is uniformly random
among the others *and* every member is fetched from by exactly one peer per step (when the members
agree on ``C``): the serving load is even. ``C_i`` is the current ranks minus ``exclude`` minus the
peers this member dropped in the current epoch.

Failures: a fetch that fails because the peer is gone (died, left, excluded, unreachable, silent)
is skipped — never retried — and the peer is dropped from ``C_i`` at once, for the rest of the
epoch (the ring's repair then removes it from the membership; a new epoch starts with a fresh
candidate set). A fetch the peer answers without a usable snapshot (none yet, e.g. a joiner before
its first step, or one older than ``s − max_staleness``, e.g. the first step after switching into
AD-PSGD) is skipped without dropping the peer. A fetch never reports membership changes: the
member's next collective does (see :meth:`RingGroup.fetch`).

The per-step 48-byte commit vote stays (it agrees committed step counts, leavers, joiners and
switch requests, on which correctness rests); it is the only global operation of an AD-PSGD step.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Sequence

import torch

from spotnik_lightning.api import FetchError
from spotnik_lightning.ring.group import RingGroup
from spotnik_lightning.sync.primitives import average_with_snapshot, publish_model

log = logging.getLogger("spotnik.sync")


def cycle(step: int, epoch: int, ranks: Sequence[int]) -> list[int]:
    """A random cyclic order of ``ranks`` that depends only on ``(step, epoch, set(ranks))``."""
    order = sorted(ranks)
    random.Random(step * 1_000_003 + epoch * 7919 + len(order)).shuffle(order)
    return order


class ADPSGD:
    """One-sided gossip averaging through the served model cache (see the module doc)."""

    name = "adpsgd"

    def __init__(self, max_staleness: int = 1) -> None:
        self.max_staleness = max_staleness
        self.dropped: set[str] = set()  # member ids dropped from the candidates in ``_epoch``
        self._epoch = -1
        self._scratch: torch.Tensor | None = None
        self.averaged = 0
        self.skipped = 0

    def peer(self, ring: RingGroup, step: int, exclude: Iterable[int] = ()) -> int | None:
        """This member's peer at ``step`` (None: nobody to average with), among the ranks not in
        ``exclude`` and not dropped."""
        if ring.epoch != self._epoch:
            self._epoch, self.dropped = ring.epoch, set()
        ids = ring.membership.ids
        skip = set(exclude)
        cands = [r for r in range(ring.size) if r not in skip and ids[r] not in self.dropped]
        if ring.rank not in cands or len(cands) < 2:
            return None
        order = cycle(step, ring.epoch, cands)
        return order[(order.index(ring.rank) + 1) % len(order)]

    def after_step(self, ring: RingGroup, tensors: Sequence[torch.Tensor], step: int,
                   exclude: Iterable[int] = ()) -> tuple[int | None, FetchError | None]:
        """Publish this member's model (version ``step``), then average with its peer's latest
        snapshot. Returns ``(peer, None)`` on success (peer None: nobody to average with) or
        ``(peer, error)`` when the fetch failed: skipped, the tensors unchanged, a gone peer dropped.
        Blocks only on the fetch (bounded; see :meth:`RingGroup.fetch`). Other ring errors propagate."""
        publish_model(ring, tensors, step)
        peer = self.peer(ring, step, exclude)
        if peer is None:
            return None, None
        peer_id = ring.membership.ids[peer]
        try:
            _, self._scratch = average_with_snapshot(ring, tensors, peer_id, step - self.max_staleness,
                                                     self._scratch)
        except FetchError as exc:
            self.skipped += 1
            if exc.gone:
                self.dropped.add(peer_id)
            log.info("adpsgd step %d at %s: averaging with %s skipped: %s", step, ring.member_id, peer_id, exc)
            return peer, exc
        self.averaged += 1
        return peer, None
