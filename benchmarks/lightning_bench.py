"""Lightning-level benchmarks of SpotnikStrategy (issue 3). Prints JSON; writes benchmarks/out/*.json.

  step        spotnik vs Lightning DDPStrategy(gloo): median step time and peak RSS per worker
  commit      atomic vs pipelined (no vote) commit on ResNet-50 / VGG-16 / Inception-V3 / BERT-base shapes,
              both modes interleaved in one run (--interleave 0: separate runs)
  revocation  time lost per revocation in a training run (stall around each kill, and total wall time)
  join        how long the members stall when a worker joins a 25 M-parameter model trained with Adam

All runs use real processes forked from one pre-imported zygote, an embedded membership store, and
compare against the peer in the same invocation (ratios), because the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

from spotnik_lightning.bench.cluster import LocalCluster
from spotnik_lightning.membership.embedded import EmbeddedStoreServer

WORKER = "spotnik_lightning.bench.lightning_worker"
OUT = Path(__file__).parent / "out"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(url: str, n: int, entry: str, timeout: float = 900, faults: dict[int, str] | None = None,
         joiner_after: int | None = None, **cfg: object) -> tuple[dict[str, dict], list[dict]]:
    with LocalCluster(url, f"b-{uuid.uuid4().hex[:8]}", preload=("lightning.pytorch", WORKER),
                      entry=f"{WORKER}:{entry}", **cfg) as c:
        port = _free_port()
        ids = [f"w{i}" for i in range(n)]
        for i, mid in enumerate(ids):
            env = {"SPOTNIK_FAULT": faults[i]} if faults and i in faults else {}
            c.spawn(mid, world_size=n, rank=i, master_port=port, env=env)
        if joiner_after is not None:
            c.wait_for(lambda e: e["ev"] == "commit" and e["step"] == joiner_after, timeout, "the join point")
            c.spawn("joiner")
            ids.append("joiner")
        alive = [m for i, m in enumerate(ids) if not (faults and i in faults)]
        ends = c.wait_all(alive, lambda e: e["ev"] in ("done", "error"), timeout, "the end of the run")
        bad = {k: v for k, v in ends.items() if v["ev"] != "done"}
        if bad:
            raise RuntimeError(f"workers failed: {bad}")
        return ends, c.of("commit")


def _median_step(ends: dict[str, dict], skip: int = 3, key: str = "step_times") -> float:
    per = [statistics.median(e[key][skip:] or e[key]) for e in ends.values() if e.get(key)]
    return statistics.median(per)


def bench_step(args: argparse.Namespace, url: str) -> dict:
    out = {}
    for model in args.models.split(","):
        steps = args.steps
        cfg = dict(model=model, batch=args.batch, n_data=args.workers * args.batch * steps, epochs=1, verify=False,
                   hb_ms=100, hb_timeout_ms=3000, pace_s=0.0, quiet=True)
        rows = []
        for _ in range(args.repeat):  # alternate the order: the machine drifts
            ours, _c = _run(url, args.workers, "run", **cfg)
            theirs, _c = _run(url, args.workers, "run_ddp", **cfg)
            rows.append({"spotnik_s": _median_step(ours), "ddp_s": _median_step(theirs),
                         "spotnik_period_s": _median_step(ours, key="step_periods"),
                         "ddp_period_s": _median_step(theirs, key="step_periods"),
                         "spotnik_cpu_s": _median_step(ours, key="step_cpu"),
                         "ddp_cpu_s": _median_step(theirs, key="step_cpu"),
                         "spotnik_sys_s": _median_step(ours, key="step_sys"),
                         "ddp_sys_s": _median_step(theirs, key="step_sys"),
                         "spotnik_page_faults": _median_step(ours, key="step_faults"),
                         "ddp_page_faults": _median_step(theirs, key="step_faults"),
                         "spotnik_rss_mb": max(e["rss_mb"] for e in ours.values()),
                         "ddp_rss_mb": max(e["rss_mb"] for e in theirs.values())})
        res = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        res["step_time_ratio"] = res["spotnik_s"] / res["ddp_s"]
        res["rss_ratio"] = res["spotnik_rss_mb"] / res["ddp_rss_mb"]
        res["period_ratio"] = res["spotnik_period_s"] / res["ddp_period_s"]
        res["cpu_ratio"] = res["spotnik_cpu_s"] / res["ddp_cpu_s"]
        res["runs"] = rows
        out[model] = res
        print(json.dumps({model: res}), flush=True)
    return out


def _block_pairs(ends: dict[str, dict], key: str, k: int) -> tuple[float, list[float]]:
    """For an interleaved run (modes flip every ``k`` steps, atomic first): sum ``key`` over each
    block of ``k`` steps, pair each atomic block with the pipelined block after it (skipping the
    first pair: warm-up). Returns (sum over all pipelined blocks / sum over all atomic blocks, the
    per-pair ratios) — pipelined/atomic, i.e. atomic throughput relative to pipelined for periods."""
    tot_a = tot_p = 0.0
    pairs = []
    for e in ends.values():
        modes, vals = "".join(e["step_modes"]), e[key]
        for i in range(2 * k, len(vals) - 2 * k + 1, 2 * k):
            if modes[i:i + 2 * k] != "a" * k + "p" * k:
                raise RuntimeError(f"unexpected modes at step {i}: {modes[i:i + 2 * k]}")
            a, p = sum(vals[i:i + k]), sum(vals[i + k:i + 2 * k])
            tot_a, tot_p = tot_a + a, tot_p + p
            pairs.append(p / a)
    if not pairs:
        raise RuntimeError("too few steps for one atomic/pipelined block pair after warm-up")
    return tot_p / tot_a, pairs


def bench_commit(args: argparse.Namespace, url: str) -> dict:
    if args.interleave:
        return bench_commit_interleaved(args, url)
    out = {}
    for model in args.models.split(","):
        cfg = dict(model=model, batch=1, n_data=args.workers * args.steps, epochs=1, verify=False, hb_ms=100,
                   hb_timeout_ms=5000, pace_s=0.0, quiet=True)
        rows = []
        for i in range(args.repeat):  # alternate which mode runs first: the machine drifts
            got = {}
            for atomic in ((True, False) if i % 2 == 0 else (False, True)):
                ends, _c = _run(url, args.workers, "run", atomic=atomic, **cfg)
                got["atomic_s" if atomic else "pipelined_s"] = _median_step(ends, 2)
                got["atomic_cpu_s" if atomic else "pipelined_cpu_s"] = _median_step(ends, 2, key="step_cpu")
            rows.append(got)
        res = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        res["throughput_ratio"] = res["pipelined_s"] / res["atomic_s"]  # atomic throughput / pipelined
        # each run pair's own ratio (pairs run back to back, so they share the machine's state)
        res["pair_ratios"] = [round(r["pipelined_s"] / r["atomic_s"], 4) for r in rows]
        res["pair_ratio_median"] = statistics.median(res["pair_ratios"])
        res["cpu_ratio"] = res["atomic_cpu_s"] / res["pipelined_cpu_s"]
        res["runs"] = rows
        out[model] = res
        print(json.dumps({model: res}), flush=True)
    return out


def bench_commit_interleaved(args: argparse.Namespace, url: str) -> dict:
    """Atomic and pipelined commit in the *same* run: every member flips the mode every
    ``--interleave`` steps (by the global step), so both modes see the same processes, memory and
    machine load (separate runs scatter by +-15 % here). Reports the throughput ratio (batch-to-batch
    periods, pipelined over atomic), the CPU ratio, and the vote's own time as a share of the step."""
    out = {}
    k = args.interleave
    for model in args.models.split(","):
        cfg = dict(model=model, batch=1, n_data=args.workers * args.steps, epochs=1, verify=False, hb_ms=100,
                   hb_timeout_ms=5000, pace_s=0.0, quiet=True, interleave=k)
        rows = []
        for _ in range(args.repeat):
            ends, _c = _run(url, args.workers, "run", **cfg)
            ratio, pairs = _block_pairs(ends, "step_periods", k)
            cpu, _p = _block_pairs(ends, "step_cpu", k)
            shares, votes, steps = [], [], []
            for e in ends.values():
                atomic = [i for i, m in enumerate(e["step_modes"][:len(e["step_periods"])]) if m == "a" and i >= 2 * k]
                vote = statistics.median(e["step_votes"][i] for i in atomic)
                step = statistics.median(e["step_periods"][i] for i in atomic)
                votes.append(vote)
                steps.append(step)
                shares.append(vote / step)
            rows.append({"throughput_ratio": ratio, "pair_ratio_median": statistics.median(pairs),
                         "pair_ratio_quartiles": [round(q, 4) for q in statistics.quantiles(pairs, n=4)[::2]],
                         "pairs": len(pairs), "cpu_ratio": 1 / cpu, "vote_ms": statistics.median(votes) * 1e3,
                         "atomic_step_ms": statistics.median(steps) * 1e3, "vote_share": statistics.median(shares)})
        res = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "pair_ratio_quartiles"}
        res["run_ratios"] = [round(r["throughput_ratio"], 4) for r in rows]
        res["runs"] = rows
        out[model] = res
        print(json.dumps({model: {key: v for key, v in res.items() if key != "runs"}}), flush=True)
    return out


