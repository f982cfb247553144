"""One worker process of tests/test_collectives.py: spotnik's ring vs gloo on the same inputs.

Run as ``python tests/workers/collectives_worker.py --store URL --run-id RUN --world N --rank R
--gloo-port P --out FILE``. The worker joins a gloo process group (rank R) and a spotnik RingGroup
(whose rank is the store's registration order, so it may differ from R), then runs every case of
:func:`build_cases(N) <build_cases>` in order and appends one JSON line per case to ``FILE``:
``{"case": name, "ok": bool, "error": str, "info": {...}}``.

Every input is generated from the worker's RING rank, so "rank k's input" means the same tensor
for both backends; gloo runs on a copy of the same per-process input. Each case does its
collectives unconditionally on every rank and only then checks locally, so a failed check never
desynchronises the ranks. A collective that raises ends the worker (the remaining cases are
reported as not run).

The module is also imported by the test to enumerate the cases (``build_cases``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time
import traceback
from dataclasses import dataclass, field

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "bool")
MIB = 1 << 20


@dataclass(frozen=True)
class Case:
    """One test case. ``kind``: allreduce, broadcast, all_gather, barrier, exchange, sendrecv, memory."""

    name: str
    kind: str
    numel: int = 0
    dtype: str = "float32"
    op: str = "sum"
    layout: str = "contig"  # contig | transposed | strided
    src: int = 0
    params: dict = field(default_factory=dict)


def _ar(numel: int, dtype: str, op: str, layout: str = "contig") -> Case:
    return Case(f"allreduce-{dtype}-{op}-{numel}-{layout}", "allreduce", numel, dtype, op, layout)


def build_cases(n: int, suite: str = "main") -> list[Case]:
    """The ordered case list for world size ``n`` (8 gets a reduced set to bound the runtime).

    suite "slow-sends": a few all-reduces to run while the caller thread is slowed down as it
    queues its initial sends (``--inject slow-initial-sends``), so the reader thread forwards
    received frames meanwhile; 196608 = 3 x 4 x 16384 float32 gives n=3 segments of exactly four
    64 KiB chunks (every frame the same length, so a mis-ordered frame cannot be caught by its size).
    """
    if suite == "slow-sends":
        return [_ar(196608, "float32", "sum"), _ar((1 << 20) + 3, "float32", "sum"), _ar(1000, "int64", "sum")]
    cases: list[Case] = []
    ops = ("sum", "min", "max", "product", "avg")
    if n <= 4:
        small = (1, 2, 7, 1000, (1 << 16) + 1)
        for size in small:
            for op in ops:
                cases.append(_ar(size, "float32", op))
        for size in ((1 << 20) + 3, 4 * MIB):  # 4 M float32 elements = 16 MiB
            cases.append(_ar(size, "float32", "sum"))
        cases.append(_ar((1 << 20) + 3, "float32", "avg"))
        for dtype in ("float64", "float16", "bfloat16"):
            for size in (2, 7, 1000, (1 << 16) + 1):
                for op in ops:
                    cases.append(_ar(size, dtype, op))
        cases.append(_ar((1 << 20) + 3, "float64", "sum"))
        for dtype in ("int32", "int64"):
            for size in (1, 2, 7, 1000, (1 << 16) + 1):
                for op in ops:
                    cases.append(_ar(size, dtype, op))
        for size in (1, 7, 1000, (1 << 16) + 1):
            for op in ("sum", "min", "max", "product"):
                cases.append(_ar(size, "uint8", op))
                cases.append(_ar(size, "bool", op))
        for dtype, op in (("float32", "sum"), ("float32", "avg"), ("int64", "max"), ("bfloat16", "sum")):
            cases.append(_ar(129 * 257, dtype, op, "transposed"))
            cases.append(_ar(3001, dtype, op, "strided"))
        for src in range(n):
            for size, dtype in ((7, "float32"), ((1 << 16) + 1, "float32"), (1000, "int64"), ((1 << 20) + 3, "uint8")):
                cases.append(Case(f"broadcast-{dtype}-{size}-src{src}", "broadcast", size, dtype, src=src))
        for size, dtype in ((1, "float32"), (7, "float32"), (1000, "int32"), ((1 << 16) + 1, "float32"),
                            ((1 << 18) + 5, "float64")):
            cases.append(Case(f"all_gather-{dtype}-{size}", "all_gather", size, dtype))
        for size, dtype in ((1000, "float32"), ((1 << 20) + 3, "float32"), (7, "int64")):
            for pairing in ("xor", "mirror"):
                cases.append(Case(f"exchange-{pairing}-{dtype}-{size}", "exchange", size, dtype,
                                  params={"pairing": pairing}))
    else:
        for size in (1, 2, 7, 1000, (1 << 16) + 1, (1 << 20) + 3):
            cases.append(_ar(size, "float32", "sum"))
        for op in ("min", "max", "product", "avg"):
            for size in (7, 1000):
                cases.append(_ar(size, "float32", op))
        for dtype, op, size in (("int64", "sum", 7), ("int64", "max", (1 << 16) + 1), ("int32", "avg", 1000),
                                ("float64", "sum", 1000), ("float16", "sum", 1000), ("bfloat16", "sum", 1000),
                                ("uint8", "sum", 1000), ("bool", "max", 7), ("bool", "min", 7)):
            cases.append(_ar(size, dtype, op))
        cases.append(_ar(129 * 257, "float32", "sum", "transposed"))
        cases.append(_ar(3001, "float32", "max", "strided"))
        for src in range(n):
            cases.append(Case(f"broadcast-float32-1000-src{src}", "broadcast", 1000, "float32", src=src))
        cases.append(Case("all_gather-float32-1000", "all_gather", 1000, "float32"))
        cases.append(Case("exchange-xor-float32-1000", "exchange", 1000, "float32", params={"pairing": "xor"}))
    cases.append(Case("sendrecv-float32-65537", "sendrecv", (1 << 16) + 1, "float32"))
    cases.append(Case("barrier", "barrier"))
    if n == 2:
        cases.append(Case("memory-allreduce-float32-64MiB", "memory", 16 * MIB, "float32", "sum"))
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), "duplicate case names"
    return cases


# ---------------------------------------------------------------------------------------- worker
def _slow_caller_sends(delay: float = 0.001) -> None:
    """Fault injection: every data frame the MAIN thread queues on a ring link waits ``delay``
    first, as if the caller were descheduled (GIL switch, loaded machine) while it queues the
    collective's initial sends. Frames forwarded by reader threads are not delayed."""
    import threading

    from spotnik_lightning.ring import links

    original = links.OutLink.send

    def send(self, header, payload=None, done=None, data=True):  # type: ignore[no-untyped-def]
        if data and threading.current_thread() is threading.main_thread():
            time.sleep(delay)
        return original(self, header, payload, done, data)

    links.OutLink.send = send


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True, help="gloo rank")
    ap.add_argument("--gloo-port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20)
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--suite", default="main", choices=("main", "slow-sends"))
    ap.add_argument("--inject", default="", choices=("", "slow-initial-sends"))
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from spotnik_lightning.bench.allreduce import start_gloo_and_ring

    torch.set_num_threads(1)
    n = args.world
    if args.inject == "slow-initial-sends":
        _slow_caller_sends()
    out = open(args.out, "a", buffering=1)

    def emit(case: str, ok: bool, error: str = "", info: dict | None = None) -> None:
        out.write(json.dumps({"case": case, "ok": ok, "error": error, "info": info or {}}) + "\n")

    ring = start_gloo_and_ring(args.rank, n, args.gloo_port, args.store, args.run_id, f"w{args.rank}",
                               args.chunk_bytes, gloo_timeout_s=60, collective_timeout_s=60)
    ring_ranks = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(ring_ranks, torch.tensor([ring.rank]))
    ring_of_gloo = [int(t.item()) for t in ring_ranks]  # ring rank of gloo rank g
    gloo_of_ring = [ring_of_gloo.index(r) for r in range(n)]
    assert sorted(ring_of_gloo) == list(range(n)), ring_of_gloo
    rr = ring.rank
    emit("_setup", True, info={"ring_rank": rr, "gloo_rank": args.rank, "ring_of_gloo": ring_of_gloo})

    def dt(name: str) -> torch.dtype:
        return getattr(torch, name)

    def make_input(idx: int, case: Case, rank: int, numel: int | None = None) -> torch.Tensor:
        """Deterministic input of ring rank ``rank`` for case number ``idx``."""
        numel = case.numel if numel is None else numel
        g = torch.Generator().manual_seed(7919 * idx + rank)
        d = dt(case.dtype)
        if case.dtype == "bool":
            return torch.randint(0, 2, (numel,), generator=g).bool()
        if d.is_floating_point:
            x = torch.rand(numel, generator=g)
            x = x + 0.5 if case.op == "product" else x * 2 - 1
            return x.to(d)
        if case.dtype == "uint8":
            hi = {"sum": 256 // n, "avg": 256 // n, "product": 3}.get(case.op, 256)
            return torch.randint(0, hi, (numel,), generator=g, dtype=torch.uint8)
        lo, hi = (-2, 3) if case.op == "product" else (-1000, 1000)
        return torch.randint(lo, hi, (numel,), generator=g, dtype=d)

    def digest(t: torch.Tensor) -> torch.Tensor:
        b = t.contiguous().view(-1).view(torch.uint8)
        return torch.frombuffer(bytearray(hashlib.sha256(memoryview(b.numpy())).digest()), dtype=torch.uint8)

    def identical_across_ranks(t: torch.Tensor) -> bool:
        """Bit-identical on every rank: small tensors are gathered whole (via gloo), large ones as
        a SHA-256 of their bytes."""
        c = t.contiguous().view(-1)
        if c.numel() * c.element_size() <= (64 << 10):
            payload = c.view(torch.uint8).clone()
        else:
            payload = digest(c)
        gathered = [torch.empty_like(payload) for _ in range(n)]
        dist.all_gather(gathered, payload)
        return all(torch.equal(gathered[0], x) for x in gathered)

    def tolerances(case: Case) -> dict:
        if case.op in ("min", "max") or not dt(case.dtype).is_floating_point:
            return {"rtol": 0.0, "atol": 0.0}
        if case.dtype == "float16":
            return {"rtol": 1e-2, "atol": 4e-3 * n}
        if case.dtype == "bfloat16":
            return {"rtol": 5e-2, "atol": 3e-2 * n}
        return {}  # float32 / float64: assert_close defaults

    gloo_op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
               "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.SUM}

    def gloo_reference(x: torch.Tensor, op: str) -> torch.Tensor:
        """gloo's result for ``op`` on this process's input ``x`` (AVG = SUM / n, floor for ints)."""
        ref = x.clone().contiguous()
        dist.all_reduce(ref, gloo_op[op])
        if op == "avg":
            if ref.is_floating_point():
                ref.div_(n)
            elif ref.dtype != torch.bool:
                ref = torch.div(ref, n, rounding_mode="floor")
        return ref

    def run_allreduce(idx: int, case: Case) -> tuple[list[str], dict]:
        problems: list[str] = []
        x = make_input(idx, case, rr)
        if case.layout == "transposed":
            base = x.view(129, 257)
            t = base.t()  # non-contiguous view of base
            original = None
        elif case.layout == "strided":
            base = x.clone()
            t = base[::3]
            original = x.clone()
        else:
            base = t = x.clone()
            original = None
        inp = t.clone()  # the logical input (same shape, contiguous)
        assert case.layout == "contig" or not t.is_contiguous()
        ring.all_reduce(t, case.op)
        ref = gloo_reference(inp, case.op)
        same = identical_across_ranks(t)
        if not same:
            problems.append("ring result differs across ranks")
        try:
            if case.op in ("min", "max") or not t.is_floating_point():
                if not torch.equal(t.contiguous(), ref):
                    bad = (t.contiguous() != ref).sum().item()
                    problems.append(f"{bad} of {t.numel()} elements differ from gloo")
            else:
                torch.testing.assert_close(t.contiguous(), ref, **tolerances(case))
        except AssertionError as exc:
            problems.append(f"differs from gloo: {exc}")
        if case.dtype == "bool":
            # logical semantics, independent of gloo: gather every rank's input by regeneration
            allin = torch.stack([make_input(idx, case, r) for r in range(n)])
            expect = allin.any(0) if case.op in ("sum", "max") else allin.all(0)
            if not torch.equal(t, expect):
                problems.append("bool result is not the logical any/all of the inputs")
        if case.layout == "strided":
            if not (torch.equal(base[1::3], original[1::3]) and torch.equal(base[2::3], original[2::3])):
                problems.append("strided all_reduce touched elements outside the view")
        if case.layout == "transposed" and not torch.equal(base.t(), t):
            problems.append("transposed view and its base disagree")
        return problems, {}

    def run_broadcast(idx: int, case: Case) -> tuple[list[str], dict]:
        problems: list[str] = []
        x = make_input(idx, case, rr)
        t = x.clone()
        ring.broadcast(t, case.src)
        ref = x.clone()
        dist.broadcast(ref, gloo_of_ring[case.src])
        if not torch.equal(t, ref):
            problems.append("differs from gloo broadcast")
        if not torch.equal(t, make_input(idx, case, case.src)):
            problems.append("differs from the source's input")
        if not identical_across_ranks(t):
            problems.append("ring result differs across ranks")
        return problems, {}

    def run_all_gather(idx: int, case: Case) -> tuple[list[str], dict]:
        problems: list[str] = []
        x = make_input(idx, case, rr)
        outp = torch.full((n * case.numel,), 3, dtype=x.dtype)
        ring.all_gather(outp, x)
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x)
        ref = torch.cat([parts[gloo_of_ring[r]] for r in range(n)])  # gloo orders by gloo rank
        if not torch.equal(outp, ref):
            problems.append("differs from gloo all_gather (reordered by ring rank)")
        if not torch.equal(outp, torch.cat([make_input(idx, case, r) for r in range(n)])):
            problems.append("block r is not ring rank r's input")
        if not identical_across_ranks(outp):
            problems.append("ring result differs across ranks")
        return problems, {}

    def run_exchange(idx: int, case: Case) -> tuple[list[str], dict]:
        problems: list[str] = []
        peer = (rr ^ 1 if (rr ^ 1) < n else rr) if case.params["pairing"] == "xor" else n - 1 - rr
        x = make_input(idx, case, rr)
        got = torch.zeros_like(x)
        ring.exchange(x, got, peer)
        if not torch.equal(got, make_input(idx, case, peer)):
            problems.append(f"rank {rr} did not receive rank {peer}'s tensor")
        if not torch.equal(x, make_input(idx, case, rr)):
            problems.append("exchange modified the send tensor")
        dist.barrier()
        return problems, {"peer": peer}

    def run_sendrecv(idx: int, case: Case) -> tuple[list[str], dict]:
        problems: list[str] = []
        if rr == 0:
            ring.send(make_input(idx, case, 0), n - 1)
        elif rr == n - 1:
            got = torch.zeros(case.numel, dtype=dt(case.dtype))
            ring.recv(got, 0)
            if not torch.equal(got, make_input(idx, case, 0)):
                problems.append("recv did not get rank 0's tensor")
        dist.barrier()
        return problems, {}

    def run_barrier(idx: int, case: Case) -> tuple[list[str], dict]:
        problems: list[str] = []
        dist.barrier()
        if rr == 0:
            time.sleep(0.3)
        entered = time.time()
        ring.barrier()
        left = time.time()
        stamps = torch.tensor([entered, left], dtype=torch.float64)
        allst = [torch.empty_like(stamps) for _ in range(n)]
        dist.all_gather(allst, stamps)
        last_entry = max(s[0].item() for s in allst)
        first_exit = min(s[1].item() for s in allst)
        if first_exit < last_entry:
            problems.append(f"a rank left the barrier {last_entry - first_exit:.3f} s before the last entered")
        return problems, {"wait_s": round(left - entered, 3)}

    def rss_kib(field_name: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
        raise RuntimeError(f"{field_name} not in /proc/self/status")

    def run_memory(idx: int, case: Case) -> tuple[list[str], dict]:
        """64 MiB all_reduce: peak RSS growth must stay far below one extra copy of the tensor."""
        problems: list[str] = []
        t = make_input(idx, case, rr)  # 64 MiB, every page touched
        dist.barrier()
        try:  # reset VmHWM to the current RSS (Linux >= 4.0) so the peak is this collective's
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            method = "VmHWM after clear_refs"
        except OSError:
            method = "VmHWM (process lifetime; not reset)"
        before = rss_kib("VmRSS")
        maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        ring.all_reduce(t, case.op)
        elapsed = time.perf_counter() - t0
        peak = rss_kib("VmHWM")
        maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        growth_mib = (peak - before) / 1024
        limit_mib = case.numel * 4 / MIB * 0.25 + 2 * args.chunk_bytes / MIB
        if growth_mib > limit_mib:
            problems.append(f"peak RSS grew {growth_mib:.1f} MiB during a 64 MiB all_reduce (limit {limit_mib:.1f})")
        same = identical_across_ranks(t)
        x = make_input(idx, case, rr)
        ref = gloo_reference(x, case.op)
        del x
        try:
            torch.testing.assert_close(t, ref)
        except AssertionError as exc:
            problems.append(f"differs from gloo: {exc}")
        if not same:
            problems.append("ring result differs across ranks")
        return problems, {"rss_before_mib": round(before / 1024, 1), "peak_mib": round(peak / 1024, 1),
                          "growth_mib": round(growth_mib, 2), "limit_mib": round(limit_mib, 2), "method": method,
                          "ru_maxrss_growth_mib": round((maxrss_after - maxrss_before) / 1024, 2),
                          "seconds": round(elapsed, 3)}

    runners = {"allreduce": run_allreduce, "broadcast": run_broadcast, "all_gather": run_all_gather,
               "exchange": run_exchange, "sendrecv": run_sendrecv, "barrier": run_barrier, "memory": run_memory}
    only = set(filter(None, args.only.split(",")))
    cases = build_cases(n, args.suite)
    fatal = None
    for idx, case in enumerate(cases):
        if only and case.name not in only:
            continue
        if fatal is not None:
            emit(case.name, False, f"not run: an earlier collective failed ({fatal})")
            continue
        t0 = time.perf_counter()
        try:
            problems, info = runners[case.kind](idx, case)
        except AssertionError as exc:  # a local check; the ranks are still in step
            problems, info = [f"assertion: {exc}"], {}
        except Exception as exc:  # a collective failed: the ranks may be out of step now
            fatal = f"{case.name}: {type(exc).__name__}: {exc}"
            emit(case.name, False, f"collective raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            continue
        info["seconds"] = info.get("seconds", round(time.perf_counter() - t0, 3))
        emit(case.name, not problems, "; ".join(problems), info)
    emit("_done", fatal is None, fatal or "")
    if fatal is None:
        dist.barrier()
    ring.close()
    ring.store.close()
    dist.destroy_process_group()
    out.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(_main())
