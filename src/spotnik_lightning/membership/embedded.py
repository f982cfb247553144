"""The embedded membership store: a tiny threaded TCP server and its client, no external service.

Wire format: every message is one frame, a 4-byte big-endian length followed by that many bytes of
UTF-8 JSON (an object). A request is ``{"op": ..., "run": <run_id>, ...}``; the answer is
``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. A frame that is oversized (> 1 MiB),
truncated, stalled mid-frame or not a JSON object closes that connection with a logged reason; the
server keeps serving everyone else.

The server holds everything in memory (per run: the current membership, registrations with a TTL
measured on ``time.monotonic`` and auxiliary values), so a restarted server starts empty. Run it
standalone with ``python -m spotnik_lightning.membership.embedded --host H --port P``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import struct
import threading
import time
from datetime import timedelta

from spotnik_lightning.api import BackendConnectionError, ConfigError, _positive
from spotnik_lightning.membership.store import MembershipStore
from spotnik_lightning.membership.types import Member, Membership

log = logging.getLogger("spotnik.store")

#: Largest frame either side accepts.
MAX_FRAME = 1 << 20
_HEADER = struct.Struct("!I")


class FrameError(Exception):
    """A frame was oversized, truncated or stalled; the connection it came on must be closed."""


# --------------------------------------------------------------------------- framing


def _arm(sock: socket.socket, deadline: float | None) -> None:
    """Set the socket timeout to what is left until ``deadline`` (None = block)."""
    if deadline is None:
        sock.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)


def _recv_exactly(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """Read exactly ``n`` bytes. Raises FrameError on EOF before ``n`` bytes, OSError/TimeoutError
    when the socket fails or ``deadline`` passes."""
    buf = bytearray()
    while len(buf) < n:
        _arm(sock, deadline)
        chunk = sock.recv(min(n - len(buf), 65536))
        if not chunk:
            raise FrameError(f"truncated frame: connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket, wait_deadline: float | None, frame_timeout: float) -> bytes | None:
    """Read one frame's payload; None on a clean EOF between frames.

    Blocks until the first byte arrives or ``wait_deadline`` (monotonic; None = forever) passes;
    the rest of the frame must then arrive within ``frame_timeout`` seconds (and before
    ``wait_deadline``). Raises FrameError (oversized, truncated, stalled mid-frame) or OSError.
    """
    _arm(sock, wait_deadline)
    first = sock.recv(1)
    if not first:
        return None
    deadline = time.monotonic() + frame_timeout
    if wait_deadline is not None:
        deadline = min(deadline, wait_deadline)
    try:
        (size,) = _HEADER.unpack(first + _recv_exactly(sock, _HEADER.size - 1, deadline))
        if size > MAX_FRAME:
            raise FrameError(f"oversized frame: {size} bytes > limit {MAX_FRAME}")
        return _recv_exactly(sock, size, deadline)
    except TimeoutError as exc:  # socket.timeout is TimeoutError since 3.10
        raise FrameError(f"frame stalled: incomplete after {frame_timeout:.1f} s") from exc


def write_frame(sock: socket.socket, obj: dict, deadline: float | None = None) -> None:
    """Send ``obj`` as one frame. Raises FrameError if it encodes to more than MAX_FRAME bytes."""
    payload = json.dumps(obj, separators=(",", ":")).encode()
    if len(payload) > MAX_FRAME:
        raise FrameError(f"refusing to send oversized frame of {len(payload)} bytes")
    _arm(sock, deadline)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not run_id or "/" in run_id:
        raise ConfigError(f"run_id must be a non-empty string without '/': {run_id!r}")
    return run_id


# --------------------------------------------------------------------------- server


class _BadRequest(Exception):
    """A well-framed request the server cannot execute; answered with ``ok: false``."""


class _Run:
    """In-memory state of one run. Only touched under the server's state lock."""

    def __init__(self) -> None:
        self.epoch = 0
        self.membership: dict | None = None
        # member id -> (member dict, ttl seconds, monotonic expiry); dict order = registration order
        self.regs: dict[str, tuple[dict, float, float]] = {}
        self.aux: dict[str, str] = {}

    def purge(self, now: float) -> None:
        for mid in [mid for mid, (_, _, exp) in self.regs.items() if exp <= now]:
            del self.regs[mid]


