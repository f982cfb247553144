"""Correctness of spotnik's ring collectives against gloo, across 2, 3, 4 and 8 processes.

For each world size the workers (tests/workers/collectives_worker.py) are started once, run every
case of ``build_cases(n)`` on both backends and report per case; each case is one pytest item
here. The workers join a gloo group and a RingGroup on an embedded store hosted in this process.
What is checked per case: equality with gloo (assert_close for floats with looser tolerances for
fp16/bf16; exact for ints, bool, min/max and data movement), bit-identical ring results across
ranks, and — at n=2 — that a 64 MiB all_reduce grows peak RSS by far less than one copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port
from workers.collectives_worker import build_cases

from spotnik_lightning.membership import EmbeddedStoreServer

WORKER = Path(__file__).parent / "workers" / "collectives_worker.py"
WORLD_SIZES = (2, 3, 4, 8)
DEADLINE_S = {2: 120.0, 3: 120.0, 4: 150.0, 8: 150.0}  # whole group, generous on a loaded 2-core box

_groups: dict[int | str, dict] = {}


@pytest.fixture(scope="module")
def store_url() -> Iterator[str]:
    server = EmbeddedStoreServer("127.0.0.1", 0)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def group_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("collectives")


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "<no log>"


def _run_group(n: int, url: str, workdir: Path, extra: tuple[str, ...] = (), tag: str = "") -> dict:
    """Start n workers, wait (bounded) and collect their per-case reports."""
    run_id = f"coll{tag}-{n}-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs, outs, logs = [], [], []
    t0 = time.monotonic()
    for r in range(n):
        out, log = workdir / f"n{n}{tag}-r{r}.jsonl", workdir / f"n{n}{tag}-r{r}.log"
        outs.append(out)
        logs.append(log)
        with open(log, "wb") as lf:
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--store", url, "--run-id", run_id, "--world", str(n),
                 "--rank", str(r), "--gloo-port", str(port), "--out", str(out), *extra],
                stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))
    deadline = t0 + DEADLINE_S[n]
    timed_out = False
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for p in procs:
            if p.poll() is None:
                p.kill()  # by PID
        for p in procs:
            p.wait(10)
    cases: dict[str, list[dict]] = {}
    for out in outs:
        if out.exists():
            for line in out.read_text().splitlines():
                rec = json.loads(line)
                cases.setdefault(rec["case"], []).append(rec)
    return {"cases": cases, "codes": [p.returncode for p in procs], "timed_out": timed_out,
            "seconds": time.monotonic() - t0, "logs": logs}


def _group(n: int, url: str, workdir: Path) -> dict:
    if n not in _groups:
        _groups[n] = _run_group(n, url, workdir)
    return _groups[n]


def _slow_group(url: str, workdir: Path) -> dict:
    if "slow" not in _groups:
        _groups["slow"] = _run_group(3, url, workdir, ("--suite", "slow-sends", "--inject", "slow-initial-sends",
                                                      "--chunk-bytes", str(64 << 10)), tag="-slow")
    return _groups["slow"]


def _diagnose(g: dict) -> str:
    head = f"exit codes {g['codes']}, timed out: {g['timed_out']}, {g['seconds']:.1f} s"
    return head + "".join(f"\n--- {log.name} ---\n{_tail(log)}" for log in g["logs"])


PARAMS = [pytest.param(n, c.name, id=f"n{n}-{c.name}") for n in WORLD_SIZES for c in build_cases(n)]


@pytest.mark.parametrize("n,name", PARAMS)
def test_collective_matches_gloo(n: int, name: str, store_url: str, group_dir: Path,
                                 record_property: pytest.RecordProperty) -> None:
    g = _group(n, store_url, group_dir)
    recs = g["cases"].get(name, [])
    if len(recs) != n:
        pytest.fail(f"{name}: {len(recs)} of {n} workers reported; {_diagnose(g)}")
    bad = [f"{r['error']}" for r in recs if not r["ok"]]
    assert not bad, f"{name} (n={n}): " + " | ".join(sorted(set(bad)))
    if name.startswith("memory-"):
        for r in recs:
            record_property(f"rss_growth_mib_r{recs.index(r)}", r["info"]["growth_mib"])
        print(f"\n{name}: " + "; ".join(json.dumps(r["info"]) for r in recs))


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_workers_finish_cleanly(n: int, store_url: str, group_dir: Path) -> None:
    g = _group(n, store_url, group_dir)
    setup = g["cases"].get("_setup", [])
    assert sorted(r["info"]["ring_rank"] for r in setup) == list(range(n)), _diagnose(g)
    done = g["cases"].get("_done", [])
    assert len(done) == n and all(r["ok"] for r in done), _diagnose(g)
    assert g["codes"] == [0] * n, _diagnose(g)
    print(f"\nn={n}: {len(build_cases(n))} cases in {g['seconds']:.1f} s")


@pytest.mark.parametrize("name", [c.name for c in build_cases(3, "slow-sends")])
def test_allreduce_correct_when_caller_is_slow_to_queue_sends(name: str, store_url: str, group_dir: Path) -> None:
    """Regression: the reader thread may receive and forward a frame while the caller thread is
    still queueing the collective's initial sends. Those forwards must not overtake (or take the
    frame index of) initial sends still to be queued. Here every initial send waits 1 ms
    (fault injection in the worker); the all_reduce must still match gloo on every rank."""
    g = _slow_group(store_url, group_dir)
    recs = g["cases"].get(name, [])
    if len(recs) != 3:
        pytest.fail(f"{name}: {len(recs)} of 3 workers reported; {_diagnose(g)}")
    bad = [r["error"].splitlines()[0] if r["error"] else "" for r in recs if not r["ok"]]
    assert not bad, f"{name} with slow initial sends (n=3, 64 KiB chunks): " + " | ".join(sorted(set(bad)))
