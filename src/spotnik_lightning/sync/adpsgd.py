"""AD-PSGD (Lian et al. 2018) on the ring: a local step, then one-sided averaging with a random
peer's *served* model, fetched in the background, so no member ever waits for a peer to reach the
same point.

Update rule for member ``i`` at committed step ``s`` (``x`` = parameters and floating buffers;
optimizer state stays local):

    x_i ← opt_step(x_i, g_i)                      (local gradient of i's slice, no all-reduce)
    publish(x_i, version=s)                       (a copy into i's served cache: no communication)
    x_i ← (x_i + x̃_p) / 2                         (only x_i changes: one-sided)
    start fetching x̃_q for step s+1               (background thread; q = peer(s+1))

where ``p = peer(s)`` is the successor of ``i`` in ``cycle(s, epoch, C_i)``, and ``x̃_p`` is the
snapshot of ``p`` fetched in the background while ``i`` computed step ``s``: p's latest published
model when the fetch ran — p's model right after its local step ``s−1`` (before p's averaging),
occasionally ``s−2`` — and never older than ``s − max_staleness`` (default 2; an older one is not
used). It is served by p's ring I/O threads: p's training thread takes no part and is never
blocked, and i's training thread only waits if the fetch is still running when it needs it.
``cycle(s, epoch, C)`` is a random cyclic order of the candidate ranks ``C`` drawn from
``(s, epoch)``, so each member's peer is uniformly random among the others *and* every member is
fetched from by exactly one peer per step (when the members agree on ``C``): the serving load is
even. ``C_i`` is the current ranks minus ``exclude`` minus the peers this member dropped in the
current epoch. The first AD-PSGD step of a member has nothing fetched yet and only publishes.

Failures: a fetch that fails because the peer is gone (died, left, excluded, unreachable, silent)
is skipped — never retried — and the peer is dropped from ``C_i`` at once, for the rest of the
epoch (the ring's repair then removes it from the membership; a new epoch starts with a fresh
candidate set). A fetch the peer answers without a usable snapshot (none yet, e.g. a joiner before
its first step, or one too old, e.g. right after switching into AD-PSGD) is skipped without dropping
the peer. A fetch never reports membership changes: the member's next collective does (see
:meth:`RingGroup.fetch`).

The per-step 48-byte commit vote stays (it agrees committed step counts, leavers, joiners and
switch requests, on which correctness rests); it is the only global operation of an AD-PSGD step.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterable, Sequence

import torch

from spotnik_lightning.api import FetchError
from spotnik_lightning.ring.group import RingGroup
from spotnik_lightning.sync.primitives import MODEL, average_snapshot, publish_model, snapshot_bytes

log = logging.getLogger("spotnik.sync")


def cycle(step: int, epoch: int, ranks: Sequence[int]) -> list[int]:
    """A random cyclic order of ``ranks`` that depends only on ``(step, epoch, set(ranks))``."""
    order = sorted(ranks)
    random.Random(step * 1_000_003 + epoch * 7919 + len(order)).shuffle(order)
    return order


class _Fetch:
    """One background fetch of a peer's snapshot (a daemon thread; the ring bounds its waits)."""

    def __init__(self, ring: RingGroup, peer_id: str, buf: torch.Tensor, min_version: int) -> None:
        self.peer_id, self.buf = peer_id, buf
        self.version: int | None = None
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._run, args=(ring, min_version), name="spotnik-gossip", daemon=True)
        self._t.start()

    def _run(self, ring: RingGroup, min_version: int) -> None:
        try:
            self.version = ring.fetch(self.peer_id, MODEL, self.buf, min_version=min_version)
        except BaseException as exc:  # handed to the training thread in result()
            self.error = exc

    def result(self, timeout: float) -> int:
        """The fetched version; raises the fetch's error (FetchError, RingBrokenError, ...)."""
        self._t.join(timeout)
        if self._t.is_alive():
            raise FetchError(f"fetch of {MODEL!r} from {self.peer_id} still running after {timeout:.0f} s",
                             self.peer_id, -1, gone=True)
        if self.error is not None:
            raise self.error
        assert self.version is not None
        return self.version


class ADPSGD:
    """One-sided gossip averaging through the served model cache (see the module doc)."""

    name = "adpsgd"

    def __init__(self, max_staleness: int = 2) -> None:
        self.max_staleness = max_staleness
        self.dropped: set[str] = set()  # member ids dropped from the candidates in ``_epoch``
        self._epoch = -1
        self._pending: _Fetch | None = None
        self._spare: torch.Tensor | None = None
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
                   exclude: Iterable[int] = ()) -> tuple[str | None, FetchError | None]:
        """Publish this member's model (version ``step``); average with the snapshot fetched in the
        background since the previous call (if any); start the background fetch of the next step's
        peer. Returns ``(peer id, None)`` after averaging, ``(None, None)`` when nothing was
        fetched, ``(peer id, error)`` when the fetch failed (skipped; the tensors unchanged; a gone
        peer dropped). Blocks only if the previous fetch is still running (bounded by the ring's
        collective timeout). Ring errors other than FetchError propagate."""
        publish_model(ring, tensors, step)
        done, self._pending = self._pending, None
        out: tuple[str | None, FetchError | None] = (None, None)
        if done is not None:
            out = (done.peer_id, None)
            try:
                version = done.result(ring.timeouts.collective.total_seconds())
                if version < step - self.max_staleness:
                    raise FetchError(f"snapshot of {done.peer_id} is version {version} < {step - self.max_staleness}",
                                     done.peer_id, ring.epoch, gone=False)
            except FetchError as exc:
                self.skipped += 1
                if exc.gone and done.peer_id in ring.membership.ids:
                    self.dropped.add(done.peer_id)
                log.info("adpsgd step %d at %s: averaging with %s skipped: %s", step, ring.member_id, done.peer_id, exc)
                out = (done.peer_id, exc)
            else:
                average_snapshot(tensors, done.buf)
                self.averaged += 1
            self._spare = done.buf
        peer = self.peer(ring, step + 1, exclude)
        if peer is not None:
            nbytes = snapshot_bytes(tensors)
            buf = self._spare if self._spare is not None and self._spare.numel() == nbytes else torch.empty(
                nbytes, dtype=torch.uint8)
            self._spare = None
            self._pending = _Fetch(ring, ring.membership.ids[peer], buf, step + 1 - self.max_staleness)
        return out
