"""What a join costs the running members: the gap in their commits around an admission, and what it
is made of (the Fig. 6 setting: one network namespace per worker, ``tc tbf`` links, etcd in the
switch namespace, 0.2 s of emulated compute per step). Needs root.

  python benchmarks/join_stall.py --mode adpsgd --founders 3 2> /tmp/join.log

Runs ``--founders`` workers in ``--mode``, adds one worker after ``--at`` seconds, stops ``--after``
seconds later and prints, per member, the longest gap between consecutive commits around the join
and the member's resync/admission log lines (worker logs at INFO go to stderr).
"""

from __future__ import annotations

import argparse
import json
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="adpsgd")
    ap.add_argument("--founders", type=int, default=3)
    ap.add_argument("--rate", default="8mbit")
    ap.add_argument("--pace", type=float, default=0.2)
    ap.add_argument("--hidden", type=int, default=160)
    ap.add_argument("--at", type=float, default=8.0)
    ap.add_argument("--after", type=float, default=8.0)
    args = ap.parse_args()
    n = args.founders + 1
    with tempfile.TemporaryDirectory(prefix="join-") as tmp, NetnsBed(n) as bed, ExitStack() as stack:
        for h in bed.hosts:
            bed.rate_limit(h, args.rate, burst="64kb", latency="400ms")
        start_etcd(bed, Path(tmp) / "etcd")
        url = f"etcd://{bed.switch_addr}:2379"
        cfg = dict(entry=f"{WORKER}:run", epochs=1000, n_data=100_000, batch=8, pace_s=args.pace, hidden=args.hidden,
                   hb_ms=200, hb_timeout_ms=5000, verify=False, scheduler=False, sync=args.mode, log_level="INFO")
        run_id = f"join-{uuid.uuid4().hex[:6]}"
        clusters = [stack.enter_context(LocalCluster(url, run_id, netns=h, preload=("lightning.pytorch", WORKER),
                                                     **cfg)) for h in bed.hosts]
        for i in range(args.founders):
            clusters[i].spawn(f"w{i}", world_size=args.founders, env={"SPOTNIK_HOST": bed.addr[bed.hosts[i]]})
        clusters[0].wait_for(lambda e: e["ev"] == "commit", 120, "the first step")
        time.sleep(args.at)
        t_join = time.time()
        clusters[-1].spawn("j", env={"SPOTNIK_HOST": bed.addr[bed.hosts[-1]]})
        time.sleep(args.after)
        events = [e for c in clusters for e in c.of("commit")]
        ready = [e for c in clusters for e in c.of("ready") if e["id"] == "j"]
    by: dict[str, list[dict]] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        by.setdefault(e["id"], []).append(e)
    out = {"spawn_joiner_t": 0.0, "joiner_ready_t": round(ready[0]["t"] - t_join, 3) if ready else None}
    for mid, evs in sorted(by.items()):
        gaps = [(b["t"] - a["t"], a, b) for a, b in zip(evs, evs[1:], strict=False) if b["t"] > t_join]
        typical = sorted(g for g, _, _ in gaps)[len(gaps) // 2] if gaps else None
        worst = max(gaps, key=lambda g: g[0]) if gaps else None
        out[mid] = {"first_commit_t": round(evs[0]["t"] - t_join, 3) if evs[0]["t"] > t_join else None,
                    "median_gap_s": round(typical, 3) if typical else None,
                    "worst_gap_s": round(worst[0], 3) if worst else None,
                    "worst_gap_from_t": round(worst[1]["t"] - t_join, 3) if worst else None,
                    "worst_gap_steps": [worst[1]["step"], worst[2]["step"]] if worst else None}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
