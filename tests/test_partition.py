"""A network partition splits a ring of 4 into two halves that both still reach the store: the
fencing CAS lets exactly one half continue (with a membership of exactly that half) and fences
every worker of the other half. Never do both halves run collectives on one epoch.

Four hosts are network namespaces on a software switch (tests/netns.py); etcd runs in the switch
namespace on the management network, which the partition does not cut. Each host runs one
tests/workers/partition_worker.py that loops all_reduce and reports every attempt as a JSON line.
Worker i contributes 2**i, so the reduced value names the exact set of members that took part.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from netns import NetnsBed, require_bed, start_etcd

pytestmark = pytest.mark.timeout(90)  # hard guard; the scenario itself is bounded by SCENARIO_S

WORKER = Path(__file__).parent / "workers" / "partition_worker.py"
N = 4
IDS = [f"h{i}" for i in range(N)]
VALUE = {mid: float(2**i) for i, mid in enumerate(IDS)}
HALVES = (frozenset(IDS[:2]), frozenset(IDS[2:]))
SCENARIO_S = 48.0  # start to outcome; with at most 10 s to stop the workers the test stays < 60 s


@pytest.fixture
def bed() -> Iterator[NetnsBed]:
    b = require_bed(N)
    try:
        yield b
    finally:
        b.cleanup()


class Worker:
    """One worker process and the JSON lines it printed (collected by a reader thread)."""

    def __init__(self, bed: NetnsBed, i: int, store_url: str, run_id: str, log_dir: Path) -> None:
        self.id = IDS[i]
        self.host = bed.hosts[i]
        self.lines: list[dict] = []
        self.garbage: list[str] = []
        self._lock = threading.Lock()
        self.stderr_path = log_dir / f"{self.id}.stderr"
        env = {**os.environ, "SPOTNIK_SECRET": f"partition-{run_id}", "PYTHONUNBUFFERED": "1",
               "no_proxy": "*", "NO_PROXY": "*"}
        argv = [sys.executable, str(WORKER), "--store", store_url, "--run-id", run_id, "--member-id", self.id,
                "--host", bed.addr[self.host], "--world", str(N), "--value", str(VALUE[self.id]),
                "--duration", "60", "--hb-interval", "0.1", "--hb-timeout", "1.0"]
        with open(self.stderr_path, "wb") as err:
            self.proc = bed.run(self.host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            text = raw.decode(errors="replace").strip()
            try:
                msg = json.loads(text)
            except json.JSONDecodeError:
                with self._lock:
                    self.garbage.append(text)
                continue
            with self._lock:
                self.lines.append(msg)

    def events(self, ev: str | None = None) -> list[dict]:
        with self._lock:
            return [m for m in self.lines if ev is None or m["ev"] == ev]

    def oks(self, members: frozenset[str], min_epoch: int = 0) -> list[dict]:
        return [m for m in self.events("ok") if frozenset(m["members"]) == members and m["epoch"] >= min_epoch]

    def close_stdin(self) -> None:
        """The worker's signal to leave."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass

    def wait(self, timeout: float) -> None:
        """Wait for the worker to exit (kill it, by PID, after ``timeout`` s)."""
        try:
            self.proc.wait(max(0.1, timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._reader.join(5)

    def describe(self) -> str:
        tail = self.stderr_path.read_text(errors="replace")[-1500:] if self.stderr_path.exists() else ""
        evs = [(m["ev"], m.get("epoch"), m.get("members")) for m in self.events()]
        compact: list = []
        for e in evs:  # collapse runs of identical events
            if compact and compact[-1][0] == e:
                compact[-1][1] += 1
            else:
                compact.append([e, 1])
        return f"{self.id} (rc={self.proc.poll()}): {compact}\n  garbage={self.garbage}\n  stderr tail: {tail}"


def wait_for(pred: Callable[[], bool], deadline: float, what: str, workers: list[Worker]) -> None:
    """Poll ``pred`` until it holds; fail with every worker's story once ``deadline`` (monotonic)
    has passed."""
    start = time.monotonic()
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {time.monotonic() - start:.0f} s waiting for {what}\n"
                                 + "\n".join(w.describe() for w in workers))
        time.sleep(0.1)


def expected_value(members: list[str]) -> float:
    return sum(VALUE[m] for m in members)


def test_partition_fences_exactly_one_half(bed: NetnsBed, tmp_path: Path) -> None:
    t0 = time.monotonic()
    deadline = t0 + SCENARIO_S  # every wait below ends by then; stopping the workers takes <= 10 s more
    start_etcd(bed, tmp_path / "etcd-data")
    t_etcd = time.monotonic()
    store_url = f"etcd://{bed.switch_addr}:2379"
    run_id = f"part-{uuid.uuid4().hex[:8]}"
    workers = [Worker(bed, i, store_url, run_id, tmp_path) for i in range(N)]
    by_id = {w.id: w for w in workers}
    try:
        # 1. the full ring runs
        everyone = frozenset(IDS)
        wait_for(lambda: all(len(w.oks(everyone)) >= 3 for w in workers), min(deadline, time.monotonic() + 40),
                 "4 workers all-reducing", workers)
        pre = {w.id: w.events() for w in workers}
        for w in workers:
            assert all(m["epoch"] == 1 for m in pre[w.id] if m["ev"] == "ok"), w.describe()

        # 2. partition the data network; the store stays reachable from both halves
        bed.partition(*[[by_id[i].host for i in sorted(half)] for half in HALVES])
        t_part = time.monotonic()

        def outcome() -> frozenset[str] | None:
            for half in HALVES:
                other = HALVES[1] if half is HALVES[0] else HALVES[0]
                if (all(len(by_id[i].oks(half, min_epoch=2)) >= 5 for i in half)
                        and all(by_id[i].events("fenced") for i in other)):
                    return half
            return None

        wait_for(lambda: outcome() is not None, min(deadline, time.monotonic() + 30),
                 "one half continuing and the other fenced", workers)
        winner = outcome()
        assert winner is not None
        loser = HALVES[1] if winner == HALVES[0] else HALVES[0]
        t_settled = time.monotonic()
        # what happened up to here is the partition's outcome; stopping the workers afterwards
        # makes the winners repair again (a closed peer is a failed peer), which is not checked
        settled = {w.id: w.events() for w in workers}
    finally:
        t_stop = time.monotonic()
        for w in workers:
            w.close_stdin()
        for w in workers:
            w.wait(t_stop + 10 - time.monotonic())

    report = "\n".join(w.describe() for w in workers)
    for w in workers:
        assert not w.garbage, report
        assert not [m for m in w.events() if m["ev"] in ("error", "broken")], report
        assert w.events("exit"), f"{w.id} did not exit cleanly\n{report}"

    # every successful all_reduce is correct for the membership it ran on
    for w in workers:
        for m in w.events("ok"):
            candidates = [m["members"]] + ([m["other_members"]] if m.get("other_members") else [])
            assert m["uniform"] and any(m["value"] == expected_value(c) for c in candidates), (w.id, m)

    # one membership per epoch, whoever reports it
    seen: dict[int, frozenset[str]] = {}
    for w in workers:
        for m in w.events("ok"):
            members = frozenset(m["members"])
            assert seen.setdefault(m["epoch"], members) == members, f"two memberships at epoch {m['epoch']}\n{report}"
    later = {e: ms for e, ms in seen.items() if e >= 2 and any(
        m["ev"] == "ok" and m["epoch"] == e for evs in settled.values() for m in evs)}
    assert later and all(ms == winner for ms in later.values()), f"epochs after the partition: {later}\n{report}"
    # (the value check above proves that no collective mixed the halves)
    for i in loser:
        evs = by_id[i].events()
        fence_at = next(k for k, m in enumerate(evs) if m["ev"] == "fenced")
        assert not [m for m in evs if m["ev"] == "ok" and m["epoch"] >= 2], f"{i} ran in a new epoch\n{report}"
        assert [m["ev"] for m in evs[fence_at + 1:]] == ["exit"], f"{i} went on after being fenced\n{report}"
        fenced = evs[fence_at]
        assert fenced["epoch"] in (-1, *later), fenced  # -1: fenced by peers before the store was read
        if fenced["epoch"] != -1:
            assert frozenset(fenced["members"]) == winner, fenced
    for i in winner:
        assert not [m for m in settled[i] if m["ev"] == "fenced"], report
        last_ok = [m for m in settled[i] if m["ev"] == "ok"][-1]
        assert frozenset(last_ok["members"]) == winner and last_ok["epoch"] == max(later), (i, last_ok)

    total = time.monotonic() - t0
    print(f"partition: winner {sorted(winner)} at epoch {max(later)}, settled {t_settled - t_part:.1f} s "
          f"after the cut; etcd {t_etcd - t0:.1f} s, ring up {t_part - t_etcd:.1f} s, "
          f"stop {time.monotonic() - t_stop:.1f} s, test {total:.1f} s")
