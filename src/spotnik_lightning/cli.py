"""The ``spotnik`` command line.

    spotnik bench allreduce [--procs 2,4] [--sizes 1MiB,16MiB] [--iters K] [--json]
    spotnik bench recovery [ARGS...]          (handled by spotnik_lightning.bench.recovery)
    spotnik status --store URL --run-id RUN [--json]

Exit codes: 0 success, 1 runtime failure (store unreachable, benchmark failed), 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta

from spotnik_lightning.bench import format_size, parse_size


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value % 4:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: float32 tensors need a multiple of 4 bytes")
    return value


def _sizes(text: str) -> list[int]:
    items = text.split(",")
    if any(not s.strip() for s in items):
        raise argparse.ArgumentTypeError(f"bad size list {text!r}: expected e.g. 1MiB,16MiB")
    return [_size(s) for s in items]


def _procs(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad process counts {text!r}: expected N[,N...], e.g. 2,4") from None
    if any(v < 2 or v > 64 for v in values):
        raise argparse.ArgumentTypeError(f"bad process counts {text!r}: each must be in 2..64")
    return values


def _number(cast: type, minimum: float, strict: bool, what: str) -> Callable[[str], float]:
    """An argparse type: ``cast(text)`` that must be > minimum (strict) or >= minimum."""

    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            value = None
        # written so that NaN fails too
        if value is None or not (value > minimum or (not strict and value == minimum)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, 0, True, "a positive integer")
_nonneg_int = _number(int, 0, False, "a non-negative integer")
_positive_float = _number(float, 0.0, True, "a positive number of seconds")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spotnik", description="spotnik-lightning: self-repairing all-reduce ring")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    bench = sub.add_parser("bench", help="run a benchmark")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True
    ar = bsub.add_parser("allreduce", help="ring vs gloo all-reduce bus bandwidth and memory",
                         description="Float32 all-reduce on N local processes: spotnik ring vs gloo, "
                                     "interleaved rounds, median per backend.")
    ar.add_argument("--procs", type=_procs, default=[2], metavar="N[,N...]", help="world sizes (default 2)")
    ar.add_argument("--sizes", type=_sizes, default=[1 << 20, 16 << 20], metavar="SIZE[,SIZE...]",
                    help="tensor sizes: plain bytes or 512KiB, 1MiB, 1GiB (default 1MiB,16MiB)")
    ar.add_argument("--iters", type=_positive_int, default=10, metavar="K", help="all-reduces per timed block")
    ar.add_argument("--warmup", type=_nonneg_int, default=2, help="untimed all-reduces per backend and size")
    ar.add_argument("--rounds", type=_positive_int, default=5, help="interleaved timed rounds (median taken)")
    ar.add_argument("--chunk-bytes", type=_size, default=4 << 20, help="spotnik ring chunk size (default 4MiB)")
    ar.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    # only listed here: main() hands everything after "bench recovery" to that module's main()
    bsub.add_parser("recovery", help="time to repair the ring after a failure (see spotnik bench recovery -h)")

    st = sub.add_parser("status", help="show a run's membership from its store")
    st.add_argument("--store", required=True, metavar="URL",
                    help="etcd://host:port[,host:port...], embedded://host:port or host:port")
    st.add_argument("--run-id", required=True, metavar="RUN")
    st.add_argument("--timeout", type=_positive_float, default=3.0, help="store timeout in seconds (default 3)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "recovery"]:
        # every option after "recovery" belongs to the recovery module's own parser
        return _bench_recovery(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench" and args.bench == "allreduce":
        return _bench_allreduce(args)
    if args.command == "status":
        return _status(parser, args)
    parser.error(f"unknown command {args.command!r}")  # unreachable: argparse validates
    return 2


def _bench_allreduce(args: argparse.Namespace) -> int:
    from spotnik_lightning.bench.allreduce import format_table, run

    try:
        result = run(args.procs, args.sizes, args.iters, args.warmup, args.chunk_bytes, rounds=args.rounds)
    except (RuntimeError, ValueError) as exc:
        print(f"spotnik bench allreduce: {exc}", file=sys.stderr)
        return 1
    if args.json:
        slim = {"config": result["config"], "seconds": result["seconds"],
                "rows": [{k: v for k, v in r.items() if k not in ("rss_per_worker",)} for r in result["rows"]],
                "errors": [{"procs": e["procs"], "error": e["error"]} for e in result["errors"]]}
        for r in slim["rows"]:
            r["size"] = format_size(r["size_bytes"])
        print(json.dumps(slim))
    else:
        print(format_table(result))
    for e in result["errors"]:
        print(f"spotnik bench allreduce: {e['detail']}", file=sys.stderr)
    return 1 if result["errors"] else 0


def _bench_recovery(rest: list[str]) -> int:
    try:
        mod = importlib.import_module("spotnik_lightning.bench.recovery")
    except ModuleNotFoundError as exc:
        if exc.name not in ("spotnik_lightning.bench.recovery",):
            raise
        print("spotnik bench recovery: not available in this installation "
              "(module spotnik_lightning.bench.recovery is missing)", file=sys.stderr)
        return 2
    code = mod.main(rest)
    return int(code) if code is not None else 0


def _status(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from spotnik_lightning.api import BackendConnectionError, ConfigError
    from spotnik_lightning.membership import open_store

    try:
        store = open_store(args.store, args.run_id, timedelta(seconds=args.timeout))
    except ConfigError as exc:
        parser.exit(2, f"spotnik status: {exc}\n")
    try:
        membership = store.get_membership()
        registered = store.registered()
    except BackendConnectionError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"spotnik status: cannot reach the store at {args.store}: {first}", file=sys.stderr)
        return 1
    finally:
        store.close()
    alive = {m.id for m in registered}
    members = [{"rank": i, "id": m.id, "host": m.host, "port": m.port, "address": f"{m.host}:{m.port}",
                "tier": m.tier, "alive": m.id in alive} for i, m in enumerate(membership.members if membership else ())]
    in_ring = {m["id"] for m in members}
    regs = [{"id": m.id, "host": m.host, "port": m.port, "address": f"{m.host}:{m.port}", "tier": m.tier,
             "member": m.id in in_ring} for m in registered]
    status = {"store": args.store, "run_id": args.run_id, "epoch": membership.epoch if membership else 0,
              "size": len(members), "members": members, "registered": regs}
    if args.json:
        print(json.dumps(status))
        return 0
    print(f"run {args.run_id} on {args.store}")
    if membership is None:
        print("epoch 0: no membership committed yet")
    else:
        print(f"epoch {membership.epoch}, {len(members)} member(s):")
        print(f"  {'rank':>4}  {'id':<20} {'address':<22} {'tier':<10} alive")
        for m in members:
            print(f"  {m['rank']:>4}  {m['id']:<20} {m['address']:<22} {m['tier']:<10} {'yes' if m['alive'] else 'NO'}")
    print(f"{len(regs)} registered (alive) worker(s):")
    for r in regs:
        note = "" if r["member"] else "  (not a member: waiting to join)"
        print(f"  {r['id']:<20} {r['address']:<22} {r['tier']:<10}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