def plot_commit(paths: list[Path], out: Path) -> None:
    """Bar chart of interleaved commit runs (one group of bars per shape, one bar per file, i.e.
    per worker count; dots: the single runs) against the 0.97 goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.loads(p.read_text()) for p in paths]
    models = list(docs[0]["result"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(docs)
    for j, doc in enumerate(docs):
        xs = [i + (j - (len(docs) - 1) / 2) * width for i in range(len(models))]
        res = doc["result"]
        ax.bar(xs, [res[m]["throughput_ratio"] for m in models], width, label=f"{doc['args']['workers']} workers")
        for x, m in zip(xs, models, strict=True):
            ax.plot([x] * len(res[m]["run_ratios"]), res[m]["run_ratios"], "k.", ms=4)
    ax.axhline(0.97, color="r", ls="--", lw=1, label="goal 0.97")
    ax.set_xticks(range(len(models)), [m.split(":")[-1] for m in models])
    ax.set_ylim(0.9, 1.05)
    ax.set_ylabel("atomic / pipelined throughput")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def _period(commits: list[dict]) -> float:
    """The median time between consecutive commits (latest member's commit time per step)."""
    t: dict[int, float] = {}
    for e in commits:
        t[e["step"]] = max(t.get(e["step"], 0.0), e["t"])
    return statistics.median(t[s] - t[s - 1] for s in sorted(t) if s - 1 in t)


def _stalls(commits: list[dict], steps: list[int]) -> list[float]:
    """For each step s in ``steps``: the time from the commit of step s-1 to the commit of step s,
    minus the median step interval (latest member's commit time per step)."""
    t = {}
    for e in commits:
        t[e["step"]] = max(t.get(e["step"], 0.0), e["t"])
    gaps = [t[s] - t[s - 1] for s in sorted(t) if s - 1 in t]
    normal = statistics.median(gaps)
    return [t[s] - t[s - 1] - normal for s in steps if s in t and s - 1 in t]


def bench_revocation(args: argparse.Namespace, url: str) -> dict:
    n = args.workers
    cfg = dict(model="mlp", n_data=n * 4 * args.steps, batch=4, epochs=1, pace_s=args.pace, verify=False,
               hb_ms=100, hb_timeout_ms=1000, bucket_mb=0.005)
    base, _c = _run(url, n, "run", **cfg)
    points = ["backward", "between_buckets", "vote"]
    kill_steps = [args.steps // 4 * (k + 1) for k in range(args.kills)]
    faults = {1 + k: f"{points[k % len(points)]}@{s}" for k, s in enumerate(kill_steps)}
    hurt, commits = _run(url, n, "run", faults=faults, **cfg)
    stalls = _stalls(commits, [s + 1 for s in kill_steps])
    res = {"workers": n, "kills": faults, "fault_free_wall_s": statistics.median(e["wall_s"] for e in base.values()),
           "with_kills_wall_s": statistics.median(e["wall_s"] for e in hurt.values()),
           "stall_per_revocation_ms": [round(s * 1e3, 1) for s in stalls],
           "normal_step_ms": round(_period(commits) * 1e3, 1),
           "resync_ms": sorted({r["resync_ms"] for e in hurt.values() for r in e["resyncs"]})}
    res["wall_lost_per_revocation_s"] = (res["with_kills_wall_s"] - res["fault_free_wall_s"]) / len(faults)
    print(json.dumps(res), flush=True)
    return res


def bench_join(args: argparse.Namespace, url: str) -> dict:
    cfg = dict(model="shaped:resnet50", optimizer="adam", batch=1, n_data=args.workers * 40, epochs=1, verify=False,
               hb_ms=100, hb_timeout_ms=5000, pace_s=0.0)
    ends, commits = _run(url, args.workers, "run", joiner_after=8, **cfg)
    first = min(e["step"] for e in commits if e["id"] == "joiner")
    resyncs = [r for e in ends.values() for r in e["resyncs"]]
    res = {"params_m": 25.56, "optimizer": "adam", "workers_before": args.workers,
           "members_stall_ms": round(_stalls(commits, [first])[0] * 1e3, 1),
           "normal_step_ms": round(_period(commits) * 1e3, 1),
           "state_bytes": max(r["bytes"] for r in resyncs),
           "donor_resync_ms": max(r["resync_ms"] for r in resyncs if r["outcome"] != "adopted"),
           "joiner_resync_ms": max(r["resync_ms"] for r in resyncs if r["outcome"] == "adopted"),
           "phases_ms": {k: v for r in resyncs for k, v in r.items() if k.endswith("_ms") and k.split("_")[0] in (
               "capture", "send", "wait", "receive", "apply")}}
    print(json.dumps(res), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["step", "commit", "revocation", "join"])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--models", default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--pace", type=float, default=0.05)
    ap.add_argument("--tag", default="")
    ap.add_argument("--interleave", type=int, default=4,
                    help="commit: both modes in one run, flipping every N steps (0: separate back-to-back runs)")
    ap.add_argument("--plot", nargs="*", type=Path, default=None, metavar="JSON",
                    help="commit: only plot these earlier outputs to docs/img/commit.png")
    args = ap.parse_args(argv)
    if args.plot:
        plot_commit(args.plot, Path(__file__).parent.parent / "docs" / "img" / "commit.png")
        return 0
    if args.models is None:
        args.models = {"step": "mlp,resnet50",
                       "commit": "shaped:resnet50,shaped:vgg16,shaped:inception_v3,shaped:bert_base"}.get(args.what, "")
    fn = {"step": bench_step, "commit": bench_commit, "revocation": bench_revocation, "join": bench_join}[args.what]
    t0 = time.time()
    with EmbeddedStoreServer("127.0.0.1", 0) as srv:
        res = fn(args, srv.url)
    doc = {"bench": args.what, "args": vars(args), "seconds": round(time.time() - t0, 1), "result": res}
    OUT.mkdir(exist_ok=True)
    (OUT / f"lightning_{args.what}{args.tag}.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
