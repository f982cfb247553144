"""``torch.distributed`` backend ``"spotnik"``: torch collectives (and DDP) on the self-repairing ring.

Usage::

    import spotnik_lightning.ring.backend as backend
    backend.register()                                   # idempotent
    dist.init_process_group("spotnik", ...)              # or dist.new_group(ranks, backend="spotnik")

Where the ring's membership store comes from (read once per process group, see :class:`Settings`):

* ``SPOTNIK_STORE`` set (``etcd://h:p[,h:p]``, ``embedded://h:p`` or ``h:p``): the ring uses that store,
  run id ``SPOTNIK_RUN_ID`` (when unset, a fresh id agreed through torch's c10d store, i.e. a new run
  per ``init_process_group``). A subgroup uses ``<run id>.<fresh id>`` in the same store.
* otherwise the ring bootstraps through torch's own c10d store (the one ``init_process_group`` /
  ``torchrun`` set up) via :class:`C10dMembershipStore`, so no extra configuration is needed.
  That store usually lives in rank 0 (or in the torchrun agent): repairs need it reachable.

Bootstrap: member ids are ``f"rank{rank}"``; once all ``world_size`` ranks registered, membership epoch 1
is committed with the members in torch's rank order, so ring rank == torch rank at bootstrap.
``getRank``/``getSize`` (``pg.rank()``/``pg.size()``) report the ring's *current* values afterwards.

Collectives run synchronously in the calling thread; every returned :class:`SpotnikWork` is already
complete. **Fault contract** (DESIGN §5: a future handed to DDP's reducer must never complete with an
exception, or the process dies with SIGSEGV): when the ring fails during a collective
(:class:`~spotnik_lightning.api.MembershipChanged`, ``RingBrokenError``, ``MembershipTimeoutError``,
``EpochFencedError``, ``ProtocolError``), the error is recorded on the process group
(:attr:`ProcessGroupSpotnik.last_error`, :attr:`ProcessGroupSpotnik.failed_epochs`,
:meth:`ProcessGroupSpotnik.take_error`), the Work's future completes *normally* with the output
tensors, whose contents are then undefined and must not be used, and :meth:`SpotnikWork.wait` raises
the error. ``dist.all_reduce(...)`` & co. call ``wait()``, so plain callers get the error at once;
DDP never calls it, so a DDP user (the strategy) must check ``pg.take_error()`` after ``backward()``
and skip the step when it is not None. Invalid arguments (unsupported reduce op, wrong sizes, non-CPU
tensors) raise ``ConfigError`` / ``NotImplementedError`` from the call itself.

Environment (validated; garbage raises :class:`~spotnik_lightning.api.ConfigError` naming the key):
``SPOTNIK_STORE``, ``SPOTNIK_RUN_ID``, ``SPOTNIK_HOST`` (address the ring binds and advertises; default:
this machine's address towards the store), ``SPOTNIK_TIER`` (``transient``/``reliable``),
``SPOTNIK_HEARTBEAT_MS``, ``SPOTNIK_HEARTBEAT_TIMEOUT_MS`` (ring heartbeat interval / dead-neighbour
timeout), ``SPOTNIK_STORE_TIMEOUT_MS`` (bound of one membership-store call, default 10000),
``SPOTNIK_SHUTDOWN_WAIT_MS`` (how long a closing member waits for the others to close, default 10000).
``SPOTNIK_SECRET`` is read by the ring itself. The ``timeout`` given to ``init_process_group`` bounds the
bootstrap, a join, and a collective that makes no progress (like gloo's timeout).

Teardown: ``destroy_process_group`` calls :meth:`ProcessGroupSpotnik.shutdown`, which waits (bounded
by ``SPOTNIK_SHUTDOWN_WAIT_MS``) until every member is closing too — a peer that closes while others
still finish the last collective would abort it for them — then closes the ring and stops its
threads. Call it on every rank, like torch requires. An ``atexit`` hook does the same for rings still
open at interpreter exit and joins the ring's threads (a Python thread still inside torch at
shutdown can abort the process).

Modules: :mod:`.settings` (:class:`Settings`, ``BACKEND_NAME``), :mod:`.work` (:class:`SpotnikWork` and
tensor helpers), :mod:`.process_group` (:class:`ProcessGroupSpotnik`), :mod:`.lifecycle` (rank-ordered
bootstrap, close handshake, atexit hook); :class:`C10dMembershipStore` lives in
:mod:`spotnik_lightning.membership.c10d`. This package holds the backend creator and :func:`register`.
"""

