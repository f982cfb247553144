"""The etcd v3 membership store (client library: ``pyetcd`` from etcd-sdk-python, else ``etcd3``).

Key layout, readable with ``etcdctl get --prefix /spotnik/<run_id>/``::

    /spotnik/<run_id>/epoch                   current epoch, decimal string ("7"); absent before epoch 1
    /spotnik/<run_id>/membership              Membership.to_json() of the current epoch
    /spotnik/<run_id>/history/0000000007      Membership.to_json() of every committed epoch (10 digits)
    /spotnik/<run_id>/members/<member_id>     Member json {"host","id","port","tier"}, on a lease of the ttl
    /spotnik/<run_id>/aux/<key>               auxiliary run-scoped values

The epoch CAS is one etcd transaction: compare ``version(epoch) == 0`` (expected epoch 0) or
``value(epoch) == str(expected)``; on success put epoch, membership and history; on failure read
membership in the same transaction, so the loser sees the winner atomically.

The client library (and grpc) is imported when the first EtcdStore is built, so importing this
module needs neither.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import threading
from collections.abc import Callable
from datetime import timedelta
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

from spotnik_lightning.api import BackendConnectionError, ConfigError, _positive
from spotnik_lightning.membership.store import MembershipStore
from spotnik_lightning.membership.types import Member, Membership

log = logging.getLogger("spotnik.store")
T = TypeVar("T")

# grpc's default reconnect backoff grows to 120 s while etcd is down, and every call fails fast
# with UNAVAILABLE until the next attempt, even once etcd is back. Keep it short.
_GRPC_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 300)]
# grpc status names after which the next endpoint is tried (the endpoint, not the request, failed).
_FAILOVER_CODES = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL"}


def _load_client() -> tuple[ModuleType, ModuleType]:
    """(etcd client module, grpc). Raises ConfigError naming what to install."""
    for name in ("pyetcd", "etcd3"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        import grpc

        return mod, grpc
    raise ConfigError(
        "the etcd membership store needs an etcd v3 client library: "
        "pip install etcd-sdk-python (module pyetcd), or pip install etcd3"
    )


class _Lease(NamedTuple):
    lease_id: int
    member: Member
    ttl: int


class EtcdStore(MembershipStore):
    """MembershipStore on an etcd v3 cluster, for one run.

    ``endpoints`` are tried in order: a call that cannot reach one endpoint fails over to the next,
    and the endpoint that answered is tried first next time. Each RPC is bounded by ``timeout``; a
    call makes at most three RPCs per endpoint tried. Every transport error becomes a
    BackendConnectionError naming the endpoints and the operation, with the cause chained.
    An RPC that timed out may still have been applied: a CAS retried after such a failure reports
    ``(False, current)`` even when ``current`` is its own write.
    """

    def __init__(
        self, endpoints: list[tuple[str, int]], run_id: str, timeout: timedelta = timedelta(seconds=5)
    ) -> None:
        if not endpoints:
            raise ConfigError("EtcdStore needs at least one endpoint")
        if not isinstance(run_id, str) or not run_id or "/" in run_id:
            raise ConfigError(f"run_id must be a non-empty string without '/': {run_id!r}")
        self.run_id = run_id
        self.timeout = _positive("store timeout", timeout)
        self.endpoints = [(str(h), int(p)) for h, p in endpoints]
        self._mod, self._grpc = _load_client()
        self._clients = [
            self._mod.MultiEndpointEtcd3Client(
                [self._mod.Endpoint(h, p, secure=False, time_retry=0.0, opts=_GRPC_OPTIONS)],
                timeout=self.timeout.total_seconds(),
            )
            for h, p in self.endpoints
        ]
        self._prefix = f"/spotnik/{run_id}/"
        self._lock = threading.Lock()
        self._preferred = 0
        self._leases: dict[str, _Lease] = {}
        self._closed = False

    def __repr__(self) -> str:
        eps = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"EtcdStore({eps}, run_id={self.run_id!r})"

    # ------------------------------------------------------------------ the error boundary

    def _describe(self, exc: BaseException) -> str:
        """The grpc status behind ``exc`` (pyetcd hides it in __context__), else its repr."""
        for e in (exc, exc.__context__):
            if isinstance(e, self._grpc.RpcError) and callable(getattr(e, "code", None)):
                return f"{e.code().name}: {e.details()}"
        return repr(exc)

    def _is_endpoint_failure(self, exc: BaseException) -> bool:
        ex = self._mod.exceptions
        failover = (ex.ConnectionFailedError, ex.ConnectionTimeoutError, ex.InternalServerError)
        if isinstance(exc, failover + (ex.NoServerAvailableError,)):
            return True
        code = getattr(exc, "code", None) if isinstance(exc, self._grpc.RpcError) else None
        return callable(code) and getattr(code(), "name", "") in _FAILOVER_CODES

    def _call(self, op: str, fn: Callable[[Any], T]) -> T:
        """Run ``fn(client)`` on the preferred endpoint, failing over in order on transport errors.

        The only place client-library errors are caught. Raises BackendConnectionError (cause
        chained) when every endpoint failed, or at once when an endpoint answered with an error.
        """
        if self._closed:
            raise BackendConnectionError(f"etcd store: {op} on a closed client (run {self.run_id!r})")
        with self._lock:
            start = self._preferred
        failures: list[str] = []
        last: BaseException | None = None
        n = len(self._clients)
        for i in range(n):
            idx = (start + i) % n
            host, port = self.endpoints[idx]
            try:
                result = fn(self._clients[idx])
            except (self._mod.exceptions.Etcd3Exception, self._grpc.RpcError) as exc:
                if not self._is_endpoint_failure(exc):
                    raise BackendConnectionError(
                        f"etcd store {host}:{port} answered {op} with an error "
                        f"(run {self.run_id!r}): {self._describe(exc)}"
                    ) from exc
                failures.append(f"{host}:{port}: {self._describe(exc)}")
                last = exc
                continue
            if i:
                with self._lock:
                    self._preferred = idx
                log.info("etcd store: failed over to %s:%d for %s", host, port, op)
            return result
        raise BackendConnectionError(
            f"etcd store unreachable during {op} (run {self.run_id!r}, timeout "
            f"{self.timeout.total_seconds():g} s per RPC): " + "; ".join(failures)
        ) from last

    def _revoke_quietly(self, client: Any, lease_id: int) -> None:
        """Revoke ``lease_id``; a lease that is already gone is fine."""
        try:
            client.revoke_lease(lease_id)
        except self._grpc.RpcError as exc:
            if exc.code() != self._grpc.StatusCode.NOT_FOUND:
                raise

    # ------------------------------------------------------------------ keys

    def _key(self, *parts: str) -> str:
        return self._prefix + "/".join(parts)

    # ------------------------------------------------------------------ MembershipStore

    def get_membership(self) -> Membership | None:
        """See base class."""
        value, _ = self._call("get_membership", lambda c: c.get(self._key("membership")))
        return None if value is None else Membership.from_json(value)

    def cas_membership(self, expected_epoch: int, new: Membership) -> tuple[bool, Membership | None]:
        """See base class. One etcd transaction; raises ValueError before any RPC if ``new.epoch``
        is not ``expected_epoch + 1``."""
        if expected_epoch < 0 or new.epoch != expected_epoch + 1:
            raise ValueError(f"new epoch {new.epoch} must be expected epoch {expected_epoch} + 1")
        epoch_key, text = self._key("epoch"), new.to_json()

        def txn(c: Any) -> tuple[bool, list]:
            t = c.transactions
            compare = (
                t.version(epoch_key) == 0
                if expected_epoch == 0
                else t.value(epoch_key) == str(expected_epoch)
            )
            return c.transaction(
                compare=[compare],
                success=[
                    t.put(epoch_key, str(new.epoch)),
                    t.put(self._key("membership"), text),
                    t.put(self._key("history", f"{new.epoch:010d}"), text),
                ],
                failure=[t.get(self._key("membership"))],
            )

        won, responses = self._call("cas_membership", txn)
        if won:
            return True, new
        kvs = responses[0] if responses else []
        return False, Membership.from_json(kvs[0][0]) if kvs else None

    def register(self, member: Member, ttl: timedelta) -> None:
        """See base class. ``ttl`` is rounded up to whole seconds; etcd may raise it to its
        minimum lease TTL (about 1.5 x the election timeout)."""
        secs = max(1, math.ceil(_positive("registration ttl", ttl).total_seconds()))
        with self._lock:
            old = self._leases.get(member.id)

        def fn(c: Any) -> int:
            lease = c.lease(secs)
            # A put keeps the key's create_revision, i.e. its place in registration order.
            c.put(
                self._key("members", member.id), json.dumps(member.to_dict(), sort_keys=True), lease=lease.id
            )
            if old is not None:
                self._revoke_quietly(c, old.lease_id)  # the key moved to the new lease
            return lease.id

        lease_id = self._call("register", fn)
        with self._lock:
            self._leases[member.id] = _Lease(lease_id, member, secs)

    def keepalive(self, member_id: str) -> None:
        """See base class. If the lease of a member this client registered is gone (expired while
        etcd was unreachable, or etcd lost it), the member is registered again on a new lease, at
        the end of the registration order."""
        with self._lock:
            mine = self._leases.get(member_id)
        key = self._key("members", member_id)

        def fn(c: Any) -> int | None:
            lease_id = mine.lease_id if mine is not None else None
            if lease_id is None:  # registered by another client: refresh the lease it used
                value, meta = c.get(key)
                if value is None or not meta.lease_id:
                    return None
                lease_id = meta.lease_id
            answers = list(c.refresh_lease(lease_id))
            if (answers and answers[0].TTL > 0) or mine is None:
                return None  # alive (TTL 0 means etcd does not know the lease)
            lease = c.lease(mine.ttl)
            c.put(key, json.dumps(mine.member.to_dict(), sort_keys=True), lease=lease.id)
            return lease.id

        new_id = self._call("keepalive", fn)
        if new_id is not None and mine is not None:
            with self._lock:
                if self._leases.get(member_id) is mine:
                    self._leases[member_id] = mine._replace(lease_id=new_id)
            log.info("etcd store: re-registered %s in run %s (its lease was gone)", member_id, self.run_id)

    def unregister(self, member_id: str) -> None:
        """See base class. Deletes the key and revokes the lease this client holds for it."""
        with self._lock:
            mine = self._leases.pop(member_id, None)

        def fn(c: Any) -> None:
            c.delete(self._key("members", member_id))
            if mine is not None:
                self._revoke_quietly(c, mine.lease_id)

        self._call("unregister", fn)

    def registered(self) -> list[Member]:
        """See base class. Order is the keys' create revision; undecodable records are skipped."""
        rows = self._call(
            "registered",
            lambda c: list(c.get_prefix(self._key("members", ""), sort_order="ascend", sort_target="create")),
        )
        out = []
        for value, meta in rows:
            try:
                out.append(Member.from_dict(json.loads(value)))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("etcd store: skipping undecodable registration %r: %s", meta.key, exc)
        return out

    def watch_registrations(self, callback: Callable[[Member], None]) -> Callable[[], None] | None:
        """See base class. An etcd watch on ``members/``: put events become ``callback(member)``.
        If the watch stream breaks (etcd restarted) it is not re-established; joiners still reach
        the leader directly."""
        prefix = self._key("members", "")
        put_event = self._mod.events.PutEvent

        def on_response(resp: Any) -> None:
            for ev in getattr(resp, "events", None) or ():  # an exception instead: watch ended
                if not isinstance(ev, put_event):
                    continue
                try:
                    callback(Member.from_dict(json.loads(ev.value)))
                except (KeyError, TypeError, ValueError) as exc:
                    log.warning("etcd store: skipping undecodable registration event: %s", exc)

        with self._lock:
            idx = self._preferred
        watch_id = self._call("watch_registrations", lambda c: c.add_watch_prefix_callback(prefix, on_response))
        client = self._clients[idx]

        def cancel() -> None:
            try:
                client.cancel_watch(watch_id)
            except Exception as exc:  # the channel may be closed already; nothing left to cancel
                log.debug("etcd store: cancel_watch failed: %s", exc)

        return cancel

    def put(self, key: str, value: str) -> None:
        """See base class."""
        if not key:
            raise ConfigError("aux key must be non-empty")
        self._call("put", lambda c: c.put(self._key("aux", key), value))

    def get(self, key: str) -> str | None:
        """See base class."""
        value, _ = self._call("get", lambda c: c.get(self._key("aux", key)))
        return None if value is None else value.decode()

    def close(self) -> None:
        """See base class. Closes the grpc channels; later calls raise BackendConnectionError.

        Leases are left to expire (a closed client is usually a worker that is going away).
        """
        if self._closed:
            return
        self._closed = True
        for c in self._clients:
            c.close()
