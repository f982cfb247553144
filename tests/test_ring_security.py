"""Hostile input on a member's ring port: bad handshakes and malformed frames close only the
offending connection with a logged reason, and the ring carries on untouched.

Three RingGroups run in threads of the test process on an embedded store. Every attack connects
to a member's ring port (``group.me.port``) and checks three things: the member closes the
connection (and, for a refused handshake, tells the connector why), a warning naming the reason is
logged on ``spotnik.ring``, and the survivors are unaffected (same epoch, same membership, a
correct all_reduce on every member).

Post-handshake attacks authenticate as a NON-member id ("intruder"): a malformed frame from a
ring member is, by design, that member failing (one test checks the resulting repair).

Repair traffic (reconcile, accept, exclusion, leave) from a non-member is refused like any other
malformed input: it can neither start, steer nor end a repair.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
from helpers import wait_until

from spotnik_lightning.api import (
    EpochFencedError,
    MembershipChanged,
    MembershipTimeoutError,
    ProtocolError,
    RingTimeouts,
)
from spotnik_lightning.membership import EmbeddedStoreServer, open_store
from spotnik_lightning.ring import RingGroup, wire
from spotnik_lightning.ring.state import FENCED, RUNNING

pytestmark = pytest.mark.timeout(90)

SECRET = b"ring-security-test-secret"
WORLD = 3
TIMEOUTS = RingTimeouts(
    heartbeat_timeout=timedelta(seconds=2),
    connect=timedelta(seconds=3),
    repair=timedelta(seconds=20),
    collective=timedelta(seconds=20),
    join=timedelta(seconds=20),
    bootstrap=timedelta(seconds=20),
)
LOGGER = "spotnik.ring"

# the handshake structs, spelled out here so the test does not lean on wire's private names
CHALLENGE = struct.Struct("!4sH16s")  # magic, version, nonce_a
RESPONSE = struct.Struct("!4sH16s32sBBB")  # magic, version, nonce_c, mac, len(run), len(id), len(channel)
VERDICT = struct.Struct("!B32s")  # ok, proof (or reason length in the first byte when refused)


# --------------------------------------------------------------------------- helpers


def on_all(items: Sequence[Any], fn: Callable[[int, Any], Any], timeout: float = 40.0) -> list[Any]:
    """Run ``fn(i, item)`` for every item concurrently (one thread each); return the results in
    order. Re-raises the first exception; fails if a call is still running after ``timeout`` s."""
    results: list[Any] = [None] * len(items)
    errors: list[BaseException | None] = [None] * len(items)

    def run(i: int) -> None:
        try:
            results[i] = fn(i, items[i])
        except BaseException as exc:  # handed to the caller
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise AssertionError(f"calls {stuck} still running after {timeout} s")
    for exc in errors:
        if exc is not None:
            raise exc
    return results


def all_reduce_everywhere(groups: Sequence[RingGroup], changed: bool = False) -> list[torch.Tensor]:
    """Every group all-reduces a tensor holding (member index + 1); returns the results. With
    ``changed``, the membership changed since the last collective: by contract each member's first
    collective then raises MembershipChanged once, and is retried."""

    def reduce(_: int, g: RingGroup) -> torch.Tensor:
        for attempt in range(2):
            t = torch.full((1000,), float(int(g.member_id[1:]) + 1))
            try:
                g.all_reduce(t)
                return t
            except MembershipChanged:
                if not changed or attempt:
                    raise
        raise AssertionError("unreachable")

    return on_all(groups, reduce)


def assert_healthy(groups: Sequence[RingGroup], epoch: int, ids: Sequence[str], changed: bool = False) -> None:
    """Every group is running at ``epoch`` with exactly ``ids`` and computes a correct all_reduce."""
    for g in groups:
        assert g.state == RUNNING, f"{g.member_id} is {g.state}"
        assert g.epoch == epoch, f"{g.member_id} at epoch {g.epoch}, expected {epoch}"
        assert sorted(g.membership.ids) == sorted(ids), f"{g.member_id} sees {g.membership.ids}"
    expected = float(sum(int(i[1:]) + 1 for i in ids))
    for g, t in zip(groups, all_reduce_everywhere(groups, changed), strict=True):
        assert torch.equal(t, torch.full((1000,), expected)), f"{g.member_id}: {t[:4]} != {expected}"
    # the collective itself must not have changed anything either
    for g in groups:
        assert g.epoch == epoch and g.state == RUNNING, f"{g.member_id}: {g.state} at epoch {g.epoch}"


def connect(g: RingGroup, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", g.me.port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def expect_closed(sock: socket.socket, timeout: float = 8.0) -> bytes:
    """Read until the member closes the connection (EOF or reset); return what it sent.
    Fails if the connection is still open after ``timeout`` s."""
    got = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"member kept the connection open for {timeout} s (got {bytes(got)!r})")
            sock.settimeout(left)
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                return bytes(got)
            if not chunk:
                return bytes(got)
            got += chunk
    finally:
        sock.close()


def read_challenge(sock: socket.socket) -> bytes:
    magic, version, nonce_a = CHALLENGE.unpack(wire.recv_exact(sock, CHALLENGE.size))
    assert magic == b"SPTK" and version == wire.PROTOCOL_VERSION
    return nonce_a


def read_refusal(sock: socket.socket) -> str:
    """The acceptor's refusal verdict: ok byte 0, reason length in the proof's first byte."""
    ok, proof = VERDICT.unpack(wire.recv_exact(sock, VERDICT.size))
    assert ok == 0, "the member accepted a handshake it should have refused"
    return wire.recv_exact(sock, proof[0]).decode()


def mac(secret: bytes, *parts: bytes) -> bytes:
    """The handshake MAC (as wire computes it): HMAC-SHA256 over the parts joined with NUL bytes."""
    return hmac.new(secret, b"\x00".join(parts), hashlib.sha256).digest()


def authenticated(g: RingGroup, member_id: str = "intruder", channel: str = "ring") -> socket.socket:
    """A connection to ``g`` that passed the real handshake (right secret and run id)."""
    sock = connect(g)
    wire.handshake_connect(sock, SECRET, g.run_id, wire.Hello(member_id, channel))
    return sock


def wait_warning(caplog: pytest.LogCaptureFixture, *needles: str, timeout: float = 5.0) -> str:
    """Wait for a WARNING+ record on spotnik.ring containing every needle; return its message."""
    found: list[str] = []

    def seen() -> bool:
        for rec in caplog.records:
            if rec.name == LOGGER and rec.levelno >= logging.WARNING:
                msg = rec.getMessage()
                if all(n in msg for n in needles):
                    found.append(msg)
                    return True
        return False

    wait_until(seen, timeout, f"a warning on {LOGGER} containing {needles}; got "
                              f"{[r.getMessage() for r in caplog.records if r.name == LOGGER]}")
    return found[0]


# --------------------------------------------------------------------------- fixtures


def make_ring(server: EmbeddedStoreServer, n: int = WORLD) -> list[RingGroup]:
    run_id = f"sec-{uuid.uuid4().hex[:8]}"
    stores = [open_store(server.url, run_id) for _ in range(n)]
    made: list[RingGroup | None] = [None] * n

    def create(i: int, store: Any) -> RingGroup:
        g = RingGroup.create(store, world_size=n, member_id=f"m{i}", secret=SECRET, timeouts=TIMEOUTS,
                             chunk_bytes=64 << 10)
        made[i] = g
        return g

    try:
        return on_all(stores, create)
    except BaseException:
        for g in made:
            if g is not None:
                g.close()
        for s in stores:
            s.close()
        raise


@pytest.fixture
def ring(embedded_server: EmbeddedStoreServer, caplog: pytest.LogCaptureFixture) -> Iterator[list[RingGroup]]:
    caplog.set_level(logging.INFO, logger=LOGGER)
    groups = make_ring(embedded_server)
    try:
        assert_healthy(groups, 1, [f"m{i}" for i in range(WORLD)])
        caplog.clear()
        yield groups
    finally:
        on_all(groups, lambda _, g: g.close(), timeout=20)
        for g in groups:
            g.store.close()


IDS = [f"m{i}" for i in range(WORLD)]


def assert_untouched(groups: list[RingGroup]) -> None:
    assert_healthy(groups, 1, IDS)
    for g in groups:
        assert [e.kind for e in g.events] == ["bootstrap"], f"{g.member_id} events: {g.events}"


# --------------------------------------------------------------------------- handshake attacks


def test_garbage_bytes_are_refused(ring: list[RingGroup], caplog: pytest.LogCaptureFixture) -> None:
    target = ring[1]
    sock = connect(target)
    sock.sendall(secrets.token_bytes(RESPONSE.size + 40).replace(b"SPTK", b"XXXX"))
    sent_back = expect_closed(sock)
    assert sent_back[:4] == b"SPTK" and len(sent_back) == CHALLENGE.size, sent_back  # only the challenge
    wait_warning(caplog, "refused ring connection", "bad magic")
    assert_untouched(ring)


def test_truncated_handshake_response_is_dropped(ring: list[RingGroup], caplog: pytest.LogCaptureFixture) -> None:
    target = ring[0]
    sock = connect(target)
    nonce_a = read_challenge(sock)
    names = [target.run_id.encode(), b"intruder", b"ring"]
    m = mac(SECRET, b"c", nonce_a, b"n" * 16, b"1", *names)
    full = RESPONSE.pack(b"SPTK", wire.PROTOCOL_VERSION, b"n" * 16, m, *map(len, names)) + b"".join(names)
    sock.sendall(full[:30])
    sock.shutdown(socket.SHUT_WR)  # "then closed": the member sees EOF mid-response
    assert expect_closed(sock) == b""
    wait_warning(caplog, "refused ring connection", "connection closed after 30")
    assert_untouched(ring)


def test_wrong_secret_is_refused_with_reason(ring: list[RingGroup], caplog: pytest.LogCaptureFixture) -> None:
    target = ring[2]
    sock = connect(target)
    with pytest.raises(ProtocolError, match="bad secret"):
        wire.handshake_connect(sock, b"not-the-secret", target.run_id, wire.Hello("intruder", "ring"))
    assert expect_closed(sock) == b""
    wait_warning(caplog, "refused ring connection", "bad secret")
    assert_untouched(ring)


def test_wrong_protocol_version_is_refused_with_reason(ring: list[RingGroup],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    target = ring[0]
    sock = connect(target)
    nonce_a = read_challenge(sock)
    nonce_c = secrets.token_bytes(16)
    names = [target.run_id.encode(), b"intruder", b"ring"]
    # a correct MAC for version 99: only the version is wrong
    m = mac(SECRET, b"c", nonce_a, nonce_c, b"99", *names)
    sock.sendall(RESPONSE.pack(b"SPTK", 99, nonce_c, m, *map(len, names)) + b"".join(names))
    reason = read_refusal(sock)
    assert "protocol version 99" in reason, reason
    assert expect_closed(sock) == b""
    wait_warning(caplog, "refused ring connection", "protocol version 99")
    assert_untouched(ring)


def test_wrong_run_id_is_refused_with_reason(ring: list[RingGroup], caplog: pytest.LogCaptureFixture) -> None:
    target = ring[1]
    sock = connect(target)
    with pytest.raises(ProtocolError, match="run id 'some-other-run'"):
        wire.handshake_connect(sock, SECRET, "some-other-run", wire.Hello("intruder", "ring"))
    assert expect_closed(sock) == b""
    wait_warning(caplog, "refused ring connection", "run id")
    assert_untouched(ring)


def test_silent_connection_times_out(ring: list[RingGroup], caplog: pytest.LogCaptureFixture) -> None:
    """A connector that never answers the challenge is dropped after the connect timeout."""
    sock = connect(ring[0], timeout=TIMEOUTS.connect.total_seconds() + 5)
    read_challenge(sock)
    assert expect_closed(sock, timeout=TIMEOUTS.connect.total_seconds() + 5) == b""
    wait_warning(caplog, "refused ring connection", "timed out")
    assert_untouched(ring)


# --------------------------------------------------------------------------- post-handshake attacks

DATA_LIMIT = 64 << 10  # the ring's chunk_bytes


def _frame(kind: int = wire.KIND_CTRL, length: int = 0, magic: bytes = b"SPTK", epoch: int = 1) -> bytes:
    return wire.HEADER.pack(magic, kind, epoch, 0, 0, length)


POST_HANDSHAKE = {
    "oversized-data": (_frame(wire.KIND_DATA, DATA_LIMIT + 1), f"oversized frame: {DATA_LIMIT + 1} bytes"),
    "oversized-ctrl": (_frame(wire.KIND_CTRL, wire.MAX_CTRL_BYTES + 1), "oversized frame"),
    "bad-magic": (_frame(magic=b"EVIL"), "bad frame magic"),
    "unknown-kind": (_frame(kind=7), "unknown frame kind 7"),
    "malformed-json": (_frame(length=9) + b"{not json", "malformed control frame"),
    "not-utf8": (_frame(length=4) + b"\xff\xfe\xfd\xfc", "malformed control frame"),
    "json-without-type": (_frame(length=7) + b'{"x":1}', "control frame without a type"),
    "json-array": (_frame(length=2) + b"[]", "control frame without a type"),
    "malformed-join": (_frame(length=19) + b'{"t":"join","x":[]}', "malformed 'join' message"),
}


@pytest.mark.parametrize("attack", sorted(POST_HANDSHAKE))
def test_malformed_frame_from_authenticated_non_member(ring: list[RingGroup], caplog: pytest.LogCaptureFixture,
                                                       attack: str) -> None:
    payload, reason = POST_HANDSHAKE[attack]
    sock = authenticated(ring[1])
    sock.sendall(payload)
    assert expect_closed(sock) == b""
    wait_warning(caplog, "closing connection from intruder", reason)
    assert_untouched(ring)


@pytest.mark.parametrize("cut", ["header", "payload"])
def test_truncated_frame_then_close(ring: list[RingGroup], cut: str) -> None:
    """A frame cut short by EOF is a lost connection: the member closes its side, nobody else
    notices (the sender is no member, so there is nothing to repair)."""
    sock = authenticated(ring[2])
    body = b'{"t":"lv","base":1}'
    frame = _frame(length=len(body)) + body
    sock.sendall(frame[: wire.HEADER.size // 2] if cut == "header" else frame[:-5])
    sock.shutdown(socket.SHUT_WR)
    assert expect_closed(sock) == b""
    assert_untouched(ring)


def test_intruder_control_message_is_harmless(ring: list[RingGroup], caplog: pytest.LogCaptureFixture) -> None:
    """A well-formed 'leave' from a non-member is refused: connection closed, ring untouched."""
    sock = authenticated(ring[0])
    body = b'{"t":"lv","base":1}'
    sock.sendall(_frame(length=len(body)) + body)
    assert expect_closed(sock) == b""
    wait_warning(caplog, "closing connection from intruder", "not a member")
    assert_untouched(ring)


# --------------------------------------------------------------------------- documented consequences


def test_garbage_from_an_authenticated_member_changes_the_epoch(ring: list[RingGroup],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A malformed frame on a connection authenticated as member m2 is m2 failing: the ring
    repairs to a new epoch with exactly one committed membership; every worker ends either
    running in it (and all_reduces correctly with the others) or fenced out.

    The forger holds the secret and impersonates a healthy m2, so m0 and m2 may accuse each other;
    the epoch CAS decides which side continues (usually m0 and m1: m2 is told it is excluded).
    What must hold is what is asserted: one membership, everyone else fenced."""
    accused = ring[2]
    sock = authenticated(ring[0], member_id=accused.member_id)
    sock.sendall(_frame(magic=b"EVIL"))
    assert expect_closed(sock) == b""
    wait_warning(caplog, f"closing connection from {accused.member_id}", "bad frame magic")

    def settled() -> bool:
        stored = ring[0].store.get_membership()
        if stored is None or stored.epoch < 2:
            return False
        return all(g.state == FENCED or (g.state == RUNNING and g.membership == stored) for g in ring)

    wait_until(settled, 25, "every worker to be fenced or running in the new epoch")
    stored = ring[0].store.get_membership()
    assert stored is not None
    running = [g for g in ring if g.state == RUNNING]
    fenced = [g for g in ring if g.state == FENCED]
    assert running, "nobody survived"
    assert sorted(g.member_id for g in running) == sorted(stored.ids), (stored, [g.state for g in ring])
    assert_healthy(running, stored.epoch, list(stored.ids), changed=True)
    for g in fenced:
        assert g.member_id not in stored.ids
        with pytest.raises(EpochFencedError):
            g.all_reduce(torch.ones(4))
    assert accused.member_id not in stored.ids or len(stored.ids) < WORLD
    assert sorted(g.member_id for g in fenced) == sorted(set(g.member_id for g in ring) - set(stored.ids))


