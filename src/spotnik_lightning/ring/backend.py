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
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from spotnik_lightning.api import (
    BackendConnectionError,
    ConfigError,
    MembershipChanged,
    MembershipTimeoutError,
    RingTimeouts,
    SpotnikError,
)
from spotnik_lightning.membership import open_store, parse_endpoints
from spotnik_lightning.membership.store import MembershipStore
from spotnik_lightning.membership.types import TIERS, Member, Membership
from spotnik_lightning.ring.group import RingGroup

log = logging.getLogger("spotnik.backend")

BACKEND_NAME = "spotnik"

__all__ = [
    "BACKEND_NAME",
    "C10dMembershipStore",
    "ProcessGroupSpotnik",
    "Settings",
    "SpotnikWork",
    "register",
]


# --------------------------------------------------------------------------- settings


def _env_ms(env: dict[str, str], key: str) -> timedelta | None:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or int(text) <= 0:
        raise ConfigError(f"{key} must be a positive integer number of milliseconds, got {raw!r}")
    return timedelta(milliseconds=int(text))


@dataclass(frozen=True)
class Settings:
    """The backend's environment, parsed and validated once (:meth:`from_env`)."""

    store_url: str | None = None
    run_id: str | None = None
    host: str | None = None
    tier: str = "transient"
    heartbeat_interval: timedelta | None = None
    heartbeat_timeout: timedelta | None = None
    store_timeout: timedelta = timedelta(seconds=10)
    shutdown_wait: timedelta = timedelta(seconds=10)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        """Read the ``SPOTNIK_*`` keys listed in the module docstring. Raises ConfigError naming the
        key for a malformed value."""
        env = dict(os.environ if env is None else env)
        url = env.get("SPOTNIK_STORE", "").strip() or None
        run_id = env.get("SPOTNIK_RUN_ID", "").strip() or None
        if run_id is not None and "/" in run_id:
            raise ConfigError(f"SPOTNIK_RUN_ID must not contain '/': {run_id!r}")
        host = env.get("SPOTNIK_HOST", "").strip() or None
        tier = env.get("SPOTNIK_TIER", "").strip() or "transient"
        if tier not in TIERS:
            raise ConfigError(f"SPOTNIK_TIER must be one of {TIERS}, got {tier!r}")
        interval = _env_ms(env, "SPOTNIK_HEARTBEAT_MS")
        hb_timeout = _env_ms(env, "SPOTNIK_HEARTBEAT_TIMEOUT_MS")
        store_timeout = _env_ms(env, "SPOTNIK_STORE_TIMEOUT_MS") or timedelta(seconds=10)
        shutdown_wait = _env_ms(env, "SPOTNIK_SHUTDOWN_WAIT_MS") or timedelta(seconds=10)
        settings = cls(url, run_id, host, tier, interval, hb_timeout, store_timeout, shutdown_wait)
        try:
            settings.timeouts(timedelta(minutes=30))
        except ConfigError as exc:
            raise ConfigError(f"SPOTNIK_HEARTBEAT_MS / SPOTNIK_HEARTBEAT_TIMEOUT_MS: {exc}") from None
        return settings

    def timeouts(self, torch_timeout: timedelta | None) -> RingTimeouts:
        """The ring's timeouts: heartbeats from the environment, bootstrap/join/collective from
        torch's process-group ``timeout`` (RingTimeouts defaults where not given)."""
        base = RingTimeouts()
        kw: dict[str, timedelta] = {}
        if self.heartbeat_interval is not None:
            kw["heartbeat_interval"] = self.heartbeat_interval
        if self.heartbeat_timeout is not None:
            kw["heartbeat_timeout"] = self.heartbeat_timeout
        elif self.heartbeat_interval is not None and self.heartbeat_interval >= base.heartbeat_timeout:
            kw["heartbeat_timeout"] = 5 * self.heartbeat_interval
        if isinstance(torch_timeout, timedelta) and torch_timeout > timedelta(0):
            kw.update(bootstrap=torch_timeout, join=torch_timeout, collective=torch_timeout)
        return RingTimeouts(**kw)