def _field(req: dict, name: str, kind: type | tuple[type, ...]) -> object:
    value = req.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise _BadRequest(f"field {name!r} missing or not {kind}")
    return value


def _member(d: object) -> dict:
    if not isinstance(d, dict):
        raise _BadRequest("field 'member' must be an object")
    try:
        return Member.from_dict(d).to_dict()
    except (KeyError, TypeError, ValueError) as exc:
        raise _BadRequest(f"bad member: {exc}") from exc


def _ttl(req: dict) -> float:
    ttl = float(_field(req, "ttl", (int, float)))  # type: ignore[arg-type]
    if not 0 < ttl < 1e7:
        raise _BadRequest(f"ttl out of range: {ttl}")
    return ttl


class EmbeddedStoreServer:
    """In-memory store for any number of runs, served over TCP (length-prefixed JSON).

    One thread accepts, one thread serves each connection. Malformed input closes only the
    offending connection. ``frame_timeout`` bounds how long a started frame may take to arrive.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, frame_timeout: float = 10.0) -> None:
        self._bind = (host, port)
        self._frame_timeout = frame_timeout
        self._state_lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._conn_lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.address: tuple[str, int] | None = None

    @property
    def url(self) -> str:
        """``embedded://host:port`` of the running server (for :func:`open_store`)."""
        if self.address is None:
            raise RuntimeError("server not started")
        return f"embedded://{self.address[0]}:{self.address[1]}"

    def start(self) -> tuple[str, int]:
        """Bind, listen and start serving in background threads; returns the bound (host, port).

        Raises OSError if the address cannot be bound.
        """
        if self._listener is not None:
            raise RuntimeError("server already started")
        family = socket.AF_INET6 if ":" in self._bind[0] else socket.AF_INET
        listener = socket.create_server(self._bind, family=family)
        listener.settimeout(0.1)  # accept() polls the stop flag at this period
        self._listener = listener
        self.address = listener.getsockname()[:2]
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"spotnik-store-accept-{self.address[1]}", daemon=True
        )
        self._accept_thread.start()
        log.info("embedded store listening on %s:%d", *self.address)
        return self.address

    def stop(self, timeout: timedelta = timedelta(seconds=2)) -> None:
        """Close the listener and every client connection, then join the threads.

        Idempotent. Blocks at most about ``timeout``; threads still alive after it are daemons and
        are left behind with a warning.
        """
        self._stopping.set()
        deadline = time.monotonic() + timeout.total_seconds()
        if self._listener is not None:
            self._listener.close()
        with self._conn_lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv()
            except OSError:
                pass
        threads = [t for _, t in conns]
        if self._accept_thread is not None:
            threads.append(self._accept_thread)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("embedded store thread %s did not stop in time", t.name)

    def __enter__(self) -> EmbeddedStoreServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping.is_set():
                    return
                log.warning("embedded store: accept failed (%s); retrying", exc)  # e.g. EMFILE
                time.sleep(0.1)
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(
                target=self._serve, args=(conn, peer), name=f"spotnik-store-{peer}", daemon=True
            )
            with self._conn_lock:
                if self._stopping.is_set():
                    conn.close()
                    return
                self._conns[conn] = t
                t.start()  # under the lock, so stop() never joins a thread not yet started

    def _serve(self, conn: socket.socket, peer: object) -> None:
        """Answer requests on ``conn`` until EOF, a bad frame or stop(); never raises."""
        try:
            while not self._stopping.is_set():
                try:
                    payload = read_frame(conn, None, self._frame_timeout)
                except FrameError as exc:
                    log.warning("embedded store: closing connection from %s: %s", peer, exc)
                    return
                if payload is None:
                    return
                try:
                    req = json.loads(payload)
                except ValueError as exc:  # includes UnicodeDecodeError
                    log.warning(
                        "embedded store: closing connection from %s: frame is not JSON (%s)", peer, exc
                    )
                    return
                if not isinstance(req, dict):
                    log.warning(
                        "embedded store: closing connection from %s: frame is not a JSON object", peer
                    )
                    return
                # Bounded so a client that never reads cannot pin this thread.
                write_frame(conn, self._dispatch(req), time.monotonic() + self._frame_timeout)
        except OSError as exc:
            if not self._stopping.is_set():
                log.info("embedded store: connection from %s ended: %s", peer, exc)
        except Exception:  # a bug must cost one connection, never the server
            log.exception("embedded store: unexpected error serving %s; closing it", peer)
        finally:
            with self._conn_lock:
                self._conns.pop(conn, None)
            conn.close()

    def _dispatch(self, req: dict) -> dict:
        try:
            run = _field(req, "run", str)
            op = _field(req, "op", str)
            handler = getattr(self, f"_op_{op}", None)
            if not run or handler is None:
                raise _BadRequest(f"unknown op {op!r} or empty run id")
            with self._state_lock:
                state = self._runs.setdefault(run, _Run())  # type: ignore[arg-type]
                state.purge(time.monotonic())
                return {"ok": True, **handler(state, req)}
        except _BadRequest as exc:
            return {"ok": False, "error": str(exc)}
        except (KeyError, TypeError, ValueError) as exc:  # ops validate before mutating state
            return {"ok": False, "error": f"bad request: {exc!r}"}

    # Each _op_* runs under the state lock with expired registrations already purged.

    def _op_ping(self, s: _Run, req: dict) -> dict:
        return {}

    def _op_get_membership(self, s: _Run, req: dict) -> dict:
        return {"membership": s.membership}

    def _op_cas_membership(self, s: _Run, req: dict) -> dict:
        expected = _field(req, "expected", int)
        try:
            new = Membership.from_json(json.dumps(_field(req, "membership", dict)))
        except (KeyError, TypeError, ValueError) as exc:
            raise _BadRequest(f"bad membership: {exc}") from exc
        if new.epoch != expected + 1:  # type: ignore[operator]
            raise _BadRequest(f"new epoch {new.epoch} is not expected epoch {expected} + 1")
        if s.epoch != expected:
            return {"won": False, "membership": s.membership}
        s.epoch, s.membership = new.epoch, json.loads(new.to_json())
        return {"won": True, "membership": s.membership}

    def _op_register(self, s: _Run, req: dict) -> dict:
        member, ttl = _member(req.get("member")), _ttl(req)
        # Replacing keeps the member's place in registration order (as an etcd put does).
        s.regs[member["id"]] = (member, ttl, time.monotonic() + ttl)
        return {}

    def _op_keepalive(self, s: _Run, req: dict) -> dict:
        mid = _field(req, "id", str)
        if mid in s.regs:
            member, ttl, _ = s.regs[mid]
            s.regs[mid] = (member, ttl, time.monotonic() + ttl)
            return {"reregistered": False}
        if req.get("member") is None:
            return {"reregistered": False}
        member, ttl = _member(req["member"]), _ttl(req)
        if member["id"] != mid:
            raise _BadRequest("keepalive id does not match member id")
        s.regs[mid] = (member, ttl, time.monotonic() + ttl)
        return {"reregistered": True}

    def _op_unregister(self, s: _Run, req: dict) -> dict:
        s.regs.pop(_field(req, "id", str), None)  # type: ignore[arg-type]
        return {}

    def _op_registered(self, s: _Run, req: dict) -> dict:
        return {"members": [m for m, _, _ in s.regs.values()]}

    def _op_put(self, s: _Run, req: dict) -> dict:
        s.aux[_field(req, "key", str)] = _field(req, "value", str)  # type: ignore[index]
        return {}

    def _op_get(self, s: _Run, req: dict) -> dict:
        return {"value": s.aux.get(_field(req, "key", str))}  # type: ignore[arg-type]


