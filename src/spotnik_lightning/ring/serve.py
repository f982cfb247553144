"""The served snapshot cache: a member publishes tensors; peers fetch them from its I/O threads.

A member *publishes* a snapshot under a name (``publish``: one copy of the tensors into a buffer
of the cache, tagged with a version, e.g. its committed step count). A peer *fetches* the latest
snapshot of a name (``fetch``): it opens an authenticated connection on the ``"serve"`` channel
(the same HMAC handshake, protocol version and run id check as every ring connection) and sends a
request; the owner's inbound thread for that connection — a ring I/O thread — answers from the
cache. The owner's training thread takes no part: it is never blocked, never even told.

Wire (after the handshake; frames are ``wire.HEADER || payload`` as everywhere on the ring; the
serve channel is the one channel where the acceptor writes after the handshake):

* request (fetcher → owner): a control frame ``{"t": "get", "id", "name", "nbytes", "min"}``;
* reply (owner → fetcher): a control frame ``{"t": "snap", "id", "version", "nbytes"}`` followed by
  the snapshot's bytes in data frames of at most ``chunk_bytes`` (seq = request id, index = piece),
  or ``{"t": "err", "id", "code", "reason"}`` with code ``missing``, ``stale`` or ``size``.

Any peer that passed the handshake may fetch — it proved it knows the job secret, like a worker
asking to join (a joiner prefetches the model this way before it registers).

A malformed, oversized or out-of-place frame closes that one connection with a logged warning; the
cache, the ring and the owner's training are unaffected (the ring does not suspect anybody over a
bad request). Snapshots are double-buffered with reader counts: a publish never writes into a
buffer being served, so a fetch always gets one whole snapshot of one version.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spotnik_lightning.api import ConfigError, FetchError, ProtocolError
from spotnik_lightning.membership.types import Member
from spotnik_lightning.ring import wire
from spotnik_lightning.ring.links import tune

log = logging.getLogger("spotnik.ring")

CHANNEL = "serve"
MAX_NAME = 200
_POLL = 0.05  # seconds between liveness checks while a fetch waits


@dataclass
class _Snap:
    buf: torch.Tensor  # uint8
    version: int
    readers: int = 0


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t`` (its contiguous copy when it is not dense)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


class ServedCache:
    """Both sides of the snapshot cache of one ring member (see the module doc). Thread-safe.

    ``me``: this member's id; ``secret``/``run_id``: the ring's handshake; ``chunk_bytes``: the
    largest data frame; ``io_timeout``: the longest a fetch or a serve may make no progress;
    ``connect_timeout``: one connect + handshake.
    """

    def __init__(self, me: str, secret: bytes, run_id: str, chunk_bytes: int, io_timeout: float,
                 connect_timeout: float) -> None:
        self.me, self._secret, self._run_id = me, secret, run_id
        self.chunk_bytes, self.io_timeout, self.connect_timeout = chunk_bytes, io_timeout, connect_timeout
        self._lock = threading.Lock()
        self._snaps: dict[str, _Snap] = {}
        self._spare: dict[str, _Snap] = {}
        self._conns: dict[str, socket.socket] = {}
        self._conn_locks: dict[str, threading.Lock] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self.served = 0  # snapshots sent to peers (for tests and metrics)
        self.rejected = 0  # requests refused or connections closed over a bad frame

    # ------------------------------------------------------------------ owner side
    def publish(self, name: str, tensors: torch.Tensor | Sequence[torch.Tensor], version: int) -> int:
        """Copy ``tensors`` (their bytes, concatenated in order) into the cache as the latest
        snapshot of ``name``, tagged ``version``. Never blocks on the network or on a fetch in
        progress (that one keeps reading the previous buffer). Returns the snapshot's size in bytes.
        Raises ConfigError for a bad name, non-CPU tensors or a version lower than the latest."""
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if not name or len(name.encode()) > MAX_NAME:
            raise ConfigError(f"snapshot name must be 1..{MAX_NAME} bytes, got {name!r}")
        if any(not isinstance(t, torch.Tensor) or t.device.type != "cpu" for t in ts):
            raise ConfigError("publish takes CPU tensors")
        nbytes = _nbytes(ts)
        with self._lock:
            cur = self._snaps.get(name)
            if cur is not None and version < cur.version:
                raise ConfigError(f"publish of {name!r} at {self.me}: version {version} < latest {cur.version}")
            spare = self._spare.pop(name, None)
        if spare is None or spare.readers or spare.buf.numel() != nbytes:
            spare = _Snap(torch.empty(nbytes, dtype=torch.uint8), version)
        off = 0
        for t in ts:  # the spare is invisible to readers: no lock while copying
            b = _bytes_of(t)
            spare.buf[off:off + b.numel()].copy_(b)
            off += b.numel()
        spare.version = version
        with self._lock:
            old = self._snaps.get(name)
            self._snaps[name] = spare
            if old is not None:
                self._spare[name] = old  # reused by the next publish unless still being served
        return nbytes

    def local(self, name: str, out: torch.Tensor, min_version: int) -> int:
        """Fetch from this member's own cache (same errors as a remote fetch, never ``gone``)."""
        view = _out_bytes(out)
        with self._lock:
            snap = self._check(name, view.numel(), min_version)
            if isinstance(snap, tuple):
                raise FetchError(f"fetch {name!r} from {self.me} (itself): {snap[1]}", self.me, -1, gone=False)
            view.copy_(snap.buf)
            return snap.version

    def _check(self, name: str, nbytes: int, min_version: int) -> _Snap | tuple[str, str]:
        snap = self._snaps.get(name)
        if snap is None:
            return "missing", f"nothing published under {name!r}"
        if snap.version < min_version:
            return "stale", f"latest {name!r} is version {snap.version} < {min_version}"
        if snap.buf.numel() != nbytes:
            return "size", f"{name!r} has {snap.buf.numel()} bytes, {nbytes} asked for"
        return snap

    def serve(self, sock: socket.socket, peer: str) -> None:
        """Answer ``peer``'s requests on ``sock`` until it closes (the inbound thread of an
        authenticated serve connection). Never raises: a bad frame or a stuck fetcher closes this
        connection with a logged reason. Each send is bounded by ``io_timeout``."""
        try:
            while not self._closed:
                sock.settimeout(None)  # an idle fetcher keeps its connection (closed with the ring's sockets)
                raw = wire.recv_exact(sock, 1)
                sock.settimeout(self.io_timeout)  # from the first byte on, the request and reply are bounded
                kind, _, _, _, length = wire.unpack_header(raw + wire.recv_exact(sock, wire.HEADER.size - 1), 0)
                if kind != wire.KIND_CTRL:
                    raise ProtocolError("data frame sent to the serve channel")
                req = _parse_request(wire.decode_ctrl(wire.recv_exact(sock, length)))
                self._answer(sock, req)
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("closing serve connection from %s: %s", peer, exc)
        except TimeoutError:
            log.warning("closing serve connection from %s: no progress sending for %.0f s", peer, self.io_timeout)
        except (ConnectionError, OSError):
            pass  # the fetcher went away; nothing to clean up but the socket (the caller closes it)

    def _answer(self, sock: socket.socket, req: dict) -> None:
        rid = req["id"]
        with self._lock:
            snap = self._check(req["name"], req["nbytes"], req["min"])
            if not isinstance(snap, tuple):
                snap.readers += 1
        if isinstance(snap, tuple):
            _send_ctrl(sock, {"t": "err", "id": rid, "code": snap[0], "reason": snap[1]})
            return
        try:
            _send_ctrl(sock, {"t": "snap", "id": rid, "version": snap.version, "nbytes": snap.buf.numel()})
            mv = memoryview(snap.buf.numpy()) if snap.buf.numel() else memoryview(b"")
            for k, start in enumerate(range(0, len(mv), self.chunk_bytes)):
                piece = mv[start:start + self.chunk_bytes]
                sock.sendall(wire.pack_header(wire.KIND_DATA, 0, rid, k, len(piece)))
                sock.sendall(piece)
            self.served += 1
        finally:
            with self._lock:
                snap.readers -= 1

    # ------------------------------------------------------------------ fetcher side
    def fetch(self, peer: Member, name: str, out: torch.Tensor, *, min_version: int, epoch: int,
              alive: Callable[[], bool], timeout: float | None = None) -> int:
        """Fill ``out`` (a dense CPU tensor of the snapshot's size in bytes) with ``peer``'s latest
        snapshot of ``name`` and return its version. Blocks on the network only, for at most
        ``timeout`` (default ``io_timeout``) seconds without progress; checks ``alive()`` every
        50 ms and gives up at once when it turns False (the ring dropped the peer).
        Raises FetchError (``gone`` as documented there); ``out`` is undefined after an error."""
        view = _out_bytes(out)
        limit = self.io_timeout if timeout is None else timeout
        what = f"fetch {name!r} from {peer.id} at epoch {epoch}"

        def gone(reason: str) -> FetchError:
            return FetchError(f"{what}: {reason}", peer.id, epoch, gone=True)

        lock = self._conn_locks.setdefault(peer.id, threading.Lock())
        with lock:
            try:
                sock = self._connection(peer, alive, limit)
                rid = next(self._ids)
                _send_ctrl(sock, {"t": "get", "id": rid, "name": name, "nbytes": view.numel(), "min": min_version})
                waiter = _Waiter(sock, limit, alive)
                kind, _, seq, _, length = wire.unpack_header(waiter.read(wire.HEADER.size), self.chunk_bytes)
                if kind != wire.KIND_CTRL:
                    raise ProtocolError("reply is not a control frame")
                reply = wire.decode_ctrl(waiter.read(length))
                if reply.get("id") != rid:
                    raise ProtocolError(f"reply to request {reply.get('id')}, expected {rid}")
                if reply["t"] == "err":  # the peer is alive and answering: not gone
                    raise FetchError(f"{what}: {reply.get('code')}: {reply.get('reason')}", peer.id, epoch,
                                     gone=False)
                if reply["t"] != "snap" or int(reply["nbytes"]) != view.numel():
                    raise ProtocolError(f"unexpected reply {reply!r}")
                mv = memoryview(view.numpy()) if view.numel() else memoryview(b"")
                for k, start in enumerate(range(0, len(mv), self.chunk_bytes)):
                    dkind, _, dseq, idx, dlen = wire.unpack_header(waiter.read(wire.HEADER.size), self.chunk_bytes)
                    piece = mv[start:start + self.chunk_bytes]
                    if dkind != wire.KIND_DATA or dseq != rid or idx != k or dlen != len(piece):
                        raise ProtocolError(f"data frame {idx} ({dlen} bytes) does not match piece {k}")
                    waiter.read_into(piece)
                return int(reply["version"])
            except FetchError as exc:
                if exc.gone:
                    self._drop(peer.id)
                raise
            except _PeerDropped:
                self._drop(peer.id)
                raise gone("the ring dropped the peer (it died, left or was excluded)") from None
            except TimeoutError:
                self._drop(peer.id)
                raise gone(f"no progress for {limit:.1f} s") from None
            except ProtocolError as exc:
                self._drop(peer.id)
                log.warning("%s: %s", what, exc)
                raise gone(f"protocol error: {exc}") from None
            except (ConnectionError, OSError, KeyError, TypeError, ValueError) as exc:
                self._drop(peer.id)
                raise gone(f"connection failed: {exc}") from None

    def _connection(self, peer: Member, alive: Callable[[], bool], limit: float) -> socket.socket:
        sock = self._conns.get(peer.id)
        if sock is not None:
            return sock
        if self._closed:
            raise ConnectionError("the ring group is closed")
        if not alive():
            raise _PeerDropped()
        sock = socket.create_connection(peer.address, timeout=min(self.connect_timeout, limit))
        try:
            tune(sock)
            wire.handshake_connect(sock, self._secret, self._run_id, wire.Hello(self.me, CHANNEL))
        except BaseException:
            sock.close()
            raise
        with self._lock:
            if self._closed:
                sock.close()
                raise ConnectionError("the ring group is closed")
            self._conns[peer.id] = sock
        return sock

    def _drop(self, peer: str) -> None:
        with self._lock:
            sock = self._conns.pop(peer, None)
        if sock is not None:
            _close(sock)

    def forget(self, peer: str) -> None:
        """Close the fetch connection to ``peer`` (it left the membership)."""
        self._drop(peer)

    def close(self) -> None:
        """Close every fetch connection; later fetches fail (serving stops with the ring's sockets)."""
        with self._lock:
            self._closed = True
            socks, self._conns = list(self._conns.values()), {}
        for s in socks:
            _close(s)


