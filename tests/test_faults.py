"""Revocations on a real ring of worker processes, with the embedded store and with real etcd.

Each worker all-reduces in a loop and checks every result against the membership it ran on
(see spotnik_lightning.bench.loop_worker). After each fault we assert the invariants: every
survivor installs the same epoch and membership (exactly the survivors), keeps its PID, keeps
producing correct results, and no worker ever saw a wrong sum.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from spotnik_lightning.api import BackendConnectionError
from spotnik_lightning.bench.cluster import LocalCluster
from spotnik_lightning.membership import open_store
from spotnik_lightning.ring import RingGroup

N = 8
IDS = [f"w{i}" for i in range(N)]


@pytest.fixture(params=["embedded", "etcd"])
def store_url(request: pytest.FixtureRequest) -> str:
    if request.param == "embedded":
        return request.getfixturevalue("embedded_server").url
    return request.getfixturevalue("etcd_server").url


def start(cluster: LocalCluster, ids: list[str] = IDS, **cfg: object) -> dict[str, int]:
    pids = {i: cluster.spawn(i, world_size=len(ids), **cfg) for i in ids}
    cluster.wait_all(ids, lambda e: e["ev"] == "ok", 90, "first successful all-reduce")
    return pids


def assert_recovered(cluster: LocalCluster, survivors: list[str], pids: dict[str, int], since: int,
                     timeout: float = 30) -> int:
    """Every survivor reports a correct all-reduce on a membership of exactly the survivors;
    returns that epoch."""
    got = cluster.wait_all(
        survivors, lambda e: e["ev"] == "ok" and set(e["members"]) == set(survivors), timeout,
        "a successful all-reduce on the survivors' membership", since=since)
    epochs = {e["epoch"] for e in got.values()}
    assert len(epochs) == 1, f"survivors disagree on the epoch: {epochs}"
    orders = {tuple(e["members"]) for e in got.values()}
    assert len(orders) == 1, f"survivors disagree on the ring order: {orders}"
    for mid, ev in got.items():
        assert ev["pid"] == pids[mid], f"{mid} was restarted (pid {pids[mid]} -> {ev['pid']})"
    assert cluster.of("bad") == [], f"wrong all-reduce results: {cluster.of('bad')[:3]}"
    assert not [e for e in cluster.of("fenced") if e["id"] in survivors]
    return epochs.pop()


@pytest.mark.parametrize("victims", [["w3"], ["w2", "w3"], ["w1", "w2", "w5"]],
                         ids=["kill1", "kill2-neighbours", "kill3"])
def test_sigkill_mid_allreduce(store_url: str, victims: list[str]) -> None:
    with LocalCluster(store_url, f"kill-{uuid.uuid4().hex[:6]}", numel=1 << 16, hb_timeout_ms=1000) as c:
        pids = start(c)
        time.sleep(0.3)  # let the loop run so the kill lands inside an all-reduce
        mark = c.mark()
        for v in victims:
            c.signal(v, signal.SIGKILL)
        survivors = [i for i in IDS if i not in victims]
        epoch = assert_recovered(c, survivors, pids, mark)
        assert epoch >= 2
        # the repair was logged once per survivor, with a bounded message count (O(K))
        changes = [e for e in c.events[mark:] if e["ev"] == "membership" and e["epoch"] == epoch]
        assert {e["id"] for e in changes} == set(survivors)
        assert max(e["messages"] for e in changes) <= 6 * len(victims) + 6


def test_sigstop_is_detected_by_heartbeat(store_url: str) -> None:
    with LocalCluster(store_url, f"stop-{uuid.uuid4().hex[:6]}", numel=1024, report_every=100) as c:
        pids = start(c)
        # revoke a worker of a ring that has been running (neighbours have heard its heartbeats)
        c.wait_all(IDS, lambda e: e["ev"] == "ok" and e["k"] >= 100, 60, "100 iterations")
        mark = c.mark()
        t_stop = c.signal("w4", signal.SIGSTOP)
        survivors = [i for i in IDS if i != "w4"]
        assert_recovered(c, survivors, pids, mark)
        installs = [e for e in c.events[mark:] if e["ev"] == "membership" and "w4" in e["removed"]]
        detect = min(e["t"] for e in installs) - t_stop
        assert detect < 1.5, f"silent failure took {detect:.2f} s to repair"


def test_join_after_loss(store_url: str) -> None:
    with LocalCluster(store_url, f"join-{uuid.uuid4().hex[:6]}", numel=4096, hb_timeout_ms=1000) as c:
        pids = start(c)
        mark = c.mark()
        c.signal("w6", signal.SIGKILL)
        survivors = [i for i in IDS if i != "w6"]
        assert_recovered(c, survivors, pids, mark)
        mark = c.mark()
        pids["w8"] = c.spawn("w8", world_size=None)
        everyone = survivors + ["w8"]
        epoch = assert_recovered(c, everyone, pids, mark, timeout=60)
        joined = [e for e in c.events[mark:] if e["ev"] == "membership" and e["kind"] == "join"]
        assert {e["id"] for e in joined} == set(survivors), "every old member logs the join once"
        assert all(e["epoch"] == epoch and e["added"] == ["w8"] for e in joined)


def test_etcd_restart_during_repair(etcd_server) -> None:  # noqa: ANN001 - fixture
    with LocalCluster(etcd_server.url, f"etcdr-{uuid.uuid4().hex[:6]}", numel=1024, hb_timeout_ms=1000) as c:
        ids = IDS[:4]
        pids = start(c, ids)
        etcd_server.stop()
        mark = c.mark()
        c.signal("w2", signal.SIGKILL)
        survivors = [i for i in ids if i != "w2"]
        # without the store nobody can commit epoch 2: no survivor reports success on it
        time.sleep(1.5)
        assert not [e for e in c.events[mark:] if e["ev"] == "ok" and "w2" not in e["members"]]
        assert not [e for e in c.events[mark:] if e["ev"] in ("error", "fenced")]
        etcd_server.start()
        assert_recovered(c, survivors, pids, mark, timeout=30)


def test_unreachable_store_at_start() -> None:
    from tests.helpers import free_port

    port = free_port()
    for url in (f"embedded://127.0.0.1:{port}", f"etcd://127.0.0.1:{port}"):
        store = open_store(url, "nobody")
        t0 = time.monotonic()
        with pytest.raises(BackendConnectionError, match="127.0.0.1"):
            RingGroup.create(store, world_size=2, member_id="a")
        assert time.monotonic() - t0 < 30