def _send_ctrl_as_intruder(g: RingGroup, body: bytes) -> socket.socket:
    sock = authenticated(g)
    sock.sendall(_frame(length=len(body), epoch=g.epoch) + body)
    return sock


def test_malformed_reconcile_from_non_member_leaves_ring_running(ring: list[RingGroup],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    sock = _send_ctrl_as_intruder(ring[0], b'{"t":"rec","base":1,"dead":[]}')  # no origin, no round
    assert expect_closed(sock) == b""
    wait_warning(caplog, "closing connection from intruder", "not a member")
    time.sleep(1.0)
    assert [g.state for g in ring] == [RUNNING] * WORLD
    assert_untouched(ring)


def test_reconcile_token_of_non_member_is_not_forwarded(ring: list[RingGroup]) -> None:
    before = sum(g.messages_sent for g in ring)
    sock = _send_ctrl_as_intruder(ring[0], b'{"t":"rec","base":1,"dead":[],"origin":"intruder","round":1}')
    time.sleep(1.0)
    sock.close()
    sent = sum(g.messages_sent for g in ring) - before
    assert sent <= WORLD, f"the ring forwarded the intruder's token {sent} times in 1 s"
    assert [g.state for g in ring] == [RUNNING] * WORLD
    assert_untouched(ring)


def test_exclusion_notice_from_non_member_is_ignored(ring: list[RingGroup]) -> None:
    sock = _send_ctrl_as_intruder(ring[0], b'{"t":"ex","base":1,"reason":"forged"}')
    time.sleep(0.5)
    sock.close()
    assert [g.state for g in ring] == [RUNNING] * WORLD
    assert_untouched(ring)


def test_wrong_secret_cannot_join(ring: list[RingGroup], embedded_server: EmbeddedStoreServer,
                                  caplog: pytest.LogCaptureFixture) -> None:
    """A worker with another secret cannot enter a running ring: its join requests are refused
    at the handshake ("bad secret" on both sides) and the join times out."""
    joiner_store = open_store(embedded_server.url, ring[0].run_id)
    t0 = time.monotonic()
    try:
        with pytest.raises(MembershipTimeoutError, match="not admitted"):
            RingGroup.create(joiner_store, member_id="m9", secret=b"another-secret",
                             timeouts=RingTimeouts(heartbeat_timeout=timedelta(seconds=2),
                                                   connect=timedelta(seconds=2), join=timedelta(seconds=3)))
    finally:
        joiner_store.close()
    assert time.monotonic() - t0 < 15
    wait_warning(caplog, "refused ring connection", "bad secret")
    wait_warning(caplog, "handshake with", "bad secret")  # the joiner's side names the refusal
    assert on_all(ring, lambda _, g: g.admit()) == [[]] * WORLD  # nobody was asked to admit it
    assert_untouched(ring)
