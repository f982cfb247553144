"""The ``spotnik`` torch.distributed backend: in-process unit tests, then real multi-process jobs.

The process tests run ``tests/workers/backend_worker.py`` once per rank (see its docstring for the
scenarios) and compare the spotnik results with gloo's in the same processes. Every wait is bounded;
on failure or timeout only the workers started here are killed, by PID.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import free_port

import spotnik_lightning.ring.backend as b
from spotnik_lightning.api import BackendConnectionError, ConfigError, MembershipChanged, RingBrokenError
from spotnik_lightning.membership import open_store
from spotnik_lightning.membership.types import Member, Membership

WORKER = Path(__file__).parent / "workers" / "backend_worker.py"
# Generous heartbeats: the test machine is small and often loaded.
RING_ENV = {"SPOTNIK_HEARTBEAT_MS": "100", "SPOTNIK_HEARTBEAT_TIMEOUT_MS": "3000", "OMP_NUM_THREADS": "1"}


# --------------------------------------------------------------------------- process harness


@dataclass
class Rank:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str

    @property
    def result(self) -> dict | None:
        lines = [ln for ln in self.stdout.splitlines() if ln.startswith("RESULT ")]
        return json.loads(lines[-1][len("RESULT "):]) if lines else None


def run_job(tmp_path: Path, scenario: str, world: int, timeout: float, args: dict | None = None,
            env: dict | None = None) -> list[Rank]:
    """Run ``world`` worker processes and wait for all (at most ``timeout`` s; stragglers are killed
    by PID and the test fails with every rank's output tail)."""
    port = free_port()
    args = dict(args or {})
    args.setdefault("limit", timeout - 5)
    full_env = {**os.environ, **RING_ENV, **(env or {})}
    for key in ("SPOTNIK_STORE", "SPOTNIK_RUN_ID"):
        if key not in (env or {}):
            full_env.pop(key, None)
    procs, files = [], []
    try:
        for r in range(world):
            out = open(tmp_path / f"{scenario}-{r}.out", "w+")
            err = open(tmp_path / f"{scenario}-{r}.err", "w+")
            files.append((out, err))
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), scenario, str(r), str(world), str(port), json.dumps(args)],
                stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=full_env, cwd=str(tmp_path)))
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in hung:
            p.kill()
        for p in hung:
            p.wait(10)
    ranks = []
    for r, (p, (out, err)) in enumerate(zip(procs, files, strict=True)):
        out.seek(0)
        err.seek(0)
        ranks.append(Rank(r, p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    if hung:
        pytest.fail(f"{scenario} x{world}: {len(hung)} rank(s) still running after {timeout} s (killed)\n"
                    + describe(ranks))
    return ranks


def describe(ranks: list[Rank]) -> str:
    return "\n".join(f"--- rank {r.rank} rc={r.returncode}\nstdout: {r.stdout[-1500:]}\nstderr: {r.stderr[-3000:]}"
                     for r in ranks)


def assert_clean(ranks: list[Rank], which: list[int] | None = None) -> list[dict]:
    """Every rank in ``which`` exited 0 with a RESULT line and no abort; returns the results."""
    out = []
    for r in ranks:
        if which is not None and r.rank not in which:
            continue
        assert r.returncode == 0 and r.result is not None, describe(ranks)
        assert "terminate called" not in r.stderr and "Fatal Python error" not in r.stderr, describe(ranks)
        out.append(r.result)
    return out


# --------------------------------------------------------------------------- in-process units


def test_register_is_idempotent() -> None:
    b.register()
    b.register()
    assert "SPOTNIK" in dist.Backend._plugins
    assert dist.Backend("spotnik") == "spotnik"
    assert dist.Backend.backend_capability["spotnik"] == ["cpu"]
    # the cpu default stays gloo: registering spotnik must not change init_process_group()'s default
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"


def test_settings_from_env() -> None:
    s = b.Settings.from_env({})
    assert s.store_url is None and s.run_id is None and s.tier == "transient"
    t = s.timeouts(timedelta(seconds=42))
    assert t.collective == t.bootstrap == t.join == timedelta(seconds=42)
    s = b.Settings.from_env({"SPOTNIK_HEARTBEAT_MS": "100", "SPOTNIK_HEARTBEAT_TIMEOUT_MS": "3000",
                             "SPOTNIK_STORE": "embedded://127.0.0.1:1", "SPOTNIK_RUN_ID": "r1",
                             "SPOTNIK_TIER": "reliable", "SPOTNIK_SHUTDOWN_WAIT_MS": "500"})
    t = s.timeouts(None)
    assert t.heartbeat_interval == timedelta(milliseconds=100) and t.heartbeat_timeout == timedelta(seconds=3)
    assert s.store_url == "embedded://127.0.0.1:1" and s.run_id == "r1" and s.tier == "reliable"
    assert s.shutdown_wait == timedelta(milliseconds=500)
    # an interval alone above the default timeout gets a timeout of 5 intervals
    t = b.Settings.from_env({"SPOTNIK_HEARTBEAT_MS": "400"}).timeouts(None)
    assert t.heartbeat_timeout == timedelta(seconds=2)


@pytest.mark.parametrize("env, key", [
    ({"SPOTNIK_HEARTBEAT_MS": "fast"}, "SPOTNIK_HEARTBEAT_MS"),
    ({"SPOTNIK_HEARTBEAT_MS": "-5"}, "SPOTNIK_HEARTBEAT_MS"),
    ({"SPOTNIK_HEARTBEAT_TIMEOUT_MS": "0"}, "SPOTNIK_HEARTBEAT_TIMEOUT_MS"),
    ({"SPOTNIK_HEARTBEAT_TIMEOUT_MS": "1.5"}, "SPOTNIK_HEARTBEAT_TIMEOUT_MS"),
    ({"SPOTNIK_HEARTBEAT_MS": "500", "SPOTNIK_HEARTBEAT_TIMEOUT_MS": "100"}, "SPOTNIK_HEARTBEAT_TIMEOUT_MS"),
    ({"SPOTNIK_TIER": "gold"}, "SPOTNIK_TIER"),
    ({"SPOTNIK_RUN_ID": "a/b"}, "SPOTNIK_RUN_ID"),
    ({"SPOTNIK_STORE_TIMEOUT_MS": "soon"}, "SPOTNIK_STORE_TIMEOUT_MS"),
])
def test_settings_reject_garbage(env: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        b.Settings.from_env(env)


@pytest.fixture
def tcp_store():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5))
    yield dist.PrefixStore("g/", store)


def _member(i: int) -> Member:
    return Member(f"rank{i}", "127.0.0.1", 10_000 + i)


def test_c10d_store_registrations(tcp_store) -> None:
    s = b.C10dMembershipStore(tcp_store, "run1")
    assert s.registered() == [] and s.get_membership() is None
    for i in (2, 0, 1):
        s.register(_member(i), timedelta(seconds=30))
    assert [m.id for m in s.registered()] == ["rank2", "rank0", "rank1"]  # registration order
    s.register(Member("rank0", "127.0.0.1", 20_000), timedelta(seconds=30))  # replace keeps the slot
    assert [(m.id, m.port) for m in s.registered()][1] == ("rank0", 20_000)
    s.unregister("rank2")
    s.unregister("rank2")  # idempotent
    assert [m.id for m in s.registered()] == ["rank0", "rank1"]
    # a second adapter (another process) sees the same state; ids registered there go after
    s2 = b.C10dMembershipStore(tcp_store, "run1")
    s2.register(_member(3), timedelta(seconds=30))
    assert [m.id for m in s.registered()] == ["rank0", "rank1", "rank3"]
    s.put("k", "v")
    assert s2.get("k") == "v" and s2.get("missing") is None
    s.close()
    with pytest.raises(BackendConnectionError, match="closed"):
        s.registered()


def test_c10d_store_ttl_and_keepalive(tcp_store) -> None:
    s = b.C10dMembershipStore(tcp_store, "run2")
    s.register(_member(0), timedelta(seconds=0.6))
    s.register(_member(1), timedelta(seconds=0.6))
    for _ in range(6):
        time.sleep(0.2)
        s.keepalive("rank0")
    assert [m.id for m in s.registered()] == ["rank0"]  # rank1 expired, rank0 kept alive


def test_c10d_store_cas_exactly_one_winner(tcp_store) -> None:
    stores = [b.C10dMembershipStore(tcp_store, "run3") for _ in range(6)]
    wins: list[int] = []
    barrier = threading.Barrier(len(stores))

    def attempt(i: int) -> None:
        barrier.wait()
        won, current = stores[i].cas_membership(0, Membership(1, (_member(i),)))
        assert current is not None and current.epoch == 1
        if won:
            wins.append(i)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(wins) == 1
    current = stores[0].get_membership()
    assert current == Membership(1, (_member(wins[0]),))
    # stale expected epoch loses and reports the winner; the next epoch can be won
    assert stores[1].cas_membership(0, Membership(1, (_member(5),))) == (False, current)
    nxt = Membership(2, (_member(0), _member(1)))
    assert stores[2].cas_membership(1, nxt) == (True, nxt)
    with pytest.raises(ValueError):
        stores[0].cas_membership(2, Membership(2, ()))


def test_c10d_store_unreachable_is_backend_connection_error() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=2))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=2))
    s = b.C10dMembershipStore(client, "run4", timeout=timedelta(seconds=2))
    s.register(_member(0), timedelta(seconds=30))
    del server  # the master goes away
    t0 = time.monotonic()
    with pytest.raises(BackendConnectionError, match="c10d membership store unreachable"):
        for _ in range(50):
            s.registered()
            time.sleep(0.05)
    assert time.monotonic() - t0 < 15