from __future__ import annotations

import atexit
import os
import threading
from datetime import timedelta

import torch.distributed as dist

from spotnik_lightning.api import ConfigError
from spotnik_lightning.membership import open_store, parse_endpoints
from spotnik_lightning.membership.c10d import C10dMembershipStore
from spotnik_lightning.membership.store import MembershipStore
from spotnik_lightning.ring.backend.lifecycle import (
    _agree,
    _close_all_at_exit,
    _close_ring,
    _local_address_towards,
    _RankOrderedRing,
    _store_host,
    _track,
)
from spotnik_lightning.ring.backend.process_group import ProcessGroupSpotnik
from spotnik_lightning.ring.backend.settings import BACKEND_NAME, Settings
from spotnik_lightning.ring.backend.work import SpotnikWork

__all__ = [
    "BACKEND_NAME",
    "C10dMembershipStore",
    "ProcessGroupSpotnik",
    "Settings",
    "SpotnikWork",
    "register",
]


def _create(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> ProcessGroupSpotnik:
    """Backend creator (``dist.Backend.register_backend``): bootstrap a ring among the group's ranks.

    Blocks until all ``world_size`` ranks have joined the ring. Raises ConfigError (bad environment),
    BackendConnectionError (membership store unreachable), MembershipTimeoutError (the other ranks did
    not arrive within ``timeout``).
    """
    settings = Settings.from_env()
    subgroup = dist.is_initialized()  # the default group is created before is_initialized() turns true
    suffix = _agree(store, "run", rank)
    if settings.store_url is not None:
        base = settings.run_id or f"spotnik-{suffix}"
        run_id = f"{base}.{suffix}" if subgroup else base
        mstore: MembershipStore = open_store(settings.store_url, run_id, settings.store_timeout)
        scheme, sep, rest = settings.store_url.partition("://")
        target = parse_endpoints(rest if sep else scheme)[0][0]
    else:
        run_id = f"{settings.run_id or 'c10d'}.{suffix}"
        mstore = C10dMembershipStore(store, run_id, settings.store_timeout)
        target = _store_host(store) or os.environ.get("MASTER_ADDR")
    host = settings.host or _local_address_towards(target)
    try:
        ring = _RankOrderedRing.create(
            mstore, world_size=world_size, member_id=f"rank{rank}", host=host, tier=settings.tier,
            timeouts=settings.timeouts(timeout))
    except BaseException:
        mstore.close()
        raise
    _track(ring, settings.shutdown_wait.total_seconds())
    try:
        if ring.membership.ids[ring.rank] != f"rank{rank}" or ring.size != world_size:
            raise ConfigError(f"ring of run {run_id!r} does not match torch's group: ring members "
                              f"{list(ring.membership.ids)}, torch rank {rank} of {world_size} "
                              "(a stale run? use a fresh SPOTNIK_RUN_ID)")
        return ProcessGroupSpotnik(ring, rank, world_size)
    except BaseException:
        _close_ring(ring)
        raise


_REGISTER_LOCK = threading.Lock()
_registered = False


def register() -> None:
    """Register the ``"spotnik"`` backend (CPU) with torch.distributed and the atexit hook that
    closes rings left open. Idempotent and thread-safe."""
    global _registered
    with _REGISTER_LOCK:
        if _registered:
            return
        if BACKEND_NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=False, devices=["cpu"])
        atexit.register(_close_all_at_exit)
        _registered = True