# --------------------------------------------------------------------------- c10d store adapter


class C10dMembershipStore(MembershipStore):
    """A :class:`MembershipStore` kept in a torch c10d ``Store`` (TCPStore, FileStore, ...).

    Keys live under ``spotnik/`` in the given (already group-prefixed) store:

    * ``membership``: ``{"nonce", "membership"}``; the epoch CAS is one ``compare_set`` of that value
      (read, check the epoch, swap the exact bytes read; the nonce makes each write unique, so
      exactly one writer wins each epoch);
    * ``reg/<i>``: registration slot ``i`` (1, 2, ...), claimed with ``compare_set(key, "", value)``,
      so the slot number is the registration order; ``reg/id/<member id>`` maps an id to its slot;
      an unregistered slot holds ``{}``;
    * ``aux/<key>``: :meth:`put` / :meth:`get`.

    Registration TTL is approximate: a slot records its member, the TTL and a wall-clock stamp
    (``time.time()``) refreshed by :meth:`keepalive`; it counts as expired when older than its TTL.
    This assumes the workers' clocks agree to well within the TTL (c10d stores have no leases).

    The adapter talks to a clone of the store (its own connection) with its own timeout
    (``timeout``), so a store call is bounded without touching torch's store timeout; every failure
    is raised as BackendConnectionError. A TCPStore client never reconnects, so after a network
    error (``DistNetworkError``: the store's host is gone) every later call fails at once with the
    same error instead of asking the dead connection again (each attempt makes torch log a warning
    with a C++ stack trace). Thread-safe; :meth:`close` does not close torch's store.
    """

    PREFIX = "spotnik/"

    def __init__(self, store: dist.Store, run_id: str, timeout: timedelta = timedelta(seconds=10)) -> None:
        if not run_id or "/" in run_id:
            raise ConfigError(f"run_id must be a non-empty string without '/': {run_id!r}")
        self.run_id = run_id
        self._lock = threading.Lock()
        self._closed = False
        try:
            clone = store.clone()
            clone.set_timeout(timeout)
            self._store = clone
        except (RuntimeError, AttributeError):  # a store without clone(): share torch's (its timeout)
            self._store = store
        self._slots: dict[str, int] = {}
        self._dead: str | None = None  # why the connection is known to be gone

    def __repr__(self) -> str:
        return f"C10dMembershipStore(run_id={self.run_id!r})"

    def _call(self, what: str, fn: Callable[[], object]) -> object:
        """Run one store operation under the lock; the one place store errors are translated."""
        with self._lock:
            if self._closed:
                raise BackendConnectionError(f"c10d membership store: {what} on a closed adapter")
            if self._dead is not None:
                raise BackendConnectionError(f"c10d membership store unreachable during {what} "
                                             f"(run {self.run_id!r}): connection lost earlier: {self._dead}")
            try:
                return fn()
            except (RuntimeError, OSError) as exc:  # DistStoreError/DistNetworkError are RuntimeErrors
                err = BackendConnectionError(
                    f"c10d membership store unreachable during {what} (run {self.run_id!r}): {exc}")
                if isinstance(exc, dist.DistNetworkError):
                    self._dead = f"{exc} (during {what})"
                raise err from exc

    def _key(self, name: str) -> str:
        return self.PREFIX + name

    def _read(self, name: str) -> bytes | None:
        key = self._key(name)
        return self._store.get(key) if self._store.check([key]) else None

    # ---- membership
    def _get_raw(self) -> tuple[bytes, Membership | None]:
        raw = self._read("membership")
        if not raw:
            return b"", None
        return raw, Membership.from_json(json.dumps(json.loads(raw)["membership"]))

    def get_membership(self) -> Membership | None:
        """See base class."""
        return self._call("get_membership", lambda: self._get_raw()[1])  # type: ignore[return-value]

    def cas_membership(self, expected_epoch: int, new: Membership) -> tuple[bool, Membership | None]:
        """See base class."""
        if expected_epoch < 0 or new.epoch != expected_epoch + 1:
            raise ValueError(f"new epoch {new.epoch} must be expected epoch {expected_epoch} + 1")
        mine = json.dumps({"nonce": uuid.uuid4().hex, "membership": json.loads(new.to_json())}).encode()

        def op() -> tuple[bool, Membership | None]:
            while True:
                raw, current = self._get_raw()
                if (current.epoch if current else 0) != expected_epoch:
                    return False, current
                # c10d quirk: compare_set on a *missing* key with a non-empty expected value returns
                # the expected value unchanged; we only pass b"" when the key was missing, and keys
                # are never deleted, so the returned bytes equal ``mine`` iff this call wrote it.
                got = self._store.compare_set(self._key("membership"), raw, mine)
                if got == mine:
                    return True, new
                # someone swapped first: re-read (its epoch can only be higher now)

        return self._call("cas_membership", op)  # type: ignore[return-value]

    # ---- registrations
    def _record(self, member: Member, ttl: float) -> bytes:
        return json.dumps({"member": member.to_dict(), "ttl": ttl, "stamp": time.time()}).encode()

    def register(self, member: Member, ttl: timedelta) -> None:
        """See base class. Re-registering an id keeps its slot (its place in the order)."""
        secs = ttl.total_seconds()
        if secs <= 0:
            raise ConfigError(f"registration ttl must be positive, got {ttl!r}")

        def op() -> None:
            value = self._record(member, secs)
            slot_raw = self._read(f"reg/id/{member.id}")
            if slot_raw:
                slot = int(slot_raw)
                self._store.set(self._key(f"reg/{slot}"), value)
            else:
                slot = 1
                while self._store.compare_set(self._key(f"reg/{slot}"), b"", value) != value:
                    slot += 1
                self._store.set(self._key(f"reg/id/{member.id}"), str(slot))
            self._slots[member.id] = slot

        self._call("register", op)

    def keepalive(self, member_id: str) -> None:
        """See base class. Refreshes the stamp; re-registers a slot that expired (or was
        unregistered) if this adapter registered it."""

        def op() -> None:
            slot = self._slots.get(member_id)
            if slot is None:
                return
            raw = self._read(f"reg/{slot}")
            rec = json.loads(raw) if raw else {}
            if "member" not in rec:
                return
            rec["stamp"] = time.time()
            self._store.set(self._key(f"reg/{slot}"), json.dumps(rec).encode())

        self._call("keepalive", op)

    def unregister(self, member_id: str) -> None:
        """See base class."""

        def op() -> None:
            slot_raw = self._read(f"reg/id/{member_id}")
            self._slots.pop(member_id, None)
            if slot_raw:
                self._store.set(self._key(f"reg/{int(slot_raw)}"), b"{}")

        self._call("unregister", op)

    def registered(self) -> list[Member]:
        """See base class."""

        def op() -> list[Member]:
            out, slot, now = [], 1, time.time()
            while True:
                raw = self._read(f"reg/{slot}")
                if raw is None:
                    return out
                rec = json.loads(raw) if raw else {}
                if "member" in rec and now - float(rec["stamp"]) <= float(rec["ttl"]):
                    out.append(Member.from_dict(rec["member"]))
                slot += 1

        return self._call("registered", op)  # type: ignore[return-value]

    # ---- auxiliary values
    def put(self, key: str, value: str) -> None:
        """See base class."""
        if not key:
            raise ConfigError("aux key must be non-empty")
        self._call("put", lambda: self._store.set(self._key(f"aux/{key}"), value))

    def get(self, key: str) -> str | None:
        """See base class."""

        def op() -> str | None:
            raw = self._read(f"aux/{key}")
            return None if raw is None else raw.decode()

        return self._call("get", op)  # type: ignore[return-value]

    def close(self) -> None:
        """See base class. Later calls raise BackendConnectionError; torch's store stays open."""
        with self._lock:
            self._closed = True


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