class _StubRing:
    """Just enough of a RingGroup for ProcessGroupSpotnik; all_reduce fails when told to."""

    def __init__(self) -> None:
        self.rank, self.size, self.epoch, self.member_id, self.state = 0, 2, 1, "rank0", "running"
        self.fail_with: Exception | None = None
        self.repair_during_op = False
        self.closed = False
        self.store = self

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        if self.fail_with is not None:
            t.fill_(-1)  # a half-done reduction: garbage
            raise self.fail_with
        t.mul_(2)
        if self.repair_during_op:  # the op completed, then a repair installed the next epoch
            self.epoch += 1

    def close(self) -> None:
        self.closed = True


def test_fault_contract_records_instead_of_raising() -> None:
    ring = _StubRing()
    pg = b.ProcessGroupSpotnik(ring, 0, 2)  # type: ignore[arg-type]
    assert pg.getBackendName() == "spotnik" and pg.rank() == 0 and pg.size() == 2
    t = torch.ones(3)
    work = pg.allreduce([t])
    work.wait()
    assert torch.equal(t, torch.full((3,), 2.0)) and pg.take_error() is None
    # a ring failure: the call returns, the future is complete (no exception), wait() raises
    err = MembershipChanged(1, 2, "peer died")
    ring.fail_with = err
    work = pg.allreduce([t])
    fut = work.get_future()
    assert fut.done() and fut.value()[0] is t
    assert pg.last_error is err and pg.failed_epochs == [1] and not work.is_success()
    with pytest.raises(MembershipChanged):
        work.wait()
    assert pg.take_error() is None  # observed through wait()
    # not waited on (the DDP path): take_error() hands it over once
    ring.epoch = 2
    ring.fail_with = RingBrokenError("gone")
    pg.allreduce([t])
    pg.allreduce([t])
    assert isinstance(pg.take_error(), RingBrokenError) and pg.take_error() is None
    assert pg.failed_epochs == [1, 2]
    # bad arguments raise from the call itself
    with pytest.raises(ConfigError, match="reduce op"):
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.BXOR
        pg.allreduce([t], opts)
    with pytest.raises(NotImplementedError):
        pg.recv_anysource([t], 0)
    # a composite op (all-reduce, then slice by rank) across an epoch change counts as failed;
    # a single ring op that completed does not
    ring.fail_with, ring.epoch, ring.repair_during_op = None, 5, True
    pg.allreduce([t]).wait()
    work = pg.reduce_scatter_single(torch.empty(2), torch.ones(4))
    with pytest.raises(MembershipChanged, match="during reduce_scatter_tensor"):
        work.wait()
    assert pg.failed_epochs == [1, 2, 6]
    pg.shutdown()
    pg.shutdown()
    assert ring.closed and pg.size() == 2
    with pytest.raises(ConfigError, match="shut down"):
        pg.allreduce([t])


