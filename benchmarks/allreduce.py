"""All-reduce bus bandwidth: spotnik ring vs gloo (thin wrapper over spotnik_lightning.bench.allreduce).

    python benchmarks/allreduce.py --procs 2,4,8 --sizes 1MiB,16MiB,64MiB --iters 5 --json

Writes the result JSON to --out and a bar plot of the spotnik/gloo ratio per (procs, size) to
--plot, with the goal as a dashed line (1.0x for n <= 4, 0.8x for n = 8).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spotnik_lightning.bench import parse_sizes
from spotnik_lightning.bench.allreduce import format_table, goal_for, run


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad process counts {text!r}: expected e.g. 2,4,8") from None
    if any(v < 2 for v in values):
        raise argparse.ArgumentTypeError(f"bad process counts {text!r}: each must be >= 2")
    return values


def _sizes(text: str) -> list[int]:
    try:
        sizes = parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if any(s % 4 for s in sizes):
        raise argparse.ArgumentTypeError(f"bad sizes {text!r}: float32 tensors need multiples of 4 bytes")
    return sizes


def plot(result: dict, path: Path) -> None:
    """Bar chart of spotnik/gloo bus-bandwidth ratio, grouped by process count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    procs = sorted({r["procs"] for r in rows})
    sizes = sorted({r["size_bytes"] for r in rows})
    labels = {r["size_bytes"]: r["size"] for r in rows}
    width = 0.8 / len(sizes)
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(procs), 4))
    for j, size in enumerate(sizes):
        xs, ys = [], []
        for i, n in enumerate(procs):
            row = next((r for r in rows if r["procs"] == n and r["size_bytes"] == size), None)
            if row is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(row["ratio"])
        bars = ax.bar(xs, ys, width * 0.92, label=labels[size])
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    for i, n in enumerate(procs):
        ax.hlines(goal_for(n), i - 0.45, i + 0.45, colors="black", linestyles="dashed", linewidth=1.2,
                  label="goal" if i == 0 else None)
    ax.set_xticks(range(len(procs)), [f"{n} procs" for n in procs])
    ax.set_ylabel("spotnik / gloo bus bandwidth")
    ax.set_title("float32 all_reduce, spotnik ring vs gloo (CPU, loopback)")
    ax.legend(fontsize=8, loc="best")
    ax.set_ylim(0, max([1.2] + [r["ratio"] * 1.15 for r in rows]))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=_int_list, default=[2, 4, 8], help="world sizes (default 2,4,8)")
    ap.add_argument("--sizes", type=_sizes, default=parse_sizes("1MiB,16MiB,64MiB"),
                    help="tensor sizes in bytes (default 1MiB,16MiB,64MiB)")
    ap.add_argument("--iters", type=int, default=5, help="all-reduces per timed block (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed all-reduces per backend and size (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds, median taken (default 5)")
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20, help="spotnik ring chunk size (default 4 MiB)")
    ap.add_argument("--json", action="store_true", help="print the JSON result instead of a table")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out/allreduce.json"))
    ap.add_argument("--plot", type=Path, default=Path("benchmarks/out/allreduce.png"))
    args = ap.parse_args(argv)
    result = run(args.procs, args.sizes, args.iters, args.warmup, args.chunk_bytes, rounds=args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if result["rows"]:
        plot(result, args.plot)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)
    for e in result["errors"]:
        print(f"n={e['procs']} failed: {e['detail']}", file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
