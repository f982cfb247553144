"""A :class:`MembershipStore` kept in a torch c10d ``Store``: :class:`C10dMembershipStore`.

The spotnik torch.distributed backend (:mod:`spotnik_lightning.ring.backend`) uses it when no
``SPOTNIK_STORE`` is configured, so the ring bootstraps through the store ``init_process_group`` /
``torchrun`` already set up. This module imports ``torch.distributed``; the membership package does
not import it (import it by module path).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from spotnik_lightning.api import BackendConnectionError, ConfigError
from spotnik_lightning.membership.store import MembershipStore
from spotnik_lightning.membership.types import Member, Membership

__all__ = ["C10dMembershipStore"]


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
