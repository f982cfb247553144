"""In-process ring tests: several RingGroups as threads of the pytest process (real sockets)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch

from spotnik_lightning.api import ConfigError, MembershipChanged, RingBrokenError, RingTimeouts
from spotnik_lightning.membership import EmbeddedStoreServer, open_store
from spotnik_lightning.ring import RingGroup, plans

CALM = RingTimeouts(heartbeat_interval=timedelta(milliseconds=100), heartbeat_timeout=timedelta(seconds=2))


def run_all(groups: list[RingGroup], fn: Callable[[RingGroup], object], timeout: float = 60) -> list[object]:
    """Call ``fn`` on every group in its own thread; re-raise the first exception."""
    out: list[object] = [None] * len(groups)

    def go(i: int) -> None:
        try:
            out[i] = fn(groups[i])
        except BaseException as exc:  # handed back to the test thread
            out[i] = exc

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(groups))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
        assert not t.is_alive(), "collective did not return in time"
    return out


@pytest.fixture
def ring3(embedded_server: EmbeddedStoreServer):  # noqa: ANN201
    yield from _ring(embedded_server, 3, CALM)


def _ring(server: EmbeddedStoreServer, n: int, timeouts: RingTimeouts, run: str = "unit"):  # noqa: ANN202
    groups: list[RingGroup] = [None] * n  # type: ignore[list-item]

    def make(i: int) -> None:
        groups[i] = RingGroup.create(open_store(server.url, run), world_size=n, member_id=f"m{i}",
                                     timeouts=timeouts)

    ts = [threading.Thread(target=make, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    try:
        yield groups
    finally:
        for g in groups:
            if g is not None:
                g.close()


def test_plans_cover_every_byte_once() -> None:
    for nbytes, item, n, chunk in [(4, 4, 3, 4096), (4000, 4, 3, 64), (1 << 20, 8, 8, 4096), (0, 4, 2, 64)]:
        segs = plans.segments(nbytes, item, n)
        assert segs[0][0] == 0 and segs[-1][1] == nbytes
        assert all(a[1] == b[0] for a, b in zip(segs, segs[1:], strict=False))
        lengths = {b - a for a, b in segs}
        assert max(lengths) - min(lengths) <= item
        for r in range(n):
            sends, frames = plans.allreduce_plan(nbytes, item, n, r, chunk)
            assert all((b - a) <= chunk and (b - a) % item == 0 for a, b in sends)
            # every byte is reduced (n-1 times across ranks) and copied in the all-gather
            copied = sum(f.stop - f.start for f in frames if f.mode == plans.COPY)
            assert copied == nbytes - (segs[(r + 1) % n][1] - segs[(r + 1) % n][0])


def test_interrupted_collective_raises_membership_changed(ring3: list[RingGroup]) -> None:
    groups = ring3
    big = 1 << 22
    leaver = groups[2]
    survivors = groups[:2]

    def reduce_until_change_seen(g: RingGroup) -> tuple[list[tuple[int, int]], int, float]:
        changes: list[tuple[int, int]] = []
        while True:  # bounded by run_all's join timeout
            t = torch.ones(big)
            try:
                g.all_reduce(t)
                if changes:
                    break
            except MembershipChanged as exc:
                changes.append((exc.old_epoch, exc.new_epoch))
        return changes, g.epoch, float(t[0])

    threading.Timer(0.05, leaver.close).start()
    results = run_all(survivors, reduce_until_change_seen)
    for res in results:
        assert not isinstance(res, BaseException), res
        changes, epoch, value = res
        assert epoch == 2 and value == 2.0
        # every survivor observes the change exactly once, whether its collective was cut off
        # mid-flight or had already completed when the peer left
        assert changes == [(1, 2)]
    assert all(g.membership.ids == survivors[0].membership.ids for g in survivors)
    with pytest.raises(RingBrokenError):
        leaver.all_reduce(torch.ones(1))


def test_heartbeats_survive_long_torch_ops(embedded_server: EmbeddedStoreServer) -> None:
    fast = RingTimeouts()  # the 250 ms default
    for groups in _ring(embedded_server, 2, fast, run="gil"):
        a = torch.randn(1500, 1500)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:  # long tensor ops and pure-Python work on this thread
            a = torch.tanh(a @ a)
            sum(i * i for i in range(20000))
        assert [g.epoch for g in groups] == [1, 1], "a busy main thread made a neighbour look dead"
        out = run_all(groups, lambda g: g.all_reduce(torch.ones(3)))
        assert out == [None, None]


def test_admit_without_joiners_is_a_noop(ring3: list[RingGroup]) -> None:
    assert run_all(ring3, lambda g: g.admit()) == [[], [], []]
    assert [g.epoch for g in ring3] == [1, 1, 1]


def test_leave_is_repaired_at_once(ring3: list[RingGroup]) -> None:
    t0 = time.monotonic()
    ring3[1].leave()
    deadline = time.monotonic() + 10
    while any(g.epoch != 2 for g in (ring3[0], ring3[2])):
        assert time.monotonic() < deadline, "survivors did not repair after a graceful leave"
        time.sleep(0.01)
    assert time.monotonic() - t0 < 2.0
    events = [ring3[0].events[-1], ring3[2].events[-1]]
    assert all(ev.kind == "repair" and ev.removed == ["m1"] for ev in events)
    # someone detected it (the leave notice or the closed connection, whichever came first); the
    # other survivor may have learned it from its peer's token
    reasons = [d["reason"] for ev in events for d in ev.detections]
    assert reasons and all(r == "left the ring" or "closed" in r or "lost" in r for r in reasons), reasons


def test_bad_arguments_are_clear_errors(ring3: list[RingGroup]) -> None:
    g = ring3[0]
    with pytest.raises(ConfigError, match="reduce op"):
        g.all_reduce(torch.ones(2), "median")
    with pytest.raises(ConfigError, match="CPU tensors"):
        g.all_reduce([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="rank 7 out of range"):
        g.broadcast(torch.ones(2), 7)
    with pytest.raises(ConfigError, match="all_gather output"):
        g.all_gather(torch.empty(5), torch.ones(2))
    with pytest.raises(ConfigError, match="positive"):
        RingTimeouts(heartbeat_timeout=timedelta(0))
    with pytest.raises(ConfigError, match="longer than heartbeat_interval"):
        RingTimeouts(heartbeat_interval=timedelta(seconds=1), heartbeat_timeout=timedelta(milliseconds=500))
    store = open_store("embedded://127.0.0.1:1", "x")
    with pytest.raises(ConfigError, match="world_size"):
        RingGroup.create(store, world_size=0)
    with pytest.raises(ConfigError, match="chunk_bytes"):
        RingGroup.create(store, world_size=1, chunk_bytes=1000)


def test_leader_watches_etcd_for_joiners(etcd_server) -> None:  # noqa: ANN001 - fixture
    """On etcd the leader learns of a registration through a watch, without any message from the
    newcomer; a follower does not watch."""
    from spotnik_lightning.membership import Member

    groups: list[RingGroup] = [None, None]  # type: ignore[list-item]

    def make(i: int) -> None:
        groups[i] = RingGroup.create(open_store(etcd_server.url, "watch"), world_size=2, member_id=f"e{i}",
                                     timeouts=CALM)

    ts = [threading.Thread(target=make, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    try:
        leader = next(g for g in groups if g.rank == 0)
        follower = next(g for g in groups if g.rank == 1)
        deadline = time.monotonic() + 10
        while leader._join_watch is None:  # the control thread subscribes after install
            assert time.monotonic() < deadline, "leader never subscribed to registrations"
            time.sleep(0.02)
        assert follower._join_watch is None
        open_store(etcd_server.url, "watch").register(Member("newcomer", "127.0.0.1", 9), timedelta(seconds=5))
        deadline = time.monotonic() + 10
        while "newcomer" not in leader._pending_join:
            assert time.monotonic() < deadline, "the watch did not report the registration"
            time.sleep(0.02)
        assert "newcomer" not in follower._pending_join
    finally:
        for g in groups:
            if g is not None:
                g.close()
