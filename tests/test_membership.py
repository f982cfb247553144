"""Membership stores against real servers: one contract suite for embedded and etcd, then the
failure modes (bad frames, unreachable stores, bad URLs, etcd restarts) and the etcd key layout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from helpers import free_port, wait_until

from spotnik_lightning.api import BackendConnectionError, ConfigError
from spotnik_lightning.membership import (
    EmbeddedStore,
    EmbeddedStoreServer,
    EtcdStore,
    Member,
    Membership,
    MembershipStore,
    open_store,
    parse_endpoints,
)

pytestmark = pytest.mark.timeout(60)

MakeStore = Callable[..., MembershipStore]


def member(i: int, tier: str = "transient") -> Member:
    return Member(f"w{i}", "127.0.0.1", 30000 + i, tier)


def ids(store: MembershipStore) -> list[str]:
    return [m.id for m in store.registered()]


def _factory(url: str) -> Iterator[MakeStore]:
    opened: list[MembershipStore] = []

    def make(run_id: str = "run-a", timeout: timedelta = timedelta(seconds=5)) -> MembershipStore:
        store = open_store(url, run_id, timeout)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture(params=["embedded", "etcd"])
def make_store(request: pytest.FixtureRequest) -> Iterator[MakeStore]:
    """Factory of store clients on a fresh server of each kind; every client closed at teardown."""
    server = request.getfixturevalue(f"{request.param}_server")
    yield from _factory(server.url)


@pytest.fixture
def make_etcd_store(etcd_server) -> Iterator[MakeStore]:
    yield from _factory(etcd_server.url)


class TestStoreContract:
    """What every MembershipStore must do (habit 11: one suite, every backend)."""

    def test_empty_store(self, make_store: MakeStore) -> None:
        s = make_store()
        assert s.get_membership() is None
        assert s.registered() == []
        assert s.get("nothing") is None
        assert s.cas_membership(3, Membership(4, (member(0),))) == (False, None)
        assert s.get_membership() is None

    def test_first_cas_wins(self, make_store: MakeStore) -> None:
        s = make_store()
        m1 = Membership(1, (member(0), member(1)))
        assert s.cas_membership(0, m1) == (True, m1)
        assert s.get_membership() == m1

    def test_stale_cas_loses_and_returns_winner(self, make_store: MakeStore) -> None:
        a, b = make_store(), make_store()
        m1 = Membership(1, (member(0), member(1)))
        assert a.cas_membership(0, m1)[0]
        assert b.cas_membership(0, Membership(1, (member(1),))) == (False, m1)
        m2 = m1.without({"w1"}, epoch=2)
        assert b.cas_membership(1, m2) == (True, m2)
        assert a.cas_membership(1, Membership(2, (member(0), member(2)))) == (False, m2)
        assert a.get_membership() == b.get_membership() == m2

    def test_concurrent_cas_has_exactly_one_winner(self, make_store: MakeStore) -> None:
        stores = [make_store() for _ in range(8)]
        barrier = threading.Barrier(len(stores))
        results: list[tuple[bool, Membership | None]] = [(False, None)] * len(stores)

        def attempt(i: int) -> None:
            barrier.wait(10)
            results[i] = stores[i].cas_membership(0, Membership(1, (member(i),)))

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(len(stores))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads)
        winners = [i for i, (won, _) in enumerate(results) if won]
        assert len(winners) == 1
        expected = Membership(1, (member(winners[0]),))
        assert all(current == expected for _, current in results)
        assert stores[0].get_membership() == expected

    def test_new_epoch_must_be_expected_plus_one(self, make_store: MakeStore) -> None:
        s = make_store()
        with pytest.raises(ValueError, match="expected epoch"):
            s.cas_membership(0, Membership(2, (member(0),)))
        with pytest.raises(ValueError, match="expected epoch"):
            s.cas_membership(1, Membership(1, (member(0),)))
        assert s.get_membership() is None

    def test_register_registered_unregister(self, make_store: MakeStore) -> None:
        s, other = make_store(), make_store()
        for i in range(3):
            s.register(member(i), timedelta(seconds=30))
        assert other.registered() == [member(0), member(1), member(2)]
        moved = Member("w1", "127.0.0.2", 31001, "reliable")
        s.register(moved, timedelta(seconds=30))  # replaces the record, keeps its place
        assert other.registered() == [member(0), moved, member(2)]
        s.unregister("w1")
        s.unregister("w1")  # idempotent
        other.unregister("never-registered")
        other.keepalive("never-registered")  # no-op, no error
        assert ids(other) == ["w0", "w2"]

    def test_registration_expires_without_keepalive(self, make_store: MakeStore) -> None:
        s = make_store()
        s.register(member(0), timedelta(seconds=1))
        s.register(member(1), timedelta(seconds=30))
        assert ids(s) == ["w0", "w1"]
        wait_until(lambda: ids(s) == ["w1"], timeout=8, what="the 1 s registration of w0 to expire")

    def test_keepalive_keeps_registration_past_ttl(self, make_store: MakeStore) -> None:
        s = make_store()
        s.register(member(0), timedelta(seconds=1))
        end = time.monotonic() + 2.2
        while time.monotonic() < end:
            s.keepalive("w0")
            assert ids(s) == ["w0"]
            time.sleep(0.2)

    def test_aux_values(self, make_store: MakeStore) -> None:
        s = make_store()
        assert s.get("meta") is None
        s.put("meta", '{"lr": 0.1}')
        s.put("other/key", "x")
        s.put("meta", "v2")
        assert (s.get("meta"), s.get("other/key")) == ("v2", "x")
        with pytest.raises(ConfigError):
            s.put("", "x")

    def test_runs_are_isolated(self, make_store: MakeStore) -> None:
        a, b = make_store("run-a"), make_store("run-b")
        a.cas_membership(0, Membership(1, (member(0),)))
        a.register(member(0), timedelta(seconds=30))
        a.put("k", "a")
        assert (b.get_membership(), b.registered(), b.get("k")) == (None, [], None)
        m1b = Membership(1, (member(5),))
        assert b.cas_membership(0, m1b) == (True, m1b)
        assert a.get_membership() == Membership(1, (member(0),))


# --------------------------------------------------------------------------- embedded server


def _frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


def _closed_by_server(raw: socket.socket) -> bool:
    """True when the server closed ``raw``: EOF, or a reset (it closed with our bytes unread)."""
    try:
        return raw.recv(1024) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "garbage, reason",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "oversized"),  # "GET " read as a ~1.2 GB length
        (struct.pack("!I", 2 << 20) + b"{}", "oversized"),
        (struct.pack("!I", 100) + b'{"op": "pi', "truncated"),
        (_frame(b"\xff\xfe not json"), "not JSON"),
        (_frame(b"[1, 2, 3]"), "not a JSON object"),
    ],
    ids=["http", "oversized", "truncated", "bad-json", "not-object"],
)
def test_embedded_server_closes_bad_connections_and_keeps_serving(
    embedded_server: EmbeddedStoreServer, caplog: pytest.LogCaptureFixture, garbage: bytes, reason: str
) -> None:
    host, port = embedded_server.address
    bystander = EmbeddedStore(host, port, "run-a")
    bystander.put("k", "before")  # an established connection that must survive
    with socket.create_connection((host, port), timeout=5) as raw:
        raw.sendall(garbage)
        if reason == "truncated":
            raw.shutdown(socket.SHUT_WR)
        assert _closed_by_server(raw)  # a timeout (5 s) would raise instead
    wait_until(
        lambda: any(reason in r.getMessage() for r in caplog.records if r.name == "spotnik.store"),
        timeout=5,
        what=f"a logged reason containing {reason!r}",
    )
    assert bystander.get("k") == "before"
    with EmbeddedStore(host, port, "run-a") as fresh:
        assert fresh.get("k") == "before"
    bystander.close()


def test_embedded_server_drops_stalled_frame() -> None:
    with EmbeddedStoreServer(frame_timeout=0.3) as server:
        with socket.create_connection(server.address, timeout=5) as raw:
            raw.sendall(struct.pack("!I", 50)[:2])  # half a header, then silence
            t0 = time.monotonic()
            assert _closed_by_server(raw)
            assert time.monotonic() - t0 < 3
        with EmbeddedStore(*server.address, "r") as s:
            assert s.get_membership() is None


def test_embedded_client_reconnects_and_reregisters_after_server_restart() -> None:
    server = EmbeddedStoreServer()
    host, port = server.start()
    store = EmbeddedStore(host, port, "run-a")
    try:
        store.register(member(0), timedelta(seconds=30))
        server.stop()
        with pytest.raises(BackendConnectionError, match="during keepalive"):
            store.keepalive("w0")
        server = EmbeddedStoreServer(host, port)  # same port, empty state
        server.start()
        assert store.registered() == []
        store.keepalive("w0")  # the lost registration comes back
        assert ids(store) == ["w0"]
    finally:
        store.close()
        server.stop()


def test_embedded_store_standalone_process() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    module = "spotnik_lightning.membership.embedded"
    cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(30)
        assert line and line[0].startswith("listening "), f"no 'listening' line: {line}"
        host, port = parse_endpoints(line[0].split()[1])[0]
        with EmbeddedStore(host, port, "r") as s:
            s.put("k", "v")
            assert s.get("k") == "v"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


# --------------------------------------------------------------------------- failures and URLs


@pytest.mark.parametrize("scheme", ["etcd", "embedded"])
def test_unreachable_store_raises_within_timeout(scheme: str) -> None:
    port = free_port()  # nothing listens here
    with open_store(f"{scheme}://127.0.0.1:{port}", "run-a", timedelta(seconds=2)) as s:
        for op, call in [
            ("get_membership", s.get_membership),
            ("register", lambda: s.register(member(0), timedelta(seconds=5))),
            ("cas_membership", lambda: s.cas_membership(0, Membership(1, (member(0),)))),
        ]:
            t0 = time.monotonic()
            with pytest.raises(BackendConnectionError, match=f"during {op}") as info:
                call()
            assert time.monotonic() - t0 < 2.5
            assert f"127.0.0.1:{port}" in str(info.value)
            assert info.value.__cause__ is not None


@pytest.mark.parametrize(
    "url",
    [
        "",
        "etcd://",
        "etcd://127.0.0.1",
        "etcd://127.0.0.1:2379,",
        "etcd://:2379",
        "etcd://h:0",
        "etcd://h:65536",
        "etcd://h:port",
        "http://127.0.0.1:2379",
        "embedded://a:1,b:2",
        "localhost",
        "::1:2379",
    ],
)
def test_malformed_urls_raise_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="bad membership store url"):
        open_store(url, "run-a")


def test_open_store_forms_and_parse_endpoints() -> None:
    assert parse_endpoints("a:1, [::1]:2,b.c:65535") == [("a", 1), ("::1", 2), ("b.c", 65535)]
    for url in ("127.0.0.1:7000", "embedded://127.0.0.1:7000"):
        s = open_store(url, "r")
        assert isinstance(s, EmbeddedStore) and (s.host, s.port) == ("127.0.0.1", 7000)
    e = open_store("etcd://h1:1,h2:2", "r")
    assert isinstance(e, EtcdStore) and e.endpoints == [("h1", 1), ("h2", 2)]
    e.close()
    with pytest.raises(ConfigError, match="run_id"):
        open_store("h:1", "a/b")
    with pytest.raises(ConfigError, match="timeout"):
        open_store("h:1", "r", timedelta(0))


# --------------------------------------------------------------------------- etcd specifics


def test_etcd_fails_over_to_next_endpoint(etcd_server, make_etcd_store: MakeStore) -> None:
    dead = free_port()
    s = open_store(f"etcd://127.0.0.1:{dead},127.0.0.1:{etcd_server.port}", "run-a", timedelta(seconds=2))
    try:
        m1 = Membership(1, (member(0),))
        assert s.cas_membership(0, m1) == (True, m1)
        assert make_etcd_store().get_membership() == m1
    finally:
        s.close()


def _reachable(store: MembershipStore) -> bool:
    try:
        store.get_membership()
    except BackendConnectionError:
        return False
    return True


def test_etcd_restart_mid_run(etcd_server, make_etcd_store: MakeStore) -> None:
    s = make_etcd_store(timeout=timedelta(seconds=2))
    m1 = Membership(1, (member(0),))
    s.cas_membership(0, m1)
    s.register(member(0), timedelta(seconds=1))

    etcd_server.stop()
    for op, call in [("get_membership", s.get_membership), ("keepalive", lambda: s.keepalive("w0"))]:
        t0 = time.monotonic()
        with pytest.raises(BackendConnectionError, match=op):
            call()
        assert time.monotonic() - t0 < 2.5

    etcd_server.start()
    # grpc reconnects with a (shortened) backoff: the first calls may still fail fast.
    wait_until(lambda: _reachable(s), timeout=5, what="the store to answer after the etcd restart")
    assert s.get_membership() == m1
    # etcd renews leases on restart; with no keepalive the registration then lapses...
    wait_until(lambda: ids(s) == [], timeout=8, what="the unrefreshed registration to expire")
    s.keepalive("w0")  # ...and keepalive brings it back on a new lease
    assert s.registered() == [member(0)]
    m2 = Membership(2, (member(0), member(1)))
    assert s.cas_membership(1, m2) == (True, m2)


def _read_prefix(etcd_server, prefix: str) -> dict[str, str]:
    """Every key under ``prefix`` as etcd users see it: with etcdctl if installed, else pyetcd."""
    etcdctl = shutil.which("etcdctl") or ("/usr/bin/etcdctl" if os.path.exists("/usr/bin/etcdctl") else None)
    if etcdctl:
        out = subprocess.run(
            [etcdctl, f"--endpoints=127.0.0.1:{etcd_server.port}", "get", "--prefix", prefix],
            env={**os.environ, "ETCDCTL_API": "3"},
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()
        return dict(zip(out[::2], out[1::2], strict=True))
    import pyetcd

    client = pyetcd.client("127.0.0.1", etcd_server.port, timeout=5)
    try:
        return {meta.key.decode(): value.decode() for value, meta in client.get_prefix(prefix)}
    finally:
        client.close()


def test_etcd_key_layout(etcd_server, make_etcd_store: MakeStore) -> None:
    s = make_etcd_store("layout-run")
    m1 = Membership(1, (member(0), member(1)))
    m2 = m1.without({"w1"}, epoch=2)
    s.cas_membership(0, m1)
    s.cas_membership(1, m2)
    s.register(member(7), timedelta(seconds=30))
    s.put("meta", "hello")
    p = "/spotnik/layout-run/"
    keys = _read_prefix(etcd_server, p)
    assert keys == {
        p + "epoch": "2",
        p + "membership": m2.to_json(),
        p + "history/0000000001": m1.to_json(),
        p + "history/0000000002": m2.to_json(),
        p + "members/w7": json.dumps(member(7).to_dict(), sort_keys=True),
        p + "aux/meta": "hello",
    }