class _PeerDropped(Exception):  # noqa: N818 - internal signal
    """The ring no longer counts the peer as a live member."""


class _Waiter:
    """Bounded reads on a fetch socket: at most ``limit`` s without progress, ``alive()`` polled."""

    def __init__(self, sock: socket.socket, limit: float, alive: Callable[[], bool]) -> None:
        self.sock, self.limit, self.alive = sock, limit, alive
        sock.settimeout(_POLL)

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(memoryview(buf))
        return bytes(buf)

    def read_into(self, view: memoryview) -> None:
        got, last = 0, time.monotonic()
        while got < view.nbytes:
            try:
                k = self.sock.recv_into(view[got:], view.nbytes - got)
            except TimeoutError:
                if not self.alive():
                    raise _PeerDropped() from None
                if time.monotonic() - last > self.limit:
                    raise
                continue
            if k == 0:
                raise ConnectionError(f"connection closed after {got} of {view.nbytes} bytes")
            got += k
            last = time.monotonic()


def _out_bytes(out: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or not out.is_contiguous():
        raise ConfigError("fetch needs a dense (contiguous) CPU tensor to fill")
    if out.dtype == torch.bool:
        raise ConfigError("fetch cannot fill a bool tensor; use uint8")
    return out.reshape(-1).view(torch.uint8) if out.numel() else torch.empty(0, dtype=torch.uint8)


def _parse_request(msg: dict) -> dict:
    try:
        if msg["t"] != "get":
            raise ProtocolError(f"unexpected {msg['t']!r} message on the serve channel")
        req = {"id": int(msg["id"]), "name": str(msg["name"]), "nbytes": int(msg["nbytes"]), "min": int(msg["min"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed fetch request: {exc!r}") from None
    if req["nbytes"] < 0 or len(req["name"].encode()) > MAX_NAME:
        raise ProtocolError("malformed fetch request: bad size or name")
    return req


def _send_ctrl(sock: socket.socket, msg: dict) -> None:
    payload = wire.encode_ctrl(msg)
    sock.sendall(wire.pack_header(wire.KIND_CTRL, 0, 0, 0, len(payload)) + payload)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