# --------------------------------------------------------------------------- client


class EmbeddedStore(MembershipStore):
    """Client of an :class:`EmbeddedStoreServer` for one run.

    One persistent connection, guarded by a lock (calls are serialised). A call that fails on a
    stale connection reconnects once; every call, including that retry, finishes within
    ``timeout`` or raises :class:`BackendConnectionError` naming the operation.
    """

    def __init__(self, host: str, port: int, run_id: str, timeout: timedelta = timedelta(seconds=5)) -> None:
        self.host, self.port = host, int(port)
        self.run_id = _check_run_id(run_id)
        self.timeout = _positive("store timeout", timeout)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False
        # What this client registered, so keepalive can re-register it after the server lost it.
        self._mine: dict[str, tuple[Member, float]] = {}

    def __repr__(self) -> str:
        return f"EmbeddedStore({self.host}:{self.port}, run_id={self.run_id!r})"

    def _request(self, op: str, **fields: object) -> dict:
        """Send one request and return the answer: the one place socket errors are translated.

        Blocks at most ``timeout``. Raises BackendConnectionError (cause chained) if the server
        cannot be reached, drops the connection twice, or answers ``ok: false``.
        """
        deadline = time.monotonic() + self.timeout.total_seconds()
        req = {"op": op, "run": self.run_id, **fields}
        with self._lock:
            if self._closed:
                raise BackendConnectionError(
                    f"embedded store {self.host}:{self.port}: {op} on a closed client"
                )
            for attempt in (1, 2):
                fresh = self._sock is None
                try:
                    if self._sock is None:
                        left = max(deadline - time.monotonic(), 0.001)
                        self._sock = socket.create_connection((self.host, self.port), timeout=left)
                        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    write_frame(self._sock, req, deadline)
                    payload = read_frame(self._sock, deadline, self.timeout.total_seconds())
                    if payload is None:
                        raise FrameError("server closed the connection")
                    answer = json.loads(payload)
                    break
                except (OSError, FrameError, ValueError) as exc:
                    self._drop()
                    # Retry once, only if an old connection may simply have gone stale.
                    if attempt == 1 and not fresh and time.monotonic() < deadline:
                        continue
                    raise BackendConnectionError(
                        f"embedded store {self.host}:{self.port} unreachable during {op} "
                        f"(run {self.run_id!r}, timeout {self.timeout.total_seconds():g} s): {exc!r}"
                    ) from exc
        if not isinstance(answer, dict) or not answer.get("ok"):
            err = answer.get("error") if isinstance(answer, dict) else answer
            raise BackendConnectionError(f"embedded store {self.host}:{self.port} rejected {op}: {err}")
        return answer

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def get_membership(self) -> Membership | None:
        """See base class."""
        d = self._request("get_membership")["membership"]
        return None if d is None else Membership.from_json(json.dumps(d))

    def cas_membership(self, expected_epoch: int, new: Membership) -> tuple[bool, Membership | None]:
        """See base class. Raises ValueError before contacting the server if ``new.epoch`` is wrong."""
        if expected_epoch < 0 or new.epoch != expected_epoch + 1:
            raise ValueError(f"new epoch {new.epoch} must be expected epoch {expected_epoch} + 1")
        a = self._request("cas_membership", expected=expected_epoch, membership=json.loads(new.to_json()))
        current = a["membership"]
        return bool(a["won"]), None if current is None else Membership.from_json(json.dumps(current))

    def register(self, member: Member, ttl: timedelta) -> None:
        """See base class."""
        secs = _positive("registration ttl", ttl).total_seconds()
        self._request("register", member=member.to_dict(), ttl=secs)
        with self._lock:
            self._mine[member.id] = (member, secs)

    def keepalive(self, member_id: str) -> None:
        """See base class. If the server lost a registration this client made (it expired, or the
        server restarted), it is registered again, at the end of the registration order."""
        with self._lock:
            mine = self._mine.get(member_id)
        extra = {} if mine is None else {"member": mine[0].to_dict(), "ttl": mine[1]}
        if self._request("keepalive", id=member_id, **extra)["reregistered"]:
            log.info(
                "embedded store: re-registered %s in run %s (registration was lost)", member_id, self.run_id
            )

    def unregister(self, member_id: str) -> None:
        """See base class."""
        with self._lock:
            self._mine.pop(member_id, None)
        self._request("unregister", id=member_id)

    def registered(self) -> list[Member]:
        """See base class."""
        return [Member.from_dict(d) for d in self._request("registered")["members"]]

    def put(self, key: str, value: str) -> None:
        """See base class."""
        if not key:
            raise ConfigError("aux key must be non-empty")
        self._request("put", key=key, value=value)

    def get(self, key: str) -> str | None:
        """See base class."""
        return self._request("get", key=key)["value"]

    def close(self) -> None:
        """See base class. Later calls raise BackendConnectionError."""
        with self._lock:
            self._closed = True
            self._drop()


# --------------------------------------------------------------------------- standalone


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT. Prints ``listening host:port`` on stdout once bound."""
    ap = argparse.ArgumentParser(description="spotnik embedded membership store")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = EmbeddedStoreServer(args.host, args.port)
    host, port = server.start()
    print(f"listening {host}:{port}", flush=True)
    try:
        while not stop.wait(0.5):  # a timed wait lets the signal handler run promptly
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
