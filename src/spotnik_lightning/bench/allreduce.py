"""All-reduce benchmark: spotnik's ring vs gloo, same processes, same tensors, interleaved.

:func:`run` starts, for each world size N, N worker processes
(``python -m spotnik_lightning.bench.allreduce --worker ...``). Each worker joins a gloo process
group (TCP rendezvous) and a spotnik :class:`~spotnik_lightning.ring.RingGroup` on an embedded
membership store hosted by the calling process, with ``torch.set_num_threads(1)``.

Per float32 tensor size: ``warmup`` all-reduces on each backend, then ``rounds`` rounds; a round
times ``iters`` back-to-back all-reduces on gloo and on spotnik, alternating which backend goes
first, each block started by a gloo barrier. A block's time is the slowest rank's; the reported
time is the median over rounds, so machine noise hits both backends alike.

Bus bandwidth (as nccl-tests): ``bytes * 2 * (N - 1) / N / time``, in GB/s (1e9). ``ratio`` is
spotnik / gloo of the medians; ``ratio_best`` compares each backend's best round (steadier when
other work shares the machine).

Memory: ``rss_setup_mib`` is VmRSS once both groups are up; ``rss_baseline_mib`` is VmRSS with the
size's tensor allocated, before any all-reduce of that size. Before each backend's warmup and
each timed block the peak (VmHWM) is reset through ``/proc/self/clear_refs``, so
``rss_peak_<backend>_mib`` is the peak during that backend's own all-reduces (warmup included,
so buffers a backend allocates once and keeps are counted). Without clear_refs (non-Linux, restricted /proc) the
peak is the process-wide ``ru_maxrss`` covering both backends, flagged ``peak_scope: process``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

MIB = 1 << 20
BACKENDS = ("gloo", "spotnik")


def goal_for(n: int) -> float:
    """spotnik/gloo bus-bandwidth ratio the project aims for at world size ``n`` (sizes >= 1 MiB)."""
    return 1.0 if n <= 4 else 0.8


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_timeout(n: int, sizes: list[int], iters: int, warmup: int, rounds: int) -> float:
    """A generous bound for one world size: setup plus every all-reduce at a pessimistic 20 MB/s
    of per-process traffic (a loaded 2-core machine with 8 processes stays far above that)."""
    ops = 2 * (warmup + rounds * iters)
    return 120.0 + sum(ops * (0.05 + 2 * s * (n - 1) / n / 20e6) for s in sizes)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(procs: list[int], sizes: list[int], iters: int = 10, warmup: int = 2, chunk_bytes: int = 4 << 20, *,
        rounds: int = 5, timeout_s: float | None = None, log: Callable[[str], None] | None = _stderr,
        keep_going: bool = True) -> dict:
    """Benchmark float32 all-reduce of each size (bytes, a multiple of 4) on each world size.

    Returns ``{"config": {...}, "rows": [...], "seconds": total}``; one row per (procs, size) with
    ``gloo_busbw_gbps``, ``spotnik_busbw_gbps``, ``ratio`` (spotnik / gloo), the median block
    times, the goal, and RSS figures (max over workers, plus per-worker lists).

    A world size whose workers fail or exceed their time bound is killed (by PID) and reported in
    ``errors`` (``procs``, first line, ``detail`` with the workers' log tails); the other world
    sizes still run. With ``keep_going=False`` the RuntimeError propagates instead.
    """
    if not procs or any(int(n) < 2 for n in procs):
        raise ValueError(f"procs must be world sizes >= 2, got {procs}")
    if not sizes or any(s < 4 or s % 4 for s in sizes):
        raise ValueError(f"sizes must be positive multiples of 4 bytes (float32), got {sizes}")
    if iters < 1 or warmup < 0 or rounds < 1:
        raise ValueError(f"need iters >= 1, warmup >= 0, rounds >= 1 (got {iters}, {warmup}, {rounds})")
    from spotnik_lightning.membership import EmbeddedStoreServer

    log = log or (lambda _msg: None)
    t_start = time.monotonic()
    rows: list[dict] = []
    errors: list[dict] = []
    server = EmbeddedStoreServer("127.0.0.1", 0)
    server.start()
    workdir = tempfile.mkdtemp(prefix="spotnik-bench-")
    try:
        for n in procs:
            bound = timeout_s if timeout_s is not None else _group_timeout(n, sizes, iters, warmup, rounds)
            log(f"allreduce bench: {n} processes, sizes {sizes}, {rounds} rounds x {iters} iters "
                f"(bound {bound:.0f} s)")
            t0 = time.monotonic()
            try:
                reports = _run_group(n, sizes, iters, warmup, rounds, chunk_bytes, server.url, workdir, bound)
            except RuntimeError as exc:
                if not keep_going:
                    raise
                first = str(exc).splitlines()[0]
                errors.append({"procs": n, "error": first, "detail": str(exc)})
                log(f"allreduce bench: {n} processes FAILED after {time.monotonic() - t0:.1f} s: {first}")
                continue
            rows.extend(_aggregate(n, sizes, reports))
            log(f"allreduce bench: {n} processes done in {time.monotonic() - t0:.1f} s")
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    import torch

    config = {"procs": list(procs), "sizes": list(sizes), "iters": iters, "warmup": warmup, "rounds": rounds,
              "chunk_bytes": chunk_bytes, "dtype": "float32", "torch": torch.__version__,
              "cpus": os.cpu_count(), "busbw": "bytes * 2 * (n - 1) / n / median block time per op, GB/s = 1e9 B/s"}
    return {"config": config, "rows": rows, "errors": errors, "seconds": round(time.monotonic() - t_start, 1)}


def _run_group(n: int, sizes: list[int], iters: int, warmup: int, rounds: int, chunk_bytes: int, url: str,
               workdir: str, bound: float) -> list[dict]:
    run_id = f"bench-{n}-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    outs = [os.path.join(workdir, f"{run_id}-r{r}.json") for r in range(n)]
    logs = [os.path.join(workdir, f"{run_id}-r{r}.log") for r in range(n)]
    procs: list[subprocess.Popen] = []
    ok = False
    try:
        for r in range(n):
            cmd = [sys.executable, "-m", "spotnik_lightning.bench.allreduce", "--worker", "--rank", str(r),
                   "--world", str(n), "--gloo-port", str(port), "--store", url, "--run-id", run_id,
                   "--sizes", ",".join(map(str, sizes)), "--iters", str(iters), "--warmup", str(warmup),
                   "--rounds", str(rounds), "--chunk-bytes", str(chunk_bytes), "--out", outs[r]]
            with open(logs[r], "wb") as lf:
                procs.append(subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, env=env))
        deadline = time.monotonic() + bound
        while True:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                raise RuntimeError(f"allreduce bench at n={n}: a worker failed (exit codes {codes})"
                                   + _tails(logs))
            if time.monotonic() > deadline:
                raise RuntimeError(f"allreduce bench at n={n}: workers did not finish within {bound:.0f} s"
                                   + _tails(logs))
            time.sleep(0.1)
        reports = []
        for path in outs:
            with open(path) as f:
                reports.append(json.load(f))
        ok = True
        return reports
    finally:
        if not ok:
            for p in procs:
                if p.poll() is None:
                    p.kill()  # by PID, only our own children
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass


def _tails(logs: list[str], chars: int = 1500) -> str:
    out = []
    for path in logs:
        try:
            with open(path, errors="replace") as f:
                text = f.read()[-chars:]
        except OSError:
            text = "<no log>"
        out.append(f"\n--- {os.path.basename(path)} ---\n{text}")
    return "".join(out)


def _aggregate(n: int, sizes: list[int], reports: list[dict]) -> list[dict]:
    from spotnik_lightning.bench import format_size

    rows = []
    for i, size in enumerate(sizes):
        per = [rep["sizes"][i] for rep in reports]
        row: dict = {"procs": n, "size_bytes": size, "size": format_size(size)}
        for b in BACKENDS:
            # a block ends when its slowest rank ends: max over ranks per round, median over rounds
            block = [max(p["blocks"][b][k] for p in per) for k in range(len(per[0]["blocks"][b]))]
            t_op = statistics.median(block) / per[0]["iters"]
            row[f"{b}_time_ms"] = round(t_op * 1e3, 3)
            row[f"{b}_busbw_gbps"] = round(size * 2 * (n - 1) / n / t_op / 1e9, 4)
            row[f"{b}_rounds_ms"] = [round(t / per[0]["iters"] * 1e3, 3) for t in block]
            row[f"{b}_best_busbw_gbps"] = round(size * 2 * (n - 1) / n / (min(block) / per[0]["iters"]) / 1e9, 4)
            # CPU time one op costs a worker (median over ranks and rounds): on a machine with fewer
            # cores than workers this, not the wall time, is what the op takes from training
            row[f"{b}_cpu_ms"] = round(statistics.median(
                c for p in per for c in p.get("cpu", {}).get(b, [float("nan")])) / per[0]["iters"] * 1e3, 3)
        row["ratio"] = round(row["spotnik_busbw_gbps"] / row["gloo_busbw_gbps"], 4)
        # best round of each backend: less sensitive to a loaded machine than the median
        row["ratio_best"] = round(row["spotnik_best_busbw_gbps"] / row["gloo_best_busbw_gbps"], 4)
        row["cpu_ratio"] = round(row["spotnik_cpu_ms"] / row["gloo_cpu_ms"], 4)
        row["goal"] = goal_for(n)
        row["meets_goal"] = row["ratio"] >= row["goal"]
        row["rss_setup_mib"] = max(p["rss_setup_mib"] for p in per)
        row["rss_baseline_mib"] = max(p["rss_baseline_mib"] for p in per)
        for b in BACKENDS:
            row[f"rss_peak_{b}_mib"] = max(p["rss_peak_mib"][b] for p in per)
        row["peak_scope"] = per[0]["peak_scope"]
        row["rss_per_worker"] = [{"rank": rep["rank"], "baseline_mib": p["rss_baseline_mib"],
                                  "peak_gloo_mib": p["rss_peak_mib"]["gloo"],
                                  "peak_spotnik_mib": p["rss_peak_mib"]["spotnik"]}
                                 for rep, p in zip(reports, per, strict=True)]
        rows.append(row)
    return rows


def format_table(result: dict) -> str:
    """A human-readable table of :func:`run`'s rows."""
    head = (f"{'procs':>5} {'size':>8} {'gloo GB/s':>10} {'spotnik GB/s':>13} {'ratio':>7} {'goal':>5}  "
            f"{'RSS base':>9} {'peak gloo':>10} {'peak spotnik':>13}  (MiB, max over workers)")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        mark = "ok" if r["meets_goal"] else "BELOW"
        lines.append(f"{r['procs']:>5} {r['size']:>8} {r['gloo_busbw_gbps']:>10.3f} {r['spotnik_busbw_gbps']:>13.3f} "
                     f"{r['ratio']:>6.2f}x {r['goal']:>4.1f}x  {r['rss_baseline_mib']:>9.1f} "
                     f"{r['rss_peak_gloo_mib']:>10.1f} {r['rss_peak_spotnik_mib']:>13.1f}  {mark}")
    for e in result.get("errors", []):
        lines.append(f"{e['procs']:>5}  FAILED: {e['error']}")
    c = result["config"]
    lines.append(f"float32 all_reduce; median of {c['rounds']} interleaved rounds x {c['iters']} ops; "
                 f"chunk {c['chunk_bytes']} B; {c['cpus']} CPUs; {result['seconds']} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- worker
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_kib(resettable: bool) -> int:
    hwm = _status_kib("VmHWM") if resettable else None
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def start_gloo_and_ring(rank: int, world: int, gloo_port: int, store_url: str, run_id: str, member_id: str,
                        chunk_bytes: int, gloo_timeout_s: float, collective_timeout_s: float) -> object:
    """In a worker process: the default gloo group (tcp on loopback) and a spotnik RingGroup on
    ``store_url``, both over the same ``world`` processes, so the two can be compared in one run.
    Heartbeats are generous (3 s): these comparisons test correctness and speed, not detection."""
    import torch.distributed as dist

    from spotnik_lightning.api import RingTimeouts
    from spotnik_lightning.membership import open_store
    from spotnik_lightning.ring import RingGroup

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=gloo_timeout_s))
    return RingGroup.create(
        open_store(store_url, run_id), world_size=world, member_id=member_id, chunk_bytes=chunk_bytes,
        timeouts=RingTimeouts(heartbeat_interval=timedelta(milliseconds=100), heartbeat_timeout=timedelta(seconds=3),
                              collective=timedelta(seconds=collective_timeout_s)))


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist


    torch.set_num_threads(1)
    n = args.world
    ring = start_gloo_and_ring(args.rank, n, args.gloo_port, args.store, args.run_id, f"bench{args.rank}",
                               args.chunk_bytes, gloo_timeout_s=300, collective_timeout_s=120)
    ring_rank = ring.rank
    resettable = _reset_peak()
    setup_kib = _status_kib("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ops = {"gloo": lambda t: dist.all_reduce(t), "spotnik": lambda t: ring.all_reduce(t)}
    results = []
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            t = torch.empty(size // 4, dtype=torch.float32).uniform_(-1, 1)
            dist.barrier()
            # baseline: the tensor allocated, no op of this size run yet; the peaks include the
            # warmup, so buffers a backend allocates once and keeps are counted against it
            baseline = _status_kib("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peaks = dict.fromkeys(BACKENDS, 0)
            for b in BACKENDS:
                if resettable:
                    _reset_peak()
                for _ in range(args.warmup):
                    ops[b](t)
                    t.uniform_(-1, 1)
                peaks[b] = _peak_kib(resettable)
            blocks: dict[str, list[float]] = {b: [] for b in BACKENDS}
            cpu: dict[str, list[float]] = {b: [] for b in BACKENDS}  # process CPU time (all threads)
            for rnd in range(args.rounds):
                for b in (BACKENDS if rnd % 2 == 0 else BACKENDS[::-1]):
                    t.uniform_(-1, 1)  # keep values finite: sum grows by n per op
                    if resettable:
                        _reset_peak()
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(args.iters):
                        ops[b](t)
                    blocks[b].append(time.perf_counter() - t0)
                    cpu[b].append(time.process_time() - c0)
                    peaks[b] = max(peaks[b], _peak_kib(resettable))
            results.append({"size_bytes": size, "iters": args.iters, "blocks": blocks, "cpu": cpu,
                            "rss_setup_mib": round(setup_kib / 1024, 1),
                            "rss_baseline_mib": round(baseline / 1024, 1),
                            "rss_peak_mib": {b: round(v / 1024, 1) for b, v in peaks.items()},
                            "peak_scope": "block" if resettable else "process"})
            del t
        dist.barrier()
    finally:
        ring.close()
        ring.store.close()
        dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump({"rank": args.rank, "ring_rank": ring_rank, "sizes": results}, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m spotnik_lightning.bench.allreduce`` — a worker (``--worker``, internal) or a
    standalone run printing the JSON result (use ``spotnik bench allreduce`` for a table)."""
    from spotnik_lightning.bench import parse_sizes

    ap = argparse.ArgumentParser(prog="python -m spotnik_lightning.bench.allreduce")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--run-id", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--sizes", default="1MiB,16MiB")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    result = run([int(p) for p in args.procs.split(",")], parse_sizes(args.sizes), args.iters, args.warmup,
                 args.chunk_bytes, rounds=args.rounds)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