# --------------------------------------------------------------------------- process jobs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_gloo(tmp_path: Path, world: int) -> None:
    ranks = run_job(tmp_path, "collectives", world, timeout=100)
    results = assert_clean(ranks)
    assert all(r["cases"] > 300 and r["identical_checked"] == results[0]["identical_checked"] > 150
               for r in results), results


@pytest.mark.timeout(120)
def test_collectives_match_gloo_8_ranks(tmp_path: Path) -> None:
    args = {"sizes": [1, 1000], "dtypes": ["float32", "int64"], "ops": ["sum", "product", "avg"]}
    ranks = run_job(tmp_path, "collectives", 8, timeout=100, args=args)
    assert_clean(ranks)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_matches_gloo_and_replicas_identical(tmp_path: Path, world: int) -> None:
    results = assert_clean(run_job(tmp_path, "ddp", world, timeout=100))
    assert all(r["max_abs_diff_vs_gloo"] < 1e-5 for r in results), results


@pytest.mark.timeout(120)
def test_default_group_subgroups_and_teardown(tmp_path: Path) -> None:
    results = assert_clean(run_job(tmp_path, "default", 4, timeout=100))
    assert "does not support reduce op" in results[0]["errors"]["band"]
    assert "any source" in results[0]["errors"]["recv_anysource"]