# --------------------------------------------------------------------------- work


class SpotnikWork(dist.Work):
    """A finished collective. ``get_future()`` is already completed with the output tensors — even
    when the ring failed (see the module's fault contract); :meth:`wait` raises that failure."""

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


# --------------------------------------------------------------------------- process group

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


class ProcessGroupSpotnik(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on a :class:`RingGroup` (CPU tensors only).

    Built by the backend creator (:func:`register`); owns its ring and closes it in
    :meth:`shutdown`. Collectives are synchronous and must be called SPMD from one thread.
    Supported: allreduce (SUM/AVG/MIN/MAX/PRODUCT), broadcast, allgather, all_gather_single
    (all_gather_into_tensor), reduce_scatter (+ _single / tensor forms), reduce, gather, scatter,
    barrier, monitored_barrier, send/recv (tags ignored; matched in order per peer pair; a send
    returns once the receiver has taken the data, so pairwise exchanges must order send/recv),
    all_to_all_single / alltoall with equal splits, and the ``*_coalesced`` forms (one collective
    per tensor). Others raise NotImplementedError.

    Failure bookkeeping (see the module's fault contract): :attr:`last_error` (most recent ring
    error, kept), :attr:`failed_epochs` (epochs in which a collective failed, ascending, no
    duplicates), :meth:`take_error` (the first failure not yet observed through Work.wait, cleared).
    """

    def __init__(self, ring: RingGroup, torch_rank: int, torch_size: int) -> None:
        # The (store, rank, size) constructor is not alias-aware in torch 2.13 ("pybind11::init():
        # construction failed: returned holder-wrapped instance is not an alias instance").
        super().__init__(torch_rank, torch_size)
        self.ring = ring
        self._rank, self._size = ring.rank, ring.size
        self._group_name = ""
        self._group_desc = ""
        self._err_lock = threading.Lock()
        self.last_error: SpotnikError | None = None
        self.failed_epochs: list[int] = []
        self._pending: SpotnikError | None = None
        self._shut = False

    # ---- identity (virtual in C++: the PyProcessGroup trampoline dispatches here)
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def getRank(self) -> int:  # noqa: N802 - torch's name
        """The ring's current rank of this worker (last known once the ring is closed/fenced)."""
        try:
            self._rank = self.ring.rank
        except KeyError:
            pass
        return self._rank

    def getSize(self) -> int:  # noqa: N802 - torch's name
        """The ring's current size (last known once the ring is closed/fenced)."""
        if not self._shut and self.ring.size:
            self._size = self.ring.size
        return self._size

    def rank(self) -> int:
        return self.getRank()

    def size(self) -> int:
        return self.getSize()

    # The shortcut torch takes for a ProcessGroup returned by a creator registers no per-device
    # backend, and the base class keeps the group name/desc in that backend ("ProcessGroup name not
    # set" on destroy_process_group). Keep them here instead.
    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
        self._group_desc = desc

    # ---- failure bookkeeping
    def take_error(self) -> SpotnikError | None:
        """Return the first ring failure not yet observed through ``Work.wait()`` and forget it
        (None when every collective since the last call succeeded or was waited on)."""
        with self._err_lock:
            err, self._pending = self._pending, None
            return err

    def _observed(self, err: SpotnikError) -> None:
        with self._err_lock:
            if self._pending is err:
                self._pending = None

    def _fail(self, name: str, epoch: int, err: SpotnikError) -> None:
        log.warning("spotnik %s failed at epoch %d (%s): %s", name, epoch, self.ring.member_id, err)
        with self._err_lock:
            self.last_error = err
            if epoch not in self.failed_epochs:
                self.failed_epochs.append(epoch)
                self.failed_epochs.sort()
            if self._pending is None:
                self._pending = err

    def _run(self, name: str, result: list[torch.Tensor], body: Callable[[], None],
             single: bool = False) -> SpotnikWork:
        """Run ``body`` on the ring; record a ring failure instead of raising it (the fault
        contract). ConfigError (bad arguments) and non-spotnik exceptions propagate.

        Unless ``body`` is one ring operation (``single``), an epoch change while it ran counts as
        a failure too: its parts ran on different memberships, or it sliced by a stale rank.
        """
        if self._shut:
            raise ConfigError(f"{name} on a spotnik process group that was shut down")
        epoch = self.ring.epoch
        try:
            body()
        except ConfigError:
            raise
        except SpotnikError as exc:
            self._fail(name, epoch, exc)
            return SpotnikWork(self, name, result, exc)
        if not single and self.ring.epoch != epoch:
            err = MembershipChanged(epoch, self.ring.epoch, f"membership changed during {name}")
            self._fail(name, epoch, err)
            return SpotnikWork(self, name, result, err)
        return SpotnikWork(self, name, result)

    # ---- collectives
    def allreduce(self, tensors: torch.Tensor | list[torch.Tensor], opts: object = None) -> SpotnikWork:
        """In-place all-reduce of each tensor (``opts.reduceOp``, default SUM)."""
        tensors = _as_list(tensors)
        _cpu(tensors, "allreduce")
        op = _reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM))

        def body() -> None:
            for t in tensors:
                self._all_reduce(t, op)

        return self._run("allreduce", tensors, body, single=len(tensors) == 1)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> SpotnikWork:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: torch.Tensor | list[torch.Tensor], opts: object = None) -> SpotnikWork:
        """Overwrite each tensor with rank ``opts.rootRank``'s."""
        tensors = _as_list(tensors)
        _cpu(tensors, "broadcast")
        root = int(_opt(opts, "rootRank", 0))  # type: ignore[arg-type]
        self._check_rank(root, "broadcast")

        def body() -> None:
            for t in tensors:
                self._broadcast(t, root)

        return self._run("broadcast", tensors, body, single=len(tensors) == 1)

    def _gather_flat(self, inp: torch.Tensor) -> torch.Tensor:
        """Every member's ``inp`` (flattened), concatenated in rank order."""
        flat = torch.empty(self.ring.size * inp.numel(), dtype=inp.dtype)
        self._all_gather(flat, inp)
        return flat

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: object = None) -> SpotnikWork:
        """``output_lists[i][r]`` receives rank r's ``inputs[i]``."""
        inputs = _as_list(inputs)
        _cpu(inputs, "allgather")
        n = self.ring.size
        for outs, inp in zip(output_lists, inputs, strict=True):
            _cpu(outs, "allgather")
            if len(outs) != n or any(o.numel() != inp.numel() or o.dtype != inp.dtype for o in outs):
                raise ConfigError(f"allgather: need {n} output tensors of {inp.numel()} {inp.dtype} elements, "
                                  f"got {[(o.numel(), o.dtype) for o in outs]}")

        def body() -> None:
            for outs, inp in zip(output_lists, inputs, strict=True):
                flat = self._gather_flat(inp)
                for r, o in enumerate(outs):
                    o.copy_(flat[r * inp.numel():(r + 1) * inp.numel()].view(o.shape))

        return self._run("allgather", [o for outs in output_lists for o in outs], body)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: object = None) -> SpotnikWork:
        """``output_lists[r][j]`` receives rank r's ``inputs[j]``."""
        per_input = [[output_lists[r][j] for r in range(len(output_lists))] for j in range(len(inputs))]
        return self.allgather(per_input, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: object = None) -> SpotnikWork:
        """``output`` (size x ``inp.numel()`` elements) receives every rank's ``inp`` in rank order."""
        _cpu([output, inp], "all_gather_into_tensor")
        return self._run("all_gather_into_tensor", [output], lambda: self._all_gather(output, inp), single=True)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: object = None) -> SpotnikWork:
        _cpu(list(outputs) + list(inputs), "all_gather_into_tensor_coalesced")

        def body() -> None:
            for o, i in zip(outputs, inputs, strict=True):
                self._all_gather(o, i)

        return self._run("all_gather_into_tensor_coalesced", list(outputs), body)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _reduce_scatter_one(self, output: torch.Tensor, flat_input: torch.Tensor, op: str) -> None:
        n, rank = self.ring.size, self.ring.rank
        if flat_input.numel() != n * output.numel():
            raise ConfigError(f"reduce_scatter: input must hold {n} x {output.numel()} elements, "
                              f"got {flat_input.numel()}")
        self._all_reduce(flat_input, op)
        output.copy_(flat_input[rank * output.numel():(rank + 1) * output.numel()].view(output.shape))

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: object = None) -> SpotnikWork:
        """``outputs[i]`` receives the reduction over ranks of ``input_lists[i][my rank]``
        (an all-reduce of the concatenated inputs, then this rank's slice)."""
        outputs = _as_list(outputs)
        _cpu(outputs + [t for lst in input_lists for t in lst], "reduce_scatter")
        op = _reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM))

        def body() -> None:
            for out, lst in zip(outputs, input_lists, strict=True):
                if len(lst) != self.ring.size:
                    raise ConfigError(f"reduce_scatter: need {self.ring.size} input tensors, got {len(lst)}")
                self._reduce_scatter_one(out, torch.cat([t.reshape(-1) for t in lst]), op)

        return self._run("reduce_scatter", outputs, body)

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts: object = None) -> SpotnikWork:
        """``output`` receives this rank's slice of the reduction of ``inp`` (size x output elements)."""
        _cpu([output, inp], "reduce_scatter_tensor")
        op = _reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        return self._run("reduce_scatter_tensor", [output],
                         lambda: self._reduce_scatter_one(output, inp.reshape(-1).clone(), op))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: object = None) -> SpotnikWork:
        _cpu(list(outputs) + list(inputs), "reduce_scatter_tensor_coalesced")
        op = _reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM))

        def body() -> None:
            for o, i in zip(outputs, inputs, strict=True):
                self._reduce_scatter_one(o, i.reshape(-1).clone(), op)

        return self._run("reduce_scatter_tensor_coalesced", list(outputs), body)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors: list[torch.Tensor], opts: object = None) -> SpotnikWork:
        """Rank ``opts.rootRank`` receives the reduction; the other ranks' tensors are unchanged."""
        tensors = _as_list(tensors)
        _cpu(tensors, "reduce")
        op = _reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        root = int(_opt(opts, "rootRank", 0))  # type: ignore[arg-type]
        self._check_rank(root, "reduce")

        def body() -> None:
            for t in tensors:
                self._all_reduce(t if self.ring.rank == root else t.clone(), op)

        return self._run("reduce", tensors, body)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: object = None) -> SpotnikWork:
        """On rank ``opts.rootRank``, ``output_lists[0][r]`` receives rank r's ``inputs[0]``."""
        inputs = _as_list(inputs)
        _cpu(inputs, "gather")
        root = int(_opt(opts, "rootRank", 0))  # type: ignore[arg-type]
        self._check_rank(root, "gather")

        def body() -> None:
            for j, inp in enumerate(inputs):
                flat = self._gather_flat(inp)
                if self.ring.rank == root:
                    for r, o in enumerate(output_lists[j]):
                        o.copy_(flat[r * inp.numel():(r + 1) * inp.numel()].view(o.shape))

        return self._run("gather", [o for outs in output_lists for o in outs], body)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                opts: object = None) -> SpotnikWork:
        """``outputs[0]`` receives ``input_lists[0][my rank]`` of rank ``opts.rootRank`` (a broadcast
        of the concatenated inputs, then this rank's slice)."""
        outputs = _as_list(outputs)
        _cpu(outputs, "scatter")
        root = int(_opt(opts, "rootRank", 0))  # type: ignore[arg-type]
        self._check_rank(root, "scatter")

        def body() -> None:
            for j, out in enumerate(outputs):
                n, rank, k = self.ring.size, self.ring.rank, out.numel()
                if rank == root:
                    buf = torch.cat([t.reshape(-1) for t in input_lists[j]])
                else:
                    buf = torch.empty(n * k, dtype=out.dtype)
                self._broadcast(buf, root)
                out.copy_(buf[rank * k:(rank + 1) * k].view(out.shape))

        return self._run("scatter", outputs, body)

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: object = None) -> SpotnikWork:
        """Equal splits only: chunk r of ``inp`` goes to rank r; ``output`` chunk r comes from rank r
        (through an all-gather of the inputs, i.e. size x the traffic of a true all-to-all)."""
        _cpu([output, inp], "all_to_all_single")
        n = self.ring.size
        for splits in (output_split_sizes, input_split_sizes):
            if splits and len(set(splits)) != 1:
                raise NotImplementedError("the spotnik backend supports all_to_all_single with equal splits only")
        if inp.numel() != output.numel() or inp.numel() % n:
            raise ConfigError(f"all_to_all_single: input and output must hold the same multiple of {n} elements")

        def body() -> None:
            k = inp.numel() // n
            flat = self._gather_flat(inp).view(n, n, k)  # [source rank, destination rank, k]
            output.copy_(flat[:, self.ring.rank, :].reshape(output.shape))

        return self._run("all_to_all_single", [output], body)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: object = None) -> SpotnikWork:
        """``outputs[r]`` receives rank r's ``inputs[my rank]`` (equal sizes only)."""
        _cpu(list(outputs) + list(inputs), "alltoall")
        n = self.ring.size
        if len(inputs) != n or len(outputs) != n or len({t.numel() for t in list(inputs) + list(outputs)}) != 1:
            raise NotImplementedError("the spotnik backend supports alltoall of equally sized tensors only")

        def body() -> None:
            k = inputs[0].numel()
            flat = self._gather_flat(torch.cat([t.reshape(-1) for t in inputs])).view(n, n, k)
            for r, o in enumerate(outputs):
                o.copy_(flat[r, self.ring.rank].view(o.shape))

        return self._run("alltoall", list(outputs), body)

    def barrier(self, opts: object = None) -> SpotnikWork:
        """Complete once every member entered the barrier."""
        return self._run("barrier", [], self.ring.barrier, single=True)

    def monitored_barrier(self, opts: object = None, wait_all_ranks: bool = False) -> None:
        """A plain barrier that raises the ring error (if any) at once."""
        self.barrier(opts).wait()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> SpotnikWork:
        """Deliver each tensor to rank ``dst`` (tags are ignored: messages match in order)."""
        tensors = _as_list(tensors)
        _cpu(tensors, "send")
        self._check_rank(dst, "send")

        def body() -> None:
            for t in tensors:
                self._send(t, dst)

        return self._run("send", tensors, body, single=len(tensors) == 1)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> SpotnikWork:
        """Fill each tensor with what rank ``src`` sends."""
        tensors = _as_list(tensors)
        _cpu(tensors, "recv")
        self._check_rank(src, "recv")

        def body() -> None:
            for t in tensors:
                self._recv(t, src)

        return self._run("recv", tensors, body, single=len(tensors) == 1)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> SpotnikWork:
        raise NotImplementedError("the spotnik backend does not support recv from any source")

    # ---- ring calls on dense memory (results copied back into non-dense tensors)
    def _all_reduce(self, t: torch.Tensor, op: str) -> None:
        w = _dense(t)
        self.ring.all_reduce(w, op)
        if w is not t:
            t.copy_(w)

    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        w = _dense(t)
        self.ring.broadcast(w, root)
        if w is not t:
            t.copy_(w)

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        w = _dense(out)
        self.ring.all_gather(w, _dense(inp))
        if w is not out:
            out.copy_(w)

    def _send(self, t: torch.Tensor, dst: int) -> None:
        self.ring.send(_dense(t), dst)

    def _recv(self, t: torch.Tensor, src: int) -> None:
        w = _dense(t)
        self.ring.recv(w, src)
        if w is not t:
            t.copy_(w)

    def _check_rank(self, r: int, what: str) -> None:
        if not 0 <= r < self.ring.size:
            raise ConfigError(
                f"{what}: rank {r} out of range for world size {self.ring.size} (epoch {self.ring.epoch})")

    # ---- teardown
    def shutdown(self) -> None:
        """Close the ring and stop its threads (idempotent). Called by destroy_process_group."""
        if self._shut:
            return
        self._rank, self._size = self.getRank(), self.getSize()
        self._shut = True
        _close_ring(self.ring)

    def abort(self) -> None:
        """Same as :meth:`shutdown`."""
        self.shutdown()


# --------------------------------------------------------------------------- creator


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
