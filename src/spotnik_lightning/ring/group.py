"""RingGroup: the one object the layers above talk to.

It owns the current :class:`Membership`, runs collectives on it, repairs the ring in place when
members die (reconcile → accept → restart, the Spotnik paper §3.2), fences every membership change
with one compare-and-swap in the store, and admits joiners at ``admit()`` boundaries.

Threads: the caller's thread only waits on collectives. A monitor thread accepts connections,
exchanges UDP heartbeats with the ring neighbours and watches outgoing links for EOF; each
inbound connection has a reader thread that also executes the receive side of collectives; each
outgoing link has a sender thread; a control thread performs connects, control sends and store
calls so no reader ever blocks on them; a keepalive thread refreshes the store registration and
polls the store when a repair stalls.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch

from spotnik_lightning.api import (
    BackendConnectionError,
    ConfigError,
    FetchError,
    MembershipChanged,
    MembershipTimeoutError,
    ProtocolError,
    RingBrokenError,
    RingTimeouts,
)
from spotnik_lightning.membership.store import MembershipStore
from spotnik_lightning.membership.types import Member, Membership
from spotnik_lightning.ring import plans, wire
from spotnik_lightning.ring.datapath import DataPathMixin
from spotnik_lightning.ring.events import MembershipEvent
from spotnik_lightning.ring.links import Monitor, OutLink, tune
from spotnik_lightning.ring.ops import REDUCE_OPS, Op
from spotnik_lightning.ring.repair import RepairMixin
from spotnik_lightning.ring.serve import CHANNEL as SERVE_CHANNEL
from spotnik_lightning.ring.serve import ServedCache
from spotnik_lightning.ring.state import CLOSED, FENCED, JOINING, LEAVING, REPAIRING, RUNNING, STARTING

log = logging.getLogger("spotnik.ring")

def _bind(host: str, port: int) -> tuple[socket.socket, socket.socket]:
    """A TCP listener and a UDP socket on the same port number (random when port is 0)."""
    for _ in range(50):
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            tcp.bind((host, port))
            real = tcp.getsockname()[1]
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind((host, real))
        except OSError as exc:
            tcp.close()
            if port:
                raise ConfigError(f"cannot bind ring port {host}:{port}: {exc}") from exc
            continue
        tcp.listen(128)
        tcp.setblocking(False)
        udp.setblocking(False)
        return tcp, udp
    raise ConfigError(f"no free port pair (TCP+UDP) on {host}")


class RingGroup(RepairMixin, DataPathMixin):
    """A member of one run's ring. Create with :meth:`create`; every public method is bounded.

    Collectives must be called by every member in the same order (SPMD) from one thread at a
    time. A collective interrupted by a membership change raises :class:`MembershipChanged`
    (retry it: the ring has already been repaired); a worker excluded from the next epoch gets
    :class:`EpochFencedError`; a wait that runs out raises :class:`MembershipTimeoutError`.
    """

    def __init__(self, store: MembershipStore, me: Member, *, run_id: str, secret: bytes,
                 timeouts: RingTimeouts, chunk_bytes: int, listener: socket.socket,
                 udp: socket.socket, register_ttl: timedelta) -> None:
        self.store, self.me, self.run_id, self.timeouts = store, me, run_id, timeouts
        self._secret = secret
        self.chunk_bytes = chunk_bytes
        self._listener, self._udp = listener, udp
        self._ttl = register_ttl
        self._cv = threading.Condition(threading.RLock())
        self._membership = Membership(0, ())
        self._observed = 0  # the epoch the caller last saw (see _enter_op)
        self._state = STARTING
        self._error: BaseException | None = None
        self._seq = 0
        self._p2p_seq: dict[tuple[str, str], int] = {}
        self._ops: dict[str, Op] = {}
        self._out: dict[tuple[str, str], OutLink] = {}
        self._connect_locks: dict[tuple[str, str], threading.Lock] = {}
        self._links_lock = threading.Lock()
        self._inbound: dict[str, list[socket.socket]] = {}
        self._known: dict[str, Member] = {me.id: me}
        self._last_seen: dict[str, float] = {}
        self._last_tick = time.monotonic()
        self._heard: set[str] = set()  # neighbours whose heartbeats we have seen at least once
        self._prev_neighbours: set[str] = set()
        self._pending_join: dict[str, Member] = {}
        self._staging = {"ring": torch.empty(chunk_bytes, dtype=torch.uint8),
                         "p2p": torch.empty(chunk_bytes, dtype=torch.uint8)}
        self._ctrl_q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.events: list[MembershipEvent] = []
        self.listeners: list[Callable[[MembershipEvent], None]] = []
        self.messages_sent = 0
        self.prefetched: tuple[int, str] | None = None  # see create(prefetch=)
        self._served = ServedCache(me.id, secret, run_id, chunk_bytes, timeouts.collective.total_seconds(),
                                   timeouts.connect.total_seconds())
        self._init_repair_state()
        hb = timeouts.heartbeat_interval.total_seconds()
        self._monitor = Monitor(listener, udp, secret, hb, self._on_accept, self._on_heartbeat,
                                self._on_link_eof, self._tick)
        self._threads = [
            threading.Thread(target=self._control_loop, name="spotnik-control", daemon=True),
            threading.Thread(target=self._keepalive_loop, name="spotnik-keepalive", daemon=True),
        ]
        self._monitor.start()
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, store: MembershipStore, *, world_size: int | None = None, member_id: str | None = None,
               host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
               tier: str = "transient", secret: bytes | str | None = None,
               timeouts: RingTimeouts | None = None, chunk_bytes: int = 4 << 20,
               register_ttl: timedelta = timedelta(seconds=10),
               prefetch: tuple[str, torch.Tensor] | None = None) -> RingGroup:
        """Bind the ring port, register in ``store`` and enter the ring.

        If the store holds no membership yet, the first ``world_size`` registered workers
        (reliable tier first, then registration order) found the ring at epoch 1; otherwise this
        worker joins the running ring and is admitted at the members' next ``admit()``.
        ``prefetch=(name, out)``: a worker joining a running ring first fetches a member's latest
        snapshot of ``name`` into ``out`` (reliable tier first, then rank order), *before* it
        registers, so the transfer delays nobody; ``group.prefetched`` is then ``(version,
        member id)``, or None when no member had one (best effort: never raises).
        Blocks until this worker is a member. Raises ConfigError for bad arguments,
        BackendConnectionError when the store is unreachable, MembershipTimeoutError when the
        bootstrap or join does not complete in time.
        """
        timeouts = timeouts or RingTimeouts()
        if world_size is not None and world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        if chunk_bytes < 4096 or chunk_bytes % 64:
            raise ConfigError(f"chunk_bytes must be a multiple of 64 and >= 4096, got {chunk_bytes}")
        listener, udp = _bind(host, port)
        real_port = listener.getsockname()[1]
        me = Member(member_id or uuid.uuid4().hex[:12], advertise_host or host, real_port, tier)
        group = cls(store, me, run_id=store.run_id, secret=wire.load_secret(secret), timeouts=timeouts,
                    chunk_bytes=chunk_bytes, listener=listener, udp=udp, register_ttl=register_ttl)
        try:
            if prefetch is not None:
                group.prefetched = group._prefetch(*prefetch)
            store.register(me, register_ttl)
            group._enter(world_size)
        except BaseException:
            group.close()
            raise
        with group._cv:
            group._observed = group._membership.epoch
        return group

    def _enter(self, world_size: int | None) -> None:
        deadline = time.monotonic() + self.timeouts.bootstrap.total_seconds()
        while True:
            current = self.store.get_membership()
            if current is not None and current.epoch > 0:
                if self.me.id in current:
                    with self._cv:
                        if self._state != RUNNING:  # else a restart already installed us
                            self._install_locked(current, kind="bootstrap")
                    return
                return self._join()
            if world_size is None:
                raise ConfigError("the store holds no membership yet: world_size is needed to found the ring")
            regs = self.store.registered()
            order = sorted(range(len(regs)), key=lambda i: (regs[i].tier != "reliable", i))
            chosen = [regs[i] for i in order][:world_size]
            if len(chosen) >= world_size and any(m.id == self.me.id for m in chosen):
                self.store.cas_membership(0, Membership(1, tuple(chosen)))
                continue
            if time.monotonic() > deadline:
                raise MembershipTimeoutError(
                    f"bootstrap of run {self.run_id!r}: {len(regs)} of {world_size} workers registered "
                    f"after {self.timeouts.bootstrap.total_seconds():.0f} s (epoch 0, member {self.me.id})")
            time.sleep(0.05)

    def _join(self) -> None:
        deadline = time.monotonic() + self.timeouts.join.total_seconds()
        with self._cv:
            self._state = JOINING
        while True:
            current = self.store.get_membership()
            for m in current.members if current else ():
                self._known.setdefault(m.id, m)
            sent_to = None
            for m in current.members if current else ():
                if self._send_ctrl(m.id, {"t": "join", "member": self.me.to_dict()}):
                    sent_to = m.id
                    break
            with self._cv:
                end = min(deadline, time.monotonic() + 1.0)
                while self._state == JOINING and time.monotonic() < end:
                    self._cv.wait(end - time.monotonic())
                if self._state == RUNNING:
                    return
                if self._state in (FENCED, CLOSED):
                    raise self._error or RingBrokenError("closed while joining")
            if time.monotonic() >= deadline:
                raise MembershipTimeoutError(
                    f"join of {self.me.id} not admitted within {self.timeouts.join.total_seconds():.0f} s "
                    f"(store epoch {current.epoch if current else 0}, last asked {sent_to})")

    # ------------------------------------------------------------------ views
    @property
    def membership(self) -> Membership:
        return self._membership

    @property
    def epoch(self) -> int:
        return self._membership.epoch

    @property
    def rank(self) -> int:
        return self._membership.rank_of(self.me.id)

    @property
    def size(self) -> int:
        return self._membership.size

    @property
    def member_id(self) -> str:
        return self.me.id

    @property
    def joiners_waiting(self) -> int:
        """How many registered workers wait to be admitted (known to the leader only; 0 elsewhere).
        Layers above put it in a collective so every member learns when to call :meth:`admit`."""
        with self._cv:
            if not self._membership.members or self._membership.members[0].id != self.me.id:
                return 0
            return sum(1 for m in self._pending_join if m not in self._membership)

    @property
    def state(self) -> str:
        return self._state

    def _neighbours(self, ids: list[str]) -> tuple[str | None, str | None]:
        """(pred, succ) of me in ``ids`` (None when alone)."""
        if self.me.id not in ids or len(ids) < 2:
            return None, None
        i = ids.index(self.me.id)
        return ids[(i - 1) % len(ids)], ids[(i + 1) % len(ids)]

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """In-place all-reduce (sum, avg, min, max, product) of a CPU tensor of any dtype/shape.

        Ring reduce-scatter + all-gather in chunks of ``chunk_bytes``; every member ends with
        bit-identical values. A non-contiguous tensor is reduced through one contiguous copy.
        """
        if op not in REDUCE_OPS:
            raise ConfigError(f"unsupported reduce op {op!r}; expected one of {REDUCE_OPS}")
        work = self._contiguous(tensor)
        flat = work.view(-1)

        def plan(n: int, rank: int) -> tuple[list, list]:
            return plans.allreduce_plan(flat.numel() * flat.element_size(), flat.element_size(), n, rank,
                                        self.chunk_bytes)

        self._ring_op("all_reduce", flat, plan, op)
        if work is not tensor:
            tensor.copy_(work)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Overwrite ``tensor`` on every member with rank ``src``'s (pipelined along the ring)."""
        work = self._contiguous(tensor)
        flat = work.view(-1)
        self._check_rank(src)
        nbytes = flat.numel() * flat.element_size()
        self._ring_op("broadcast", flat, lambda n, r: plans.broadcast_plan(nbytes, n, r, src, self.chunk_bytes))
        if work is not tensor:
            tensor.copy_(work)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` (size * input.numel() elements, same dtype) receives every member's input,
        ordered by rank."""
        inp = input.contiguous().view(-1)
        out = self._contiguous(output)
        flat = out.view(-1)
        if flat.dtype != inp.dtype or flat.numel() != inp.numel() * self.size:
            raise ConfigError(f"all_gather output must hold {self.size} x {inp.numel()} {inp.dtype} elements, "
                              f"got {flat.numel()} {flat.dtype}")
        block = inp.numel() * inp.element_size()

        def plan(n: int, r: int) -> tuple[list, list]:
            if flat.numel() != inp.numel() * n:
                raise MembershipChanged(self.epoch, self.epoch, "world size changed before all_gather")
            flat[r * inp.numel():(r + 1) * inp.numel()].copy_(inp)
            return plans.allgather_plan(block, n, r, self.chunk_bytes)

        self._ring_op("all_gather", flat, plan)
        if out is not output:
            output.copy_(out)

    def barrier(self) -> None:
        """Return once every member has entered the barrier."""
        self.all_reduce(torch.zeros(1, dtype=torch.int32))

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Point-to-point: deliver ``tensor`` to rank ``dst`` (which calls :meth:`recv`)."""
        self._p2p(send=tensor, peer_rank=dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Point-to-point: fill ``tensor`` with what rank ``src`` sends."""
        self._p2p(recv=tensor, peer_rank=src)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int) -> None:
        """Send ``send`` to ``peer`` and receive its tensor into ``recv`` concurrently (pairwise
        averaging for AD-PSGD); both sides call exchange with each other."""
        self._p2p(send=send, recv=recv, peer_rank=peer)

    # ------------------------------------------------------------------ served snapshots (ring/serve.py)
    def publish(self, name: str, tensors: torch.Tensor | list[torch.Tensor], version: int) -> int:
        """Copy ``tensors`` (bytes concatenated in order) into this member's served cache as the
        latest snapshot of ``name``, tagged ``version`` (e.g. the committed step). Local only: never
        blocks on peers. Returns its size in bytes; raises ConfigError for a version going back."""
        return self._served.publish(name, tensors, version)

    def fetch(self, peer: int | str, name: str, out: torch.Tensor, min_version: int = -1,
              timeout: float | None = None) -> int:
        """Fill ``out`` (dense, as many bytes as the snapshot) with the latest snapshot of ``name``
        that member ``peer`` (a rank of the current membership, or a member id) published, served by
        the peer's ring I/O threads (its training thread is not involved), and return its version.
        Not a collective: only this member calls it, and it never reports membership changes (the
        next collective does). Blocks for at most ``timeout`` (default: the collective timeout) s
        without progress. Raises FetchError — ``gone=True`` at once when the peer is not (or stops
        being) a live member, dies or cannot be reached; ``gone=False`` when it has no snapshot of
        that name, size and at least ``min_version`` — and RingBrokenError when this group is closed."""
        with self._cv:
            if self._state not in (RUNNING, REPAIRING):
                raise self._error or RingBrokenError(f"ring is {self._state} (member {self.me.id})")
            m = self._membership
            if isinstance(peer, int):
                self._check_rank(peer)
                peer = m.members[peer].id
            member = self._known.get(peer)
        if peer == self.me.id:
            return self._served.local(name, out, min_version)
        if member is None or not self._live(peer):
            raise FetchError(f"fetch {name!r} from {peer} at epoch {m.epoch}: not a live member", peer, m.epoch, True)
        return self._served.fetch(member, name, out, min_version=min_version, epoch=m.epoch,
                                  alive=lambda: self._live(peer), timeout=timeout)

    def _prefetch(self, name: str, out: torch.Tensor) -> tuple[int, str] | None:
        """Before registering: a running ring's member's latest ``name`` snapshot (see create)."""
        current = self.store.get_membership()
        if current is None or current.epoch == 0:
            return None
        for m in sorted(current.members, key=lambda m: m.tier != "reliable")[:2]:
            self._known.setdefault(m.id, m)
            try:
                version = self._served.fetch(m, name, out, min_version=-1, epoch=current.epoch,
                                             alive=lambda: self._state != CLOSED)
            except FetchError as exc:
                log.info("%s could not prefetch %r: %s", self.me.id, name, exc)
                continue
            return version, m.id
        return None

    def _live(self, peer: str) -> bool:
        """``peer`` is a member of the current membership and not suspected (lock-free read)."""
        return self._state in (RUNNING, REPAIRING) and peer in self._membership.ids and peer not in self._dead

    # ------------------------------------------------------------------ connections
    def _on_accept(self, sock: socket.socket, addr: tuple) -> None:
        threading.Thread(target=self._serve_inbound, args=(sock, addr), name="spotnik-inbound",
                         daemon=True).start()

    def _serve_inbound(self, sock: socket.socket, addr: tuple) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        try:
            sock.setblocking(True)
            sock.settimeout(self.timeouts.connect.total_seconds())
            hello = wire.handshake_accept(sock, self._secret, self.run_id)
        except (ProtocolError, OSError, ConnectionError, ValueError) as exc:
            log.warning("refused ring connection from %s: %s", peer, exc)
            sock.close()
            return
        peer = hello.member_id
        sock.settimeout(None)
        tune(sock)
        with self._cv:
            if self._state == CLOSED:
                sock.close()
                return
            self._inbound.setdefault(peer, []).append(sock)
        scratch = bytearray(64 << 10)
        try:
            if hello.channel == SERVE_CHANNEL:  # request/reply, answered on this thread; never suspects
                return self._served.serve(sock, peer)
            while True:
                raw = wire.recv_exact(sock, wire.HEADER.size)
                kind, epoch, seq, idx, length = wire.unpack_header(raw, self.chunk_bytes)
                if kind == wire.KIND_CTRL:
                    self._on_ctrl(peer, wire.decode_ctrl(wire.recv_exact(sock, length)))
                else:
                    self._on_data(peer, hello.channel, sock, epoch, seq, idx, length, scratch)
        except ProtocolError as exc:
            log.warning("closing connection from %s (%s): %s", peer, hello.channel, exc)
            self._suspect(peer, f"protocol error: {exc}")
        except (ConnectionError, OSError) as exc:
            self._suspect(peer, f"connection lost: {exc}")
        finally:
            with self._cv:
                socks = self._inbound.get(peer, [])
                if sock in socks:
                    socks.remove(sock)
            try:
                sock.close()
            except OSError:
                pass

    def _out_link(self, peer: str, channel: str, timeout: float) -> OutLink | None:
        """The live outgoing link to ``peer`` on ``channel``, connecting (and handshaking) if
        needed. Returns None when the peer cannot be reached within ``timeout`` seconds."""
        key = (peer, channel)
        with self._links_lock:
            link = self._out.get(key)
            if link is not None and not link.failed:
                return link
            lock = self._connect_locks.setdefault(key, threading.Lock())
        with lock:
            link = self._out.get(key)
            if link is not None and not link.failed:
                return link
            member = self._known.get(peer)
            if member is None or self._state == CLOSED:
                return None
            try:
                sock = socket.create_connection(member.address, timeout=timeout)
            except OSError as exc:
                log.debug("connect to %s failed: %s", peer, exc)
                return None
            try:
                tune(sock)
                wire.handshake_connect(sock, self._secret, self.run_id, wire.Hello(self.me.id, channel))
                sock.settimeout(None)
            except (OSError, ConnectionError, ProtocolError) as exc:
                log.warning("handshake with %s failed: %s", peer, exc)
                sock.close()
                return None
            link = OutLink(peer, channel, sock, self._suspect)
            with self._links_lock:
                old = self._out.get(key)
                self._out[key] = link
            if old is not None:
                old.close()
            self._monitor.watch(link)
            return link

    def _on_link_eof(self, link: OutLink) -> None:
        if self._out.get((link.peer, link.channel)) is link:
            self._suspect(link.peer, "connection closed by peer")

    def _close_links_to(self, peer: str, notice: dict | None = None) -> None:
        """Close every connection to and from ``peer`` (unblocks readers and senders). With
        ``notice``, first send it on the ring link (best effort, flushed for up to 100 ms)."""
        with self._links_lock:
            links = [self._out.pop(k) for k in list(self._out) if k[0] == peer]
        notified = False
        for link in links:
            self._monitor.unwatch(link)
            flush = 0.0
            if notice is not None and link.channel == "ring":
                payload = wire.encode_ctrl(notice)
                notified = link.send(wire.pack_header(wire.KIND_CTRL, self.epoch, 0, 0, len(payload)) + payload,
                                     data=False)
                flush = 0.1
            threading.Thread(target=link.close, args=(flush,), daemon=True).start()
        if notice is not None and not notified:
            # no link to carry it: connect just for the notice, briefly, off every hot thread
            threading.Thread(target=self._notify_excluded, args=(peer, notice), daemon=True).start()
        for sock in self._inbound.get(peer, []):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _notify_excluded(self, peer: str, notice: dict) -> None:
        member = self._known.get(peer)
        if member is None or self._state == CLOSED:
            return
        timeout = min(1.0, 2 * self.timeouts.heartbeat_timeout.total_seconds())
        try:
            with socket.create_connection(member.address, timeout=timeout) as sock:
                wire.handshake_connect(sock, self._secret, self.run_id, wire.Hello(self.me.id, "ring"))
                payload = wire.encode_ctrl(notice)
                sock.sendall(wire.pack_header(wire.KIND_CTRL, self.epoch, 0, 0, len(payload)) + payload)
        except (OSError, ConnectionError, ProtocolError):
            pass  # dead or unreachable: nothing to tell

    def _send_ctrl(self, peer: str, msg: dict) -> bool:
        """Send a control message (or deliver it locally when ``peer`` is me). Blocks on the
        connect only; returns False if the peer is unreachable."""
        if peer == self.me.id:
            self._on_ctrl(peer, msg)
            return True
        timeout = min(self.timeouts.connect.total_seconds(),
                      max(1.0, 4 * self.timeouts.heartbeat_timeout.total_seconds()))
        link = self._out_link(peer, "ring", timeout)
        if link is None:
            return False
        payload = wire.encode_ctrl(msg)
        ok = link.send(wire.pack_header(wire.KIND_CTRL, self.epoch, 0, 0, len(payload)) + payload, data=False)
        if ok:
            with self._cv:
                self.messages_sent += 1
                self._repair_msgs += 1
        return ok

    # ------------------------------------------------------------------ heartbeats / keepalive
    def _on_heartbeat(self, member_id: str, epoch: int) -> None:
        self._last_seen[member_id] = time.monotonic()
        self._heard.add(member_id)

    def _tick(self) -> None:
        with self._cv:
            if self._state not in (RUNNING, REPAIRING):
                return
            view = [i for i in self._membership.ids if i not in self._dead]
            pred, succ = self._neighbours(view)
            epoch = self._membership.epoch
        now = time.monotonic()
        limit = self.timeouts.heartbeat_timeout.total_seconds()
        # If this process itself was starved (our tick came late), silence is no evidence against
        # the neighbours: restart their deadlines instead of suspecting them.
        starved = now - self._last_tick > limit / 2
        self._last_tick = now
        neighbours = {pred, succ} - {None}
        for nb in neighbours - self._prev_neighbours:
            # it only starts sending to us when it becomes our neighbour (e.g. mid-repair, when a
            # dead member between us drops out of both views): its deadline starts now
            self._last_seen[nb] = now
        self._prev_neighbours = neighbours
        for nb in neighbours:
            member = self._known.get(nb)
            if member is not None:
                self._monitor.send_heartbeat(member.address, epoch, self.me.id)
            seen = self._last_seen.setdefault(nb, now)
            if starved:
                self._last_seen[nb] = now
            # a neighbour never heard from may still be starting up: give it a longer grace
            elif now - seen > (limit if nb in self._heard else max(2.0, 8 * limit)):
                self._suspect(nb, f"no heartbeat for {1000 * (now - seen):.0f} ms")

    def _keepalive_loop(self) -> None:
        period = max(0.2, self._ttl.total_seconds() / 3)
        next_keepalive = time.monotonic() + period
        while True:
            with self._cv:
                if self._state == CLOSED:
                    return
                self._cv.wait(0.1)
                stalled = self._state == REPAIRING and self._repair_stalled()
            if stalled:
                self._ctrl(self._sync_from_store)
            if time.monotonic() >= next_keepalive:
                next_keepalive = time.monotonic() + period
                try:
                    self.store.keepalive(self.me.id)
                except BackendConnectionError as exc:
                    log.warning("keepalive of %s failed (store unreachable): %s", self.me.id, exc)

    def _ctrl(self, fn: Callable[[], None]) -> None:
        self._ctrl_q.put(fn)

    def _control_loop(self) -> None:
        while True:
            fn = self._ctrl_q.get()
            if fn is None or self._state == CLOSED:
                return
            try:
                fn()
            except Exception:
                log.exception("control task failed at %s", self.me.id)

    # ------------------------------------------------------------------ leave / close
    def leave(self) -> None:
        """Leave the ring gracefully: tell both neighbours, then close. The others repair at once
        (their in-flight collective, if any, raises MembershipChanged)."""
        with self._cv:
            view = list(self._membership.ids)
            pred, succ = self._neighbours(view)
            running = self._state in (RUNNING, REPAIRING)
            if running:
                self._state = LEAVING  # from now on our own closing links are not failures
                for op in list(self._ops.values()):
                    op.fail(RingBrokenError(f"{self.me.id} is leaving the ring"))
        if running:
            for nb in {pred, succ} - {None}:
                self._send_ctrl(nb, {"t": "lv", "base": self.epoch})
            with self._links_lock:
                links = [self._out.pop(k) for k in list(self._out) if k[0] in (pred, succ)]
            for link in links:
                self._monitor.unwatch(link)
                link.close(flush_timeout=1.0)
        self.close()

    def close(self) -> None:
        """Stop every thread and close every socket (idempotent, bounded). Unregisters from the
        store (best effort)."""
        with self._cv:
            if self._state == CLOSED:
                return
            self._state = CLOSED
            self._error = self._error or RingBrokenError(f"ring group of {self.me.id} is closed")
            for op in self._ops.values():
                op.fail(self._error)
            self._cv.notify_all()
        self._ctrl_q.put(None)
        self._served.close()
        if self._join_watch is not None:
            self._join_watch()
        self._monitor.stop()
        with self._links_lock:
            links = list(self._out.values())
            self._out.clear()
        for link in links:
            link.close()
        for socks in list(self._inbound.values()):
            for s in list(socks):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._listener.close()
        self._udp.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2.0)
        try:
            self.store.unregister(self.me.id)
        except Exception as exc:  # the store may be gone at shutdown; nothing to recover
            log.debug("unregister of %s failed: %s", self.me.id, exc)

    def __enter__(self) -> RingGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
