"""The served snapshot cache (ring/serve.py) on real rings: real sockets, real processes.

* A fetch is answered by the owner's ring I/O threads while its training thread sleeps or computes
  (the owner is a separate process that calls nothing on the ring meanwhile).
* A fetch from an owner that is killed (or stopped, then dropped by the ring) fails fast with a
  FetchError naming peer, epoch and operation — well before any timeout.
* Versions: the latest publish is served, a version never goes back, ``min_version`` / name / size
  are checked, a fetch never sees a torn snapshot while the owner keeps publishing.
* Hostile input on the serve channel is refused with a logged reason and loses nothing: the ring
  keeps its membership (nobody is suspected) and the cache keeps serving. An authenticated
  non-member (a joiner prefetching before it registers) is served.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from spotnik_lightning.api import ConfigError, FetchError, RingTimeouts
from spotnik_lightning.membership import EmbeddedStoreServer, open_store
from spotnik_lightning.ring import RingGroup, wire
from spotnik_lightning.ring.serve import CHANNEL
from tests.helpers import collect_events
from tests.test_ring_unit import _ring, run_all

pytestmark = pytest.mark.timeout(120)

FAST = RingTimeouts(heartbeat_interval=timedelta(milliseconds=100), heartbeat_timeout=timedelta(seconds=1))
WORKER = Path(__file__).parent / "workers" / "serve_worker.py"
NUMEL = 1 << 20  # 4 MiB of float32


class Owner:
    """A serve_worker process: founds the ring with the test's in-process members, publishes
    ``arange(NUMEL)`` (version 7), then keeps its main thread busy for ``seconds``."""

    def __init__(self, url: str, run: str, mid: str, world: int, busy: str, seconds: float) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent / "src"),
                                                            os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, str(WORKER), url, run, mid, str(world), str(NUMEL), "7", busy,
                                      str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.events: list[dict] = []
        self._t = collect_events(self.proc, self.events)

    def wait(self, ev: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events:
                if e["ev"] == ev:
                    return e
            time.sleep(0.02)
        raise AssertionError(f"owner never reported {ev!r}: {self.events}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # by PID: the process this test started
        self.proc.wait(10)


def _members(server: EmbeddedStoreServer, run: str, ids: list[str], world: int) -> list[RingGroup]:
    groups: list[RingGroup] = [None] * len(ids)  # type: ignore[list-item]

    def make(i: int) -> None:
        groups[i] = RingGroup.create(open_store(server.url, run), world_size=world, member_id=ids[i], timeouts=FAST)

    ts = [threading.Thread(target=make, args=(i,)) for i in range(len(ids))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert all(groups), "in-process members did not found the ring"
    return groups


@pytest.mark.parametrize("busy", ["sleep", "compute"])
def test_fetch_is_served_while_the_owner_is_busy(embedded_server, busy: str) -> None:
    run = f"serve-{uuid.uuid4().hex[:6]}"
    owner = Owner(embedded_server.url, run, "owner", 2, busy, 12.0)
    groups: list[RingGroup] = []
    try:
        groups = _members(embedded_server, run, ["m0"], 2)
        me = groups[0]
        start = owner.wait("busy")
        out = torch.empty(NUMEL, dtype=torch.float32)
        expected = torch.arange(NUMEL, dtype=torch.float32)
        times = []
        for _ in range(5):
            out.zero_()
            t0 = time.time()
            assert me.fetch("owner", "model", out) == 7
            times.append(time.time() - t0)
            assert torch.equal(out, expected)
        t_end = time.time()
        print(busy, "fetch seconds", [round(t, 3) for t in times])
        assert max(times) < 2.0, times
        assert not any(e["ev"] == "idle" for e in owner.events), "the owner's thread was done before the fetches"
        assert owner.wait("idle", 30)["t"] > t_end and start["t"] < t_end - sum(times)
        assert me.epoch == 1 and me.size == 2, "a busy owner looked dead"
    finally:
        owner.stop()
        for g in groups:
            g.close()


def test_fetch_from_a_killed_or_stopped_owner_fails_fast(embedded_server) -> None:
    run = f"serve-{uuid.uuid4().hex[:6]}"
    owners = [Owner(embedded_server.url, run, f"o{i}", 4, "sleep", 60.0) for i in range(2)]
    groups: list[RingGroup] = []
    try:
        groups = _members(embedded_server, run, ["m0", "m1"], 4)
        for o in owners:
            o.wait("busy")
        me = groups[0]
        out = torch.empty(NUMEL, dtype=torch.float32)
        assert me.fetch("o0", "model", out) == 7 and me.fetch("o1", "model", out) == 7

        # killed while a fetch waits on it (stopped first, so the fetch is certainly in flight)
        owners[0].proc.send_signal(signal.SIGSTOP)
        result: dict = {}

        def fetch() -> None:
            try:
                result["version"] = me.fetch("o0", "model", out)
            except FetchError as exc:
                result["error"], result["t"] = exc, time.monotonic()

        t = threading.Thread(target=fetch)
        t.start()
        time.sleep(0.3)
        assert t.is_alive(), "the fetch from a stopped owner returned"
        kill_t = time.monotonic()
        owners[0].proc.kill()
        t.join(10)
        err = result["error"]
        print("killed: fetch failed after", round(result["t"] - kill_t, 3), "s:", err)
        assert err.gone and err.peer == "o0" and result["t"] - kill_t < 1.0
        assert "o0" in str(err) and "epoch 1" in str(err) and "fetch 'model'" in str(err)
        # once the ring dropped it, asking again fails at once
        deadline = time.monotonic() + 10
        while "o0" in me.membership.ids:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
        with pytest.raises(FetchError, match="not a live member") as info:
            me.fetch("o0", "model", out)
        assert info.value.gone and time.monotonic() - t0 < 0.1

        # stopped (silent): the fetch gives up as soon as the ring drops the owner (heartbeat
        # timeout 1 s), not after the 60 s collective timeout
        owners[1].proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(FetchError) as info:
            me.fetch("o1", "model", out)
        waited = time.monotonic() - t0
        print("stopped: fetch failed after", round(waited, 3), "s:", info.value)
        assert info.value.gone and waited < 5.0
        assert "dropped" in str(info.value) or "not a live member" in str(info.value)
    finally:
        for o in owners:
            o.stop()
        for g in groups:
            g.close()


def test_versions_and_snapshot_errors(embedded_server) -> None:
    gen = iter(_ring(embedded_server, 2, FAST, run=f"ver-{uuid.uuid4().hex[:4]}"))
    a, b = next(gen)
    try:
        out = torch.empty(6, dtype=torch.float64)
        with pytest.raises(FetchError, match="missing") as info:
            b.fetch(a.rank, "w", out)
        assert not info.value.gone
        a.publish("w", [torch.full((2, 2), 3.0, dtype=torch.float64), torch.tensor([1.0, 2.0], dtype=torch.float64)], 3)
        assert b.fetch(a.rank, "w", out) == 3
        assert out.tolist() == [3.0] * 4 + [1.0, 2.0]
        a.publish("w", torch.arange(6, dtype=torch.float64), 5)
        assert b.fetch(a.member_id, "w", out, min_version=5) == 5 and out.tolist() == list(range(6))
        a.publish("w", torch.arange(6, dtype=torch.float64) * 2, 5)  # the same version again: allowed
        assert b.fetch(a.rank, "w", out) == 5 and out[1].item() == 2.0
        with pytest.raises(ConfigError, match="version 4 < latest 5"):
            a.publish("w", torch.zeros(6, dtype=torch.float64), 4)
        assert b.fetch(a.rank, "w", out) == 5 and out[1].item() == 2.0  # the refused publish changed nothing
        with pytest.raises(FetchError, match="stale") as info:
            b.fetch(a.rank, "w", out, min_version=6)
        assert not info.value.gone
        with pytest.raises(FetchError, match="size"):
            b.fetch(a.rank, "w", torch.empty(5, dtype=torch.float64))
        as_bytes = torch.empty(48, dtype=torch.uint8)  # any dtype of the right byte size
        assert b.fetch(a.rank, "w", as_bytes) == 5 and torch.equal(as_bytes.view(torch.float64), out)
        assert a.fetch(a.rank, "w", torch.empty(6, dtype=torch.float64)) == 5  # from itself: local
        with pytest.raises(ConfigError, match="dense"):
            b.fetch(a.rank, "w", torch.empty(6, 2, dtype=torch.float64)[:, 0])

        # the owner keeps publishing while the peer fetches: never a torn snapshot
        n = 1 << 18
        stop = threading.Event()

        def publish_loop() -> None:
            v = 10
            while not stop.is_set():
                a.publish("big", torch.full((n,), float(v)), v)
                v += 1

        a.publish("big", torch.full((n,), 9.0), 9)
        pub = threading.Thread(target=publish_loop)
        pub.start()
        try:
            versions = []
            got = torch.empty(n)
            for _ in range(60):
                v = b.fetch(a.rank, "big", got)
                assert bool((got == float(v)).all()), f"torn snapshot at version {v}"
                versions.append(v)
        finally:
            stop.set()
            pub.join(10)
        assert versions == sorted(versions) and versions[-1] > versions[0], versions
        assert a.epoch == b.epoch == 1
    finally:
        gen.close()


def _serve_conn(g: RingGroup, member_id: str, secret: bytes | None = None) -> object:
    import socket

    sock = socket.create_connection(g.me.address, timeout=5)
    wire.handshake_connect(sock, secret or wire.load_secret(), g.run_id, wire.Hello(member_id, CHANNEL))
    return sock


def _closed_by_peer(sock: object, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)  # type: ignore[attr-defined]
    try:
        while sock.recv(4096):  # type: ignore[attr-defined]
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_bad_requests_on_the_serve_channel_are_refused_and_lose_nothing(embedded_server, caplog) -> None:
    gen = iter(_ring(embedded_server, 3, FAST, run=f"bad-{uuid.uuid4().hex[:4]}"))
    groups = next(gen)
    owner, fetcher = groups[0], groups[1]
    caplog.set_level(logging.WARNING, logger="spotnik.ring")
    try:
        owner.publish("model", torch.arange(100, dtype=torch.float32), 4)
        out = torch.empty(100)
        assert fetcher.fetch(owner.rank, "model", out) == 4

        from spotnik_lightning.api import ProtocolError

        with pytest.raises(ProtocolError, match="bad secret"):  # unauthenticated: refused in the handshake
            _serve_conn(owner, "m1", b"not the job secret")
        attacks = {
            "garbage header": b"\x00" * wire.HEADER.size,
            "data frame": wire.pack_header(wire.KIND_DATA, 1, 0, 0, 4) + b"abcd",
            "malformed json": wire.pack_header(wire.KIND_CTRL, 1, 0, 0, 5) + b"{nope",
            "wrong type": _ctrl({"t": "rec", "base": 1, "dead": ["m0"], "origin": "m1", "round": 1}),
            "missing field": _ctrl({"t": "get", "id": 1, "name": "model"}),
            "oversized": wire.pack_header(wire.KIND_CTRL, 1, 0, 0, wire.MAX_CTRL_BYTES + 1),
        }
        for what, frame in attacks.items():
            sock = _serve_conn(owner, "m1")  # authenticated as a member: a bad frame still only closes it
            sock.sendall(frame)
            assert _closed_by_peer(sock), f"{what}: connection left open"
            sock.close()
        assert sum("closing serve connection from m1" in r.getMessage() for r in caplog.records) == len(attacks)
        # an authenticated worker that is not (yet) a member — a joiner prefetching — is served
        sock = _serve_conn(owner, "joiner")
        sock.sendall(_ctrl({"t": "get", "id": 9, "name": "model", "nbytes": 400, "min": -1}))
        sock.settimeout(5)
        kind, _, _, _, length = wire.unpack_header(wire.recv_exact(sock, wire.HEADER.size), 0)
        reply = wire.decode_ctrl(wire.recv_exact(sock, length))
        sock.close()
        assert reply["t"] == "snap" and reply["version"] == 4, reply
        assert owner._served.rejected == len(attacks)
        # nothing lost: same membership, nobody suspected, the cache still serves, collectives work
        assert [g.epoch for g in groups] == [1, 1, 1] and all(not g.events[1:] for g in groups)
        out.zero_()
        assert fetcher.fetch(owner.rank, "model", out) == 4 and torch.equal(out, torch.arange(100.0))
        assert run_all(groups, lambda g: g.all_reduce(torch.ones(3))) == [None] * 3
    finally:
        gen.close()


def _ctrl(msg: dict) -> bytes:
    payload = wire.encode_ctrl(msg)
    return wire.pack_header(wire.KIND_CTRL, 1, 0, 0, len(payload)) + payload


def test_a_joiner_prefetches_a_members_snapshot_before_registering(embedded_server) -> None:
    run = f"pre-{uuid.uuid4().hex[:4]}"
    gen = iter(_ring(embedded_server, 2, FAST, run=run))
    groups = next(gen)
    joiner: list[RingGroup] = []
    try:
        groups[0].publish("model", torch.arange(1000, dtype=torch.float32), 12)
        out = torch.empty(1000)
        served_before = groups[0]._served.served
        t = threading.Thread(target=lambda: joiner.append(RingGroup.create(
            open_store(embedded_server.url, run), member_id="j", timeouts=FAST, prefetch=("model", out))))
        t.start()
        deadline = time.monotonic() + 30
        while not any(run_all(groups, lambda g: g.admit())):  # the members admit it at a step boundary
            assert time.monotonic() < deadline, "the joiner was not admitted"
            time.sleep(0.05)
        t.join(10)
        j = joiner[0]
        assert j.prefetched == (12, groups[0].member_id) and torch.equal(out, torch.arange(1000.0))
        assert groups[0]._served.served == served_before + 1 and j.size == 3
        # nothing published anywhere: no prefetch, the join itself is unaffected
        late: list[RingGroup] = []
        t = threading.Thread(target=lambda: late.append(RingGroup.create(
            open_store(embedded_server.url, run), member_id="k", timeouts=FAST, prefetch=("other", out))))
        t.start()
        deadline = time.monotonic() + 30
        while not any(run_all([*groups, j], lambda g: g.admit())):
            assert time.monotonic() < deadline, "the second joiner was not admitted"
            time.sleep(0.05)
        t.join(10)
        assert late[0].prefetched is None and late[0].size == 4
        joiner.extend(late)
    finally:
        for g in joiner:
            g.close()
        gen.close()
