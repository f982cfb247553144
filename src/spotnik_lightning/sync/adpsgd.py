"""AD-PSGD (Lian et al. 2018) on the ring: a local step, then pairwise model averaging.

Update rule for member ``i`` at committed step ``s``:

    x_i ← opt_step(x_i, g_i)                 (local gradient, no all-reduce; optimizer state local)
    p   = pairing(s, epoch, candidates)[i]   (same random perfect matching on every member)
    if p is not None:  x_i ← (x_i + x_p) / 2 (one exchange per dtype with p only)

There is no global collective in the averaging: each pair talks only to itself. The candidates are
the current ranks minus ``exclude``; with an odd number the odd one out skips this step. A peer
that left or died is gone from the next membership, so it is dropped from the candidates at once
(the strategy skips the averaging of a step after which a member leaves: see
:mod:`spotnik_lightning.lightning.syncing`). A failed exchange (a membership change) is *skipped*,
never retried: the caller gets the :class:`MembershipChanged` back and must treat it as observed
(the ring reports each change once per member, so its next collective must be the resync that
the other members reach through their own next collective).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from spotnik_lightning.api import MembershipChanged
from spotnik_lightning.ring.group import RingGroup
from spotnik_lightning.sync.primitives import average_pair, pairing


class ADPSGD:
    """Pairwise averaging with a deterministic random peer per step."""

    name = "adpsgd"

    def peer(self, ring: RingGroup, step: int, exclude: Iterable[int] = ()) -> int | None:
        """This member's peer at ``step`` (None: it skips), among the ranks not in ``exclude``."""
        skip = set(exclude)
        if ring.rank in skip:
            return None
        return pairing(step, ring.epoch, [r for r in range(ring.size) if r not in skip]).get(ring.rank)

    def after_step(self, ring: RingGroup, tensors: Sequence[torch.Tensor], step: int,
                   exclude: Iterable[int] = ()) -> tuple[int | None, MembershipChanged | None]:
        """Average with this step's peer. Returns ``(peer, None)`` on success (peer None: skipped)
        or ``(peer, error)`` when a membership change interrupted the exchange (then skipped, the
        tensors unchanged). Other ring errors propagate."""
        peer = self.peer(ring, step, exclude)
        if peer is None:
            return None, None
        try:
            average_pair(ring, tensors, peer)
        except MembershipChanged as exc:
            return peer, exc
        return peer, None
