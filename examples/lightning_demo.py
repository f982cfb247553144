"""Lightning training through revocations: 4 workers, one SIGKILLed, one SIGTERMed, one joins.

    python examples/lightning_demo.py [--workers 4] [--epochs 2]

Every worker is a real process running ``Trainer(strategy=SpotnikStrategy(...))`` on a small MLP and
generated data (no download); an embedded membership store runs in this process. The demo prints
a timeline (committed steps, membership changes, what each change cost) and checks at the end that
every replica is bit-identical and that each sample of each epoch was trained on exactly once.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import uuid
from collections import defaultdict

from spotnik_lightning.bench.cluster import LocalCluster
from spotnik_lightning.membership.embedded import EmbeddedStoreServer

WORKER = "spotnik_lightning.bench.lightning_worker"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    n, t0 = args.workers, time.time()

    def say(msg: str) -> None:
        print(f"[{time.time() - t0:6.2f} s] {msg}", flush=True)

    with EmbeddedStoreServer("127.0.0.1", 0) as srv, LocalCluster(
            srv.url, f"demo-{uuid.uuid4().hex[:6]}", preload=("lightning.pytorch", WORKER), entry=f"{WORKER}:run",
            epochs=args.epochs, n_data=256, batch=4, pace_s=0.03, hb_ms=100, hb_timeout_ms=1000) as c:
        ids = [f"w{i}" for i in range(n)]
        for mid in ids:
            c.spawn(mid, world_size=n)
        say(f"started {n} workers: " + ", ".join(f"{m} pid {c.pids[m]}" for m in ids))
        c.wait_for(lambda e: e["ev"] == "commit" and e["step"] == 5, 120, "step 5")
        c.signal("w1", signal.SIGKILL)
        say("SIGKILL w1 (a revoked spot VM)")
        c.wait_for(lambda e: e["ev"] == "commit" and e["step"] == 12, 120, "step 12")
        c.signal("w2", signal.SIGTERM)
        say("SIGTERM w2 (a revocation notice: finish the step, leave, exit 0)")
        c.wait_for(lambda e: e["ev"] == "commit" and e["step"] == 18, 120, "step 18")
        c.spawn("j0")
        say("started j0 (a new VM joins the running job)")
        alive = [m for m in ids if m not in ("w1", "w2")] + ["j0"]
        ends = c.wait_all(alive, lambda e: e["ev"] in ("done", "error"), 300, "the end of training")
        by_step: dict[int, list[dict]] = defaultdict(list)
        for e in c.of("commit"):
            by_step[e["step"]].append(e)
        last = None
        print("\ntimeline (one line per membership):")
        for s in sorted(by_step):
            evs = by_step[s]
            key = (evs[0]["world"], tuple(evs[0]["members"]))
            if key != last:
                t = evs[0]["t"] - t0
                print(f"  from step {s:3d} (t={t:6.2f} s): {evs[0]['world']} members {evs[0]['members']}")
                last = key
        print("\nmembership changes as each survivor saw them:")
        for m, e in sorted(ends.items()):
            for r in e.get("resyncs", []):
                print(f"  {m}: epoch {r['epoch']} -> {r['outcome']:7s} resync {r['resync_ms']:7.2f} ms"
                      + (f", {r['bytes'] / 1e3:.0f} kB of state from rank {r['donor']}" if r["bytes"] else ""))
            print(f"  {m}: pid {e.get('pid')} (started as {c.pids[m]}), steps {e.get('step')}, retried "
                  f"{e.get('retried')}, joins {e.get('joins')}, leaves {e.get('leaves')}")
        hashes = {e.get("hash") for e in ends.values()}
        seen = defaultdict(list)
        for evs in by_step.values():
            for e in evs:
                seen[evs[0]["plans"][0][0]].extend(e["indices"])
        exit_w2 = c.exited.get(c.pids["w2"])
        ok = (len(hashes) == 1 and all(e["ev"] == "done" for e in ends.values())
              and all(ends[m]["pid"] == c.pids[m] for m in alive) and exit_w2 == 0)
        print(f"\nreplicas identical: {len(hashes) == 1}; survivors never restarted: "
              f"{all(ends[m]['pid'] == c.pids[m] for m in alive)}; w2 exit code {exit_w2}; "
              f"samples per epoch (w1's last share is unreported when it died after a commit): "
              f"{ {ep: len(set(v)) for ep, v in sorted(seen.items())} } of 256")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
