"""Connections between ring members: outgoing links with a sender thread, and the monitor thread.

* :class:`OutLink` — one authenticated TCP connection to a peer on a channel ("ring" or "p2p").
  Frames are queued and written by a dedicated sender thread with ``sendall(memoryview)`` (no
  copy of tensor data). A send error reports the peer to ``on_error`` once.
* :class:`Monitor` — one thread multiplexing the listening socket (new connections are
  handshaken on their own thread, then read there), the UDP heartbeat socket, EOF on outgoing
  links, and a timer that sends heartbeats and checks neighbour deadlines.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from spotnik_lightning.ring import wire

log = logging.getLogger("spotnik.ring")

SendDone = Callable[[], None]


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:
            pass


class OutLink:
    """A connection this worker writes to. Thread-safe; sends are FIFO."""

    def __init__(self, peer: str, channel: str, sock: socket.socket, on_error: Callable[[str, str], None]) -> None:
        self.peer = peer
        self.channel = channel
        self.sock = sock
        self._on_error = on_error
        self._q: deque[tuple[bytes, memoryview | None, SendDone | None, bool]] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self.failed = False
        self._thread = threading.Thread(target=self._run, name=f"spotnik-send-{peer}-{channel}", daemon=True)
        self._thread.start()

    def send(self, header: bytes, payload: memoryview | None = None, done: SendDone | None = None,
             data: bool = True) -> bool:
        """Queue a frame; ``done`` runs on the sender thread once it is written. Returns False
        (and never calls ``done``) if the link already failed or closed."""
        with self._cv:
            if self._closed or self.failed:
                return False
            self._q.append((header, payload, done, data))
            self._cv.notify()
        return True

    def drop_data(self) -> None:
        """Forget queued (not yet started) data frames; control frames stay queued."""
        with self._cv:
            self._q = deque(item for item in self._q if not item[3])

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if self._closed and not self._q:
                    return
                header, payload, done, _ = self._q.popleft()
            try:
                self.sock.sendall(header)
                if payload is not None and payload.nbytes:
                    self.sock.sendall(payload)
            except OSError as exc:
                with self._cv:
                    self.failed = True
                    self._q.clear()
                if not self._closed:
                    self._on_error(self.peer, f"send to {self.peer} failed: {exc}")
                return
            if done is not None:
                done()

    def close(self, flush_timeout: float = 0.0) -> None:
        """Stop the sender (after flushing for up to ``flush_timeout`` s) and close the socket."""
        deadline = time.monotonic() + flush_timeout
        with self._cv:
            while self._q and not self.failed and time.monotonic() < deadline:
                self._cv.wait(0.01)
            self._closed = True
            self._q.clear()
            self._cv.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)


class Monitor:
    """The watchdog thread. Callbacks run on this thread and must not block for long.

    on_accept(sock, addr): a new TCP connection (the callee starts its handshake thread).
    on_heartbeat(member_id, epoch): an authentic heartbeat arrived.
    on_link_eof(peer, channel): an outgoing link was closed by the peer.
    on_tick(): every heartbeat interval (send heartbeats, check deadlines).
    """

    def __init__(self, listener: socket.socket, udp: socket.socket, secret: bytes, interval: float,
                 on_accept: Callable[[socket.socket, tuple], None],
                 on_heartbeat: Callable[[str, int], None],
                 on_link_eof: Callable[[OutLink], None],
                 on_tick: Callable[[], None]) -> None:
        self._sel = selectors.DefaultSelector()
        self._listener, self._udp, self._secret, self._interval = listener, udp, secret, interval
        self._on_accept, self._on_heartbeat, self._on_link_eof, self._on_tick = (
            on_accept, on_heartbeat, on_link_eof, on_tick)
        self._lock = threading.Lock()
        self._pending: list[tuple[str, OutLink]] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(listener, selectors.EVENT_READ, "listen")
        self._sel.register(udp, selectors.EVENT_READ, "udp")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="spotnik-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, link: OutLink) -> None:
        """Report EOF on ``link`` (its peer never writes, so readable means closed)."""
        with self._lock:
            self._pending.append(("add", link))
        self._wake()

    def unwatch(self, link: OutLink) -> None:
        with self._lock:
            self._pending.append(("del", link))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for op, link in pending:
            try:
                if op == "add":
                    self._sel.register(link.sock, selectors.EVENT_READ, link)
                else:
                    self._sel.unregister(link.sock)
            except (KeyError, ValueError, OSError):
                pass

    def _run(self) -> None:
        next_tick = time.monotonic()
        while not self._stop:
            self._apply_pending()
            timeout = max(0.0, next_tick - time.monotonic())
            try:
                events = self._sel.select(timeout)
            except OSError:
                events = []
            for key, _ in events:
                tag = key.data
                if tag == "wake":
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                elif tag == "listen":
                    try:
                        sock, addr = self._listener.accept()
                    except OSError:
                        continue
                    self._on_accept(sock, addr)
                elif tag == "udp":
                    self._read_udp()
                else:
                    self._check_eof(tag)
            if time.monotonic() >= next_tick:
                try:
                    self._on_tick()
                except Exception:  # the watchdog must survive a bad tick
                    log.exception("heartbeat tick failed")
                next_tick = time.monotonic() + self._interval

    def _read_udp(self) -> None:
        for _ in range(64):
            try:
                data, _ = self._udp.recvfrom(512)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            hb = wire.unpack_heartbeat(self._secret, data)
            if hb is not None:
                self._on_heartbeat(hb[1], hb[0])

    def _check_eof(self, link: OutLink) -> None:
        try:
            data = link.sock.recv(1, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        try:
            self._sel.unregister(link.sock)
        except (KeyError, ValueError, OSError):
            pass
        if data:
            log.warning("peer %s wrote on a send-only link; treating it as broken", link.peer)
        self._on_link_eof(link)

    def send_heartbeat(self, addr: tuple[str, int], epoch: int, member_id: str) -> None:
        try:
            self._udp.sendto(wire.pack_heartbeat(self._secret, epoch, member_id), addr)
        except OSError:
            pass

    def stop(self) -> None:
        self._stop = True
        self._wake()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
