"""Fig. 6 of the Spotnik paper on this machine: per-worker throughput as workers are added, for fixed
S-SGD, fixed AD-PSGD and adaptive switching (AdaptiveSync + ThroughputTrigger).

Every worker is a "host" of its own: a network namespace (tests/netns.py) whose data link is shaped
with ``tc tbf`` (``--rate``); the membership store (etcd) runs in the switch namespace. A worker's
compute is emulated by ``--pace`` seconds of sleep per step (the machine has 2 cores; sleeping keeps
six workers from competing for them), on top of a real MLP whose size (``--hidden``) sets the bytes
each step moves. The run starts with 1 worker and adds one every ``--period`` seconds up to
``--workers``; per-worker throughput (samples per second of each worker's own slices) is binned in
``--bin`` seconds from the commit events (bins overlapping a join include its stall). Two per-bin
means: ``per_worker`` divides each worker's samples by the whole bin (a worker admitted mid-bin
counts as idle before it existed), ``per_worker_present`` by the part of the bin since its admission.
Writes benchmarks/out/adaptive_fig6.json and docs/img/adaptive_fig6.png. Needs root.

  python benchmarks/adaptive_fig6.py --workers 6 --period 15 --rate 8mbit --pace 0.2 --hidden 160
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from netns import NetnsBed, start_etcd  # noqa: E402

from spotnik_lightning.bench.cluster import LocalCluster  # noqa: E402

WORKER = "spotnik_lightning.bench.lightning_worker"
OUT = Path(__file__).parent / "out"


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    """One run: 1 worker, one more every period; returns per-second per-worker throughput."""
    n = args.workers
    with tempfile.TemporaryDirectory(prefix="fig6-") as tmp, NetnsBed(n) as bed, ExitStack() as stack:
        for h in bed.hosts:
            bed.rate_limit(h, args.rate, burst="64kb", latency="400ms")
        start_etcd(bed, Path(tmp) / "etcd")
        url = f"etcd://{bed.switch_addr}:2379"
        run_id = f"fig6-{mode}-{uuid.uuid4().hex[:6]}"
        cfg = dict(entry=f"{WORKER}:run", epochs=1000, n_data=100_000, batch=args.batch, pace_s=args.pace,
                   hidden=args.hidden, hb_ms=200, hb_timeout_ms=5000, verify=False, scheduler=False,
                   sync="adpsgd" if mode == "adpsgd" else "ssgd")
        if mode == "switching":
            cfg["adaptive"] = {"policy": "throughput", "fraction": args.fraction, "window": 5}
        clusters = [stack.enter_context(LocalCluster(url, run_id, netns=h, preload=("lightning.pytorch", WORKER),
                                                     **cfg)) for h in bed.hosts]  # zygotes first
        t0 = time.time()
        joined = []
        for i, (h, c) in enumerate(zip(bed.hosts, clusters, strict=True)):
            env = {"SPOTNIK_HOST": bed.addr[h]}
            c.spawn(f"w{i}", world_size=1 if i == 0 else None, env=env)
            joined.append(time.time() - t0)
            if i == 0:
                c.wait_for(lambda e: e["ev"] == "commit", 120, "the first step")
                t0 = time.time()
                joined[0] = 0.0
            time.sleep(args.period)
        events = [e for c in clusters for e in c.of("commit")]
        errors = [e for c in clusters for e in c.of("error")]
    admitted = _admission_times(events, t0)
    bins: dict[int, dict[str, int]] = {}
    world: dict[int, int] = {}
    sync: dict[int, str] = {}
    for e in events:
        s = int((e["t"] - t0) // args.bin * args.bin)
        if s < 0:
            continue
        bins.setdefault(s, {}).setdefault(e["id"], 0)
        bins[s][e["id"]] += len(e["indices"])
        world[s] = max(world.get(s, 0), e["world"])
        sync[s] = e["sync"]
    def present(s: int, mid: str) -> float:  # seconds of the bin the worker was a member (from its admission)
        return min(args.bin, s + args.bin - max(s, admitted.get(mid, 0.0)))

    series = [{"t": s, "world": world[s], "sync": sync[s],
               "per_worker": statistics.mean(bins[s].values()) / args.bin,
               "per_worker_present": statistics.mean(n / present(s, mid) for mid, n in bins[s].items())}
              for s in sorted(bins)[:-1]]  # last: partial
    return {"mode": mode, "joined_s": joined, "admitted_s": admitted, "series": series, "errors": errors}


def _admission_times(events: list[dict], t0: float) -> dict[str, float]:
    """When each worker became a member (seconds after t0): the last commit (by anyone) of the step
    before the first step whose membership includes it — the step boundary it was admitted at. The
    founder counts from t0. So a joiner's time receiving state and starting its first step counts
    as its own (slow) time, and its time before admission (process start, waiting) does not."""
    first: dict[str, int] = {}
    done: dict[int, float] = {}
    for e in events:
        for m in e["members"]:
            first[m] = min(first.get(m, e["step"]), e["step"])
        done[e["step"]] = max(done.get(e["step"], 0.0), e["t"] - t0)
    return {m: done.get(step - 1, 0.0) for m, step in first.items()}


def summarise(res: dict, baseline: float, key: str = "per_worker") -> dict:
    """Per world size: median per-worker throughput (after the first 3 s of it) relative to baseline."""
    by: dict[int, list[float]] = {}
    last_world, since = 0, 0
    for p in res["series"]:
        if p["world"] != last_world:
            last_world, since = p["world"], p["t"]
        if p["t"] - since >= 3:
            by.setdefault(p["world"], []).append(p.get(key, p["per_worker"]))
    return {w: round(statistics.median(v) / baseline, 3) for w, v in sorted(by.items())}


def _min_after_join(res: dict, baseline: float, width: float, skip_joins: bool = False,
                    key: str = "per_worker") -> float:
    """The lowest binned per-worker throughput / baseline once the second worker is in
    (``skip_joins``: leaving out the bins in which a worker joined, i.e. the join stalls)."""
    start = res["joined_s"][1] + width

    def join_bin(t: float) -> bool:
        return any(t <= j < t + width for j in res["joined_s"][1:])

    after = [p.get(key, p["per_worker"]) / baseline for p in res["series"] if p["world"] > 1 and p["t"] >= start
             and not (skip_joins and join_bin(p["t"]))]
    return round(min(after), 3) if after else float("nan")


def plot(results: list[dict], baseline: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for r in results:
        ts = [p["t"] for p in r["series"]]
        line, = ax.plot(ts, [p.get("per_worker_present", p["per_worker"]) / baseline for p in r["series"]],
                        label=r["mode"])
        if "per_worker_present" in r["series"][0]:  # the bin-wide mean, which counts a joiner as idle
            ax.plot(ts, [p["per_worker"] / baseline for p in r["series"]], ls=":", lw=0.8, c=line.get_color())
    ax.axhline(0.6, ls="--", c="grey", lw=0.8)
    for t in results[0]["joined_s"][1:]:
        ax.axvline(t, c="lightgrey", lw=0.6)
    ax.set_xlabel("time (s); a worker joins at each vertical line")
    ax.set_ylabel("per-worker throughput / 1-worker baseline")
    ax.set_title("solid: each worker over its time as a member; dotted: over the whole 3 s bin", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--period", type=float, default=15.0)
    ap.add_argument("--rate", default="8mbit")
    ap.add_argument("--pace", type=float, default=0.2)
    ap.add_argument("--hidden", type=int, default=160)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--fraction", type=float, default=0.65, help="ThroughputTrigger fraction for 'switching'")
    ap.add_argument("--modes", default="ssgd,adpsgd,switching")
    ap.add_argument("--bin", type=float, default=3.0, help="seconds per throughput bin")
    ap.add_argument("--replot", action="store_true", help="re-summarise and re-plot the runs of the last JSON")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads((OUT / "adaptive_fig6.json").read_text())
        results = saved["runs"]
        for r in results:  # older files kept the trailing partial bin
            r["series"] = [p for p in r["series"] if p["t"] + args.bin <= r["joined_s"][-1] + args.period]
    else:
        results = [run_mode(args, m) for m in args.modes.split(",")]
    first = next(r for r in results if r["mode"] == "ssgd") if "ssgd" in args.modes else results[0]
    one = [p["per_worker"] for p in first["series"] if p["world"] == 1][1:]
    baseline = statistics.median(one)
    out = {"args": vars(args), "baseline_samples_per_s": baseline,
           "relative_by_world": {r["mode"]: summarise(r, baseline) for r in results},
           "min_relative_after_first_join": {r["mode"]: _min_after_join(r, baseline, args.bin) for r in results},
           "min_relative_outside_join_bins": {r["mode"]: _min_after_join(r, baseline, args.bin, True) for r in results},
           "relative_by_world_present": {r["mode"]: summarise(r, baseline, "per_worker_present") for r in results},
           "min_relative_after_first_join_present": {
               r["mode"]: _min_after_join(r, baseline, args.bin, key="per_worker_present") for r in results},
           "runs": results}
    OUT.mkdir(exist_ok=True)
    (OUT / "adaptive_fig6.json").write_text(json.dumps(out, indent=1))
    plot(results, baseline, Path(__file__).resolve().parent.parent / "docs" / "img" / "adaptive_fig6.png")
    print(json.dumps({k: out[k] for k in ("baseline_samples_per_s", "relative_by_world", "relative_by_world_present",
                                           "min_relative_after_first_join", "min_relative_outside_join_bins",
                                           "min_relative_after_first_join_present")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
