"""The ``spotnik`` torchrun rendezvous handler: survivors are never restarted, joiners join in place.

torchrun's agent restarts every local worker whenever ``num_nodes_waiting() > 0`` and re-forms the
whole world in ``next_rendezvous``. This handler keeps torchrun out of membership altogether:

* each agent is its own torchrun "world" (rank 0 of 1, a private in-process store), so
  ``next_rendezvous`` returns at once after the first call and ``num_nodes_waiting`` is always 0;
* the first call waits (bounded) until MIN nodes are registered, or the ring already runs (a join);
  it refuses a node beyond MAX;
* workers learn where the ring's membership lives from ``SPOTNIK_*`` variables put into the agent's
  environment (see :meth:`RdzvConfig.worker_env`); the ring then handles every loss and join.

Agents register a node record (with a lease) under run id ``<run>.nodes`` — not in the run's own
keyspace, whose registrations are ring members. Before any worker starts, the creator checks that
the store answers and that this node's secret matches the run's (an HMAC fingerprint, never the
secret itself, is kept in the store), so a bad host fails without starting anything.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from spotnik_lightning.api import BackendConnectionError
from spotnik_lightning.elastic.config import NODES_SUFFIX, RdzvConfig
from spotnik_lightning.membership import EmbeddedStoreServer, MembershipStore, open_store
from spotnik_lightning.membership.types import Member
from spotnik_lightning.ring import wire

log = logging.getLogger("spotnik.torchrun")

BACKEND = "spotnik"
T = TypeVar("T")
_FINGERPRINT_KEY = "secret_fingerprint"
_CLOSED_KEY = "closed"


def fingerprint(secret: bytes, run_id: str) -> str:
    """A value that proves knowledge of ``secret`` for ``run_id`` without revealing it."""
    return hmac.new(secret, b"spotnik-torchrun-check\x00" + run_id.encode(), hashlib.sha256).hexdigest()


def _route_address(store_url: str) -> str:
    """The local address the kernel would use to reach the store's first endpoint."""
    rest = store_url.partition("://")[2].split(",")[0]
    host = rest.rpartition(":")[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class SpotnikRendezvousHandler(RendezvousHandler):
    """One agent's view of a spotnik run. Build with :func:`create_handler`.

    Thread-safety: called from the agent's main thread; owns one keepalive thread after the first
    :meth:`next_rendezvous`, stopped by :meth:`shutdown`.
    """

    def __init__(self, cfg: RdzvConfig, run_store: MembershipStore, node_store: MembershipStore,
                 server: EmbeddedStoreServer | None, host: str) -> None:
        self.cfg, self._run_store, self._nodes = cfg, run_store, node_store
        self._server = server
        self.host = host
        self.node_id = f"{host}-{os.getpid()}-{secrets.token_hex(2)}"
        self._store = HashStore()
        self._info: RendezvousInfo | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shut = False

    # ------------------------------------------------------------------ RendezvousHandler
    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self.cfg.run_id

    @property
    def use_agent_store(self) -> bool:
        return False

    def num_nodes_waiting(self) -> int:
        """Always 0: joiners are admitted by the ring, so torchrun never restarts survivors."""
        return 0

    def is_closed(self) -> bool:
        """Whether someone called :meth:`set_closed` for this run (eventually consistent)."""
        try:
            return self._nodes.get(_CLOSED_KEY) == "1"
        except BackendConnectionError:
            return False

    def set_closed(self) -> None:
        """Mark the run closed: later agents' :meth:`next_rendezvous` raise RendezvousClosedError.
        Running workers are not affected."""
        self._call("close the run", lambda: self._nodes.put(_CLOSED_KEY, "1"))

    def next_rendezvous(self) -> RendezvousInfo:
        """First call: export the worker environment, register this node and block until MIN nodes
        are registered or the ring already runs (bounded by ``timeout``); later calls (torchrun
        restarting this node's workers after a local crash) return at once.

        Returns rank 0 of world 1 with a private store: torchrun's ranks are local; the ring owns
        membership. Raises RendezvousClosedError (run closed), RendezvousConnectionError (store
        unreachable), RendezvousStateError (the run id names a dead run: a membership but no live
        member), RendezvousTimeoutError (MIN nodes never came, or no slot below MAX freed).
        """
        if self._info is not None:
            os.environ.update(self.cfg.worker_env(self.host, self.node_id))
            log.info("spotnik rendezvous: restarting the workers of node %s; they rejoin the ring in place",
                     self.node_id)
            return self._info
        if self.is_closed():
            raise RendezvousClosedError(f"spotnik run {self.cfg.run_id!r} is closed")
        info = RendezvousStoreInfo.build(0, self._store, self.host)
        me = Member(self.node_id, self.host, info.master_port, self.cfg.tier)
        self._call("register this node", lambda: self._nodes.register(me, self.cfg.node_ttl))
        try:
            self._wait_for_start()
        except BaseException:
            self._unregister()
            raise
        os.environ.update(self.cfg.worker_env(self.host, self.node_id))
        self._info = RendezvousInfo(self._store, 0, 1, info)
        self._thread = threading.Thread(target=self._keepalive, name="spotnik-rdzv-keepalive", daemon=True)
        self._thread.start()
        return self._info

    def shutdown(self) -> bool:
        """Stop the keepalive thread, unregister this node and close the stores (idempotent).

        The agent hosting the embedded store keeps serving, bounded by ``timeout``, until no other
        node is registered: its loss would cost the rest of the run its joins and repairs.
        """
        if self._shut:
            return True
        self._shut = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._unregister()
        if self._server is not None:
            deadline = time.monotonic() + self.cfg.wait_timeout.total_seconds()
            while time.monotonic() < deadline:
                try:
                    if not self._nodes.registered():
                        break
                except BackendConnectionError:
                    break
                time.sleep(0.2)
        for store in (self._run_store, self._nodes):
            store.close()
        if self._server is not None:
            self._server.stop()
        return True

    # ------------------------------------------------------------------ internals
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run a store call; translate BackendConnectionError into RendezvousConnectionError."""
        try:
            return fn()
        except BackendConnectionError as exc:
            raise RendezvousConnectionError(
                f"spotnik rendezvous: cannot {what} (run {self.cfg.run_id!r}, store {self.cfg.store_url}): {exc}"
            ) from exc

    def _unregister(self) -> None:
        try:
            self._nodes.unregister(self.node_id)
        except BackendConnectionError as exc:
            log.debug("unregister of node %s failed: %s", self.node_id, exc)

    def _wait_for_start(self) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.wait_timeout.total_seconds()
        next_keepalive = time.monotonic() + cfg.node_ttl.total_seconds() / 3
        while True:
            if time.monotonic() >= next_keepalive:  # the wait can outlast the node's lease
                self._call("refresh this node's lease", lambda: self._nodes.keepalive(self.node_id))
                next_keepalive = time.monotonic() + cfg.node_ttl.total_seconds() / 3
            nodes = [m.id for m in self._call("list nodes", self._nodes.registered)]
            membership = self._call("read the membership", self._run_store.get_membership)
            slot = nodes.index(self.node_id) if self.node_id in nodes else len(nodes)
            running = membership is not None and membership.epoch > 0
            if running and not self._call("list ring members", self._run_store.registered):
                raise RendezvousStateError(
                    f"spotnik run {cfg.run_id!r} has a membership at epoch {membership.epoch} but no live worker: "
                    f"it is a finished or dead run; start the job with a new --rdzv-id")
            if slot < cfg.max_nodes and (running or len(nodes) >= cfg.min_nodes):
                log.info("spotnik rendezvous: node %s %s run %r (%d node(s) registered, MIN %d, MAX %d)",
                         self.node_id, "joins the running" if running else "founds", cfg.run_id, len(nodes),
                         cfg.min_nodes, cfg.max_nodes)
                return
            if time.monotonic() >= deadline:
                if slot >= cfg.max_nodes:
                    raise RendezvousTimeoutError(
                        f"spotnik run {cfg.run_id!r} already has MAX={cfg.max_nodes} nodes and none left within "
                        f"{cfg.wait_timeout.total_seconds():g} s; this node ({self.node_id}) is not admitted")
                raise RendezvousTimeoutError(
                    f"spotnik run {cfg.run_id!r}: only {len(nodes)} of MIN={cfg.min_nodes} nodes registered at "
                    f"{cfg.store_url} within {cfg.wait_timeout.total_seconds():g} s and no ring is running; "
                    f"check that every host passes the same --rdzv-id and --rdzv-endpoint")
            time.sleep(0.1)

    def _keepalive(self) -> None:
        period = max(0.2, self.cfg.node_ttl.total_seconds() / 3)
        last = (-1, -1)
        while not self._stop.wait(period):
            try:
                self._nodes.keepalive(self.node_id)
                n_nodes = len(self._nodes.registered())
                m = self._run_store.get_membership()
            except BackendConnectionError as exc:
                log.warning("spotnik rendezvous: store unreachable from node %s: %s", self.node_id, exc)
                continue
            now = (m.epoch if m else 0, n_nodes)
            if now != last:
                last = now
                log.info("spotnik rendezvous: run %r epoch %d, %d worker(s), %d node(s)", self.cfg.run_id, now[0],
                         m.size if m else 0, n_nodes)
                if m is not None and n_nodes < self.cfg.min_nodes:
                    log.warning("spotnik rendezvous: %d node(s) left, below MIN=%d: the survivors keep training; "
                                "nodes that start now join in place (up to MAX=%d)", n_nodes, self.cfg.min_nodes,
                                self.cfg.max_nodes)


def _host_embedded(cfg: RdzvConfig) -> EmbeddedStoreServer | None:
    """Start the embedded store on its endpoint if this machine owns the address and the port is
    free (the first agent there hosts it, as c10d's store does); None otherwise."""
    assert cfg.embedded is not None
    server = EmbeddedStoreServer(*cfg.embedded)
    try:
        server.start()
    except OSError as exc:
        log.debug("not hosting the embedded store at %s:%d: %s", *cfg.embedded, exc)
        return None
    log.info("spotnik rendezvous: this agent hosts the embedded store at %s", cfg.store_url)
    return server


def create_handler(params: RendezvousParameters) -> SpotnikRendezvousHandler:
    """torchrun's creator for ``--rdzv-backend=spotnik``.

    Validates the parameters, hosts the embedded store when it is ours to host, checks that the
    store answers and that this node's secret matches the run's. Raises ConfigError (a ValueError)
    for bad input and RendezvousConnectionError / RendezvousStateError otherwise — always before
    any worker is started.
    """
    cfg = RdzvConfig.parse(params.endpoint, params.run_id, params.min_nodes, params.max_nodes,
                           dict(params.config), local_addr=params.local_addr)
    server = _host_embedded(cfg) if cfg.embedded is not None else None
    run_store = node_store = None
    try:
        run_store = open_store(cfg.store_url, cfg.run_id, cfg.store_timeout)
        node_store = open_store(cfg.store_url, cfg.run_id + NODES_SUFFIX, cfg.store_timeout)
        host = cfg.host or _route_address(cfg.store_url)
        handler = SpotnikRendezvousHandler(cfg, run_store, node_store, server, host)
        mine = fingerprint(wire.load_secret(cfg.secret), cfg.run_id)
        stored = handler._call("read the run's secret fingerprint", lambda: node_store.get(_FINGERPRINT_KEY))
        if stored is None:
            handler._call("store the secret fingerprint", lambda: node_store.put(_FINGERPRINT_KEY, mine))
            stored = handler._call("read the run's secret fingerprint", lambda: node_store.get(_FINGERPRINT_KEY))
        if stored != mine:
            raise RendezvousStateError(
                f"spotnik run {cfg.run_id!r}: this node's job secret (from {cfg.secret_source}) differs from the "
                f"one the run was started with; give every host the same secret_file / secret_env")
        return handler
    except BaseException:
        for store in (run_store, node_store):
            if store is not None:
                store.close()
        if server is not None:
            server.stop()
        raise


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: a zero-argument factory returning the creator."""
    return create_handler


__all__ = ["BACKEND", "SpotnikRendezvousHandler", "create_handler", "fingerprint", "handler_factory"]
