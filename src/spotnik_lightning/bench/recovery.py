"""Recovery benchmark: time from SIGKILL (or SIGSTOP) of K workers to the first successful
collective on the new membership at every survivor, for N workers, over T trials. Also reported:
the repair alone (to installing the new epoch) and the time until the loop's next full step.

Workers are forked from a zygote (see ``cluster``), so killed workers are replaced by joiners
between trials without paying a torch import each. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import time
import uuid
from collections.abc import Callable

from spotnik_lightning.bench.cluster import LocalCluster
from spotnik_lightning.membership import EmbeddedStoreServer


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _without(victims: list[str], kinds: tuple[str, ...]) -> Callable[[dict], bool]:
    """Matches a worker event of one of ``kinds`` on a membership without any of ``victims``."""
    gone = set(victims)
    return lambda e: e["ev"] in kinds and not gone & set(e["members"])


def measure(n: int, k: int, trials: int, silent: bool = False, hb_timeout_ms: int = 250,
            seed: int = 0, log_level: str | None = None) -> dict:
    """Run ``trials`` revocations of ``k`` random workers out of ``n``; returns latencies (ms)
    of the slowest survivor per trial and of every survivor, plus control messages per worker."""
    rng = random.Random(seed)
    sig = signal.SIGSTOP if silent else signal.SIGKILL
    with EmbeddedStoreServer() as srv:
        host, port = srv.address
        with LocalCluster(f"embedded://{host}:{port}", f"rec-{uuid.uuid4().hex[:6]}", numel=256,
                          hb_timeout_ms=hb_timeout_ms, admit_every=5, pace_s=0.005,
                          **({"log_level": log_level} if log_level else {})) as c:
            alive = [f"w{i}" for i in range(n)]
            for mid in alive:
                c.spawn(mid, world_size=n)
            c.wait_all(alive, lambda e: e["ev"] == "ok", 180, "first all-reduce")
            nxt, per_trial, per_trial_step, msgs, installs = n, [], [], [], []
            for _ in range(trials):
                time.sleep(0.3)
                victims = rng.sample(alive, k)
                mark = c.mark()
                t_kill = time.time()
                for v in victims:
                    c.signal(v, sig)
                alive = [a for a in alive if a not in victims]
                first = c.wait_all(alive, _without(victims, ("ok", "synced")), 60,
                                   f"a collective without {victims}", since=mark)
                got = c.wait_all(alive, _without(victims, ("ok",)), 60, f"a step without {victims}", since=mark)
                per_trial.append(max(1000 * (e["t"] - t_kill) for e in first.values()))
                per_trial_step.append(max(1000 * (e["t"] - t_kill) for e in got.values()))
                epoch = next(iter(got.values()))["epoch"]
                repairs = [e for e in c.events[mark:]
                           if e["ev"] == "membership" and e["epoch"] == epoch and e["kind"] == "repair"]
                msgs.extend(e["messages"] for e in repairs)
                installs.append(max((e["latency_ms"] for e in repairs), default=0.0))
                for v in victims:
                    if silent:
                        c.signal(v, signal.SIGKILL)
                    mid = f"w{nxt}"
                    nxt += 1
                    c.spawn(mid, world_size=None)
                    alive.append(mid)
                mark = c.mark()
                c.wait_all(alive, lambda e, a=set(alive): e["ev"] == "ok" and set(e["members"]) == a, 120,
                           "replacements joined", since=mark)
            bad = c.of("bad")
    return {
        "workers": n, "kills": k, "trials": trials, "silent": silent, "hb_timeout_ms": hb_timeout_ms,
        "max_ms": round(max(per_trial), 1), "p50_ms": round(statistics.median(per_trial), 1),
        "p90_ms": round(_pct(per_trial, 0.9), 1), "p25_ms": round(_pct(per_trial, 0.25), 1),
        "p75_ms": round(_pct(per_trial, 0.75), 1),
        "per_trial_ms": [round(x, 1) for x in per_trial],
        # the loop's data all-reduce, after the counter resync: the training step resumed
        "step_p50_ms": round(statistics.median(per_trial_step), 1),
        "step_max_ms": round(max(per_trial_step), 1),
        # the repair alone: from a survivor's first sign of the failure to installing the new epoch
        "repair_install_p50_ms": round(statistics.median(installs), 1),
        "repair_install_max_ms": round(max(installs), 1),
        "messages_per_worker_max": max(msgs) if msgs else 0,
        "messages_per_worker_mean": round(statistics.mean(msgs), 2) if msgs else 0,
        "wrong_results": len(bad),
    }


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"N={r['workers']}\nK={r['kills']}{' stop' if r['silent'] else ''}" for r in results]
    ax.boxplot([r["per_trial_ms"] for r in results], whis=(0, 100))
    ax.set_xticks(range(1, len(results) + 1), labels)
    ax.set_ylabel("recovery latency (ms), slowest survivor")
    ax.set_title("spotnik ring recovery (revocation -> first collective on the new membership)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """``spotnik bench recovery`` entry point (``argv`` without the subcommand words)."""
    p = argparse.ArgumentParser(prog="spotnik bench recovery", description=__doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    out = []
    for n in args.workers:
        for k in args.kills:
            out.append(measure(n, k, args.trials, silent=args.silent, hb_timeout_ms=args.hb_timeout_ms,
                               log_level=args.log_level))
            if not args.json:
                r = out[-1]
                print(f"N={n:3d} K={k} p50={r['p50_ms']:7.1f} p90={r['p90_ms']:7.1f} max={r['max_ms']:7.1f} ms "
                      f"(repair alone: p50 {r['repair_install_p50_ms']} max {r['repair_install_max_ms']} ms; "
                      f"next step: max {r['step_max_ms']} ms) "
                      f"msgs/worker<={r['messages_per_worker_max']}", flush=True)
    if args.plot:
        plot(out, args.plot)
    if args.json:
        print(json.dumps({"benchmark": "recovery", "results": out}))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    def ints(text: str) -> list[int]:
        try:
            return [int(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None

    p.add_argument("--workers", type=ints, default=[8], help="N, comma-separated (e.g. 8,16,32)")
    p.add_argument("--kills", type=ints, default=[1], help="K concurrent revocations, comma-separated")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--silent", action="store_true", help="SIGSTOP instead of SIGKILL")
    p.add_argument("--hb-timeout-ms", type=int, default=250)
    p.add_argument("--json", action="store_true")
    p.add_argument("--log-level", default=None, help="workers log at this level to stderr (e.g. INFO)")
    p.add_argument("--plot", default=None, help="write a whisker plot PNG here")


if __name__ == "__main__":
    raise SystemExit(main())
