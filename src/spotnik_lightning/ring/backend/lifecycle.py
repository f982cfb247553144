"""Ring lifecycle for the spotnik backend: bootstrap in torch's rank order, close, and exit.

* :class:`_RankOrderedRing`: the RingGroup the backend creates (founding membership in rank order);
* the live-ring registry (:func:`_track`), the close handshake (:func:`_linger`, :func:`_announce`),
  :func:`_close_ring` and the atexit hook :func:`_close_all_at_exit`;
* helpers of the backend creator: :func:`_store_host`, :func:`_local_address_towards`, :func:`_agree`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid

import torch.distributed as dist

from spotnik_lightning.api import MembershipTimeoutError, SpotnikError
from spotnik_lightning.membership.types import Membership
from spotnik_lightning.ring.group import RingGroup

log = logging.getLogger("spotnik.backend")


# --------------------------------------------------------------------------- rank-ordered ring


class _RankOrderedRing(RingGroup):
    """A RingGroup whose founding membership lists the members in torch's rank order.

    Member ids must be ``rank0`` ... ``rank{world_size-1}``. The stock bootstrap orders the founders by
    tier, then registration order; here every founder waits until all ``world_size`` ids are
    registered and then proposes ``Membership(1, members sorted by rank)`` (identical proposals, one
    CAS wins). Once a membership exists, the stock logic installs it (or joins a running ring).
    """

    def _enter(self, world_size: int | None) -> None:
        if world_size is None:
            return super()._enter(world_size)
        ids = [f"rank{i}" for i in range(world_size)]
        deadline = time.monotonic() + self.timeouts.bootstrap.total_seconds()
        while True:
            current = self.store.get_membership()
            if current is not None and current.epoch > 0:
                return super()._enter(world_size)
            regs = {m.id: m for m in self.store.registered()}
            missing = [i for i in ids if i not in regs]
            if not missing:
                self.store.cas_membership(0, Membership(1, tuple(regs[i] for i in ids)))
                continue
            if time.monotonic() > deadline:
                raise MembershipTimeoutError(
                    f"bootstrap of run {self.run_id!r}: {world_size - len(missing)} of {world_size} ranks "
                    f"registered after {self.timeouts.bootstrap.total_seconds():.0f} s "
                    f"(epoch 0, member {self.me.id}; missing {missing[:8]})")
            time.sleep(0.05)


# --------------------------------------------------------------------------- live rings / exit

_LIVE_LOCK = threading.Lock()
_LIVE: dict[RingGroup, float] = {}  # open ring -> seconds to linger at close


def _track(ring: RingGroup, linger: float) -> None:
    with _LIVE_LOCK:
        _LIVE[ring] = linger


def _linger(ring: RingGroup, timeout: float) -> None:
    """Wait (at most ``timeout`` s) until every current member announced that it is closing.

    A member that finished the last collective and closes at once makes its neighbours see EOF on
    their links and abort *their* end of that collective (the ring treats a closed peer as dead). So
    a closing member first writes ``closed.<member id>`` in the membership store and closes once all
    current members wrote theirs: by then every member has finished all its collectives. A dead or
    absent member only delays the close until ``timeout``; a store failure ends the wait.
    """
    if ring.state not in ("running", "repairing") or ring.size < 2:
        return
    deadline = time.monotonic() + timeout
    try:
        _announce(ring)
        while time.monotonic() < deadline and ring.state in ("running", "repairing"):
            if all(ring.store.get(f"closed.{m}") is not None for m in ring.membership.ids):
                return
            time.sleep(0.02)
    except SpotnikError as exc:  # the store is gone (e.g. rank 0 exited): nobody to wait for
        log.debug("linger of %s ended: %s", ring.member_id, exc)


def _announce(ring: RingGroup) -> None:
    """Tell the other members (through the store) that this member is closing (idempotent)."""
    ring.store.put(f"closed.{ring.member_id}", str(ring.epoch))


def _close_ring(ring: RingGroup) -> None:
    with _LIVE_LOCK:
        linger = _LIVE.pop(ring, None)
    try:
        if linger is not None:
            _linger(ring, linger)
        ring.close()
    finally:
        try:
            ring.store.close()
        except Exception as exc:  # best effort at teardown
            log.debug("closing the membership store of %s failed: %s", ring.member_id, exc)


def _close_all_at_exit(join_timeout: float = 5.0) -> None:
    """atexit hook: close every ring still open, then join the ring threads (bounded)."""
    with _LIVE_LOCK:
        rings = list(_LIVE)
    for ring in rings:  # announce every ring first, so the lingers below do not wait in turn
        try:
            if ring.state in ("running", "repairing"):
                _announce(ring)
        except SpotnikError as exc:
            log.debug("announcing the close of %s failed: %s", ring.member_id, exc)
    for ring in rings:
        try:
            _close_ring(ring)
        except Exception as exc:
            log.debug("closing ring at exit failed: %s", exc)
    deadline = time.monotonic() + join_timeout
    for t in threading.enumerate():
        if t is not threading.current_thread() and t.name.startswith("spotnik"):
            t.join(max(0.0, deadline - time.monotonic()))


# --------------------------------------------------------------------------- creator helpers


def _store_host(store: dist.Store) -> str | None:
    """The host of the TCPStore under ``store`` (through PrefixStores), if any."""
    seen = 0
    while store is not None and seen < 16:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def _local_address_towards(host: str | None) -> str:
    """This machine's IPv4 address on the route to ``host`` (127.0.0.1 when unknown/local)."""
    if not host or host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _agree(store: dist.Store, key: str, rank: int) -> str:
    """A fresh hex id, chosen by rank 0 and read by the others through torch's store (which blocks
    up to the store's own timeout)."""
    full = "spotnik/agree/" + key
    if rank == 0:
        store.set(full, uuid.uuid4().hex[:16])
    return store.get(full).decode()