@pytest.mark.timeout(120)
def test_peer_death_inside_ddp_backward_is_recorded_not_fatal(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    ranks = run_job(tmp_path, "fault", 3, timeout=100, args={"marks": str(marks)})
    assert ranks[2].returncode == 0 and ranks[2].result is None, describe(ranks)  # the victim exited
    results = assert_clean(ranks, which=[0, 1])
    assert results[0]["report"] == results[1]["report"] == {
        "step0": None, "step1": "MembershipChanged", "step2": None}
    assert results[0]["params_digest"] == results[1]["params_digest"]  # survivors stayed identical
    assert results[0]["epoch"] == results[1]["epoch"] == 2


@pytest.mark.timeout(90)
def test_external_membership_store(tmp_path: Path, embedded_server) -> None:
    url = embedded_server.url
    results = assert_clean(run_job(tmp_path, "external", 3, timeout=80,
                                   env={"SPOTNIK_STORE": url, "SPOTNIK_RUN_ID": "jobA"}))
    # both groups are subgroups (gloo is the default group): run ids "jobA.<fresh id>", one per group
    world_run, sub_run = results[0]["run_ids"]
    assert world_run.startswith("jobA.") and sub_run.startswith("jobA.") and world_run != sub_run
    assert all(r["run_ids"][0] == world_run for r in results) and results[1]["run_ids"][1] == sub_run
    assert results[0]["members"] == ["rank0", "rank1", "rank2"]
    # the rings lived in the external store (members closing one after the other may leave a
    # shutdown-time repair there, so only the run's existence and member ids are checked)
    for run, ids in ((world_run, {"rank0", "rank1", "rank2"}), (sub_run, {"rank0", "rank1"})):
        with open_store(url, run) as store:
            m = store.get_membership()
            assert m is not None and m.epoch >= 1 and set(m.ids) <= ids, (run, m)


@pytest.mark.timeout(60)
def test_unreachable_store_is_a_clear_error(tmp_path: Path) -> None:
    ranks = run_job(tmp_path, "unreachable", 2, timeout=50, args={"dead_port": free_port()})
    for res in assert_clean(ranks):
        assert "unreachable during register" in res["error"] and res["seconds"] < 15, res
