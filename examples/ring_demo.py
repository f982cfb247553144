"""Demo: four workers train a small MLP data-parallel over the spotnik ring; one is killed
mid-run, the survivors repair the ring in place and redo the interrupted step, then a new
worker joins, receives the model from a peer, and training finishes on four workers again.

    python examples/ring_demo.py            # prints a timeline and checks the replicas

Everything runs locally: an embedded membership store, one process per worker.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import torch
from torch import nn

STEPS = 600
BATCH = 32


def emit(**kw: object) -> None:
    kw["t"] = time.time()
    os.write(1, (json.dumps(kw) + "\n").encode())


def worker(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from spotnik_lightning.api import MembershipChanged, RingTimeouts
    from spotnik_lightning.membership import open_store
    from spotnik_lightning.ring import RingGroup

    torch.set_num_threads(1)
    ring = RingGroup.create(open_store(args.store, "demo"), world_size=args.world or None, member_id=args.id,
                            timeouts=RingTimeouts(heartbeat_interval=timedelta(milliseconds=100),
                                                  heartbeat_timeout=timedelta(seconds=1)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8192, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(8192, 1, generator=g)
    params = list(model.parameters())
    # After every membership change (a joiner arrived, or a kill left survivors possibly one
    # committed step apart) the members agree on the state: the most advanced member donates its
    # parameters and step counter. The ring reports each change once to every member, so all of
    # them run this in the same order.
    step, sync = 0, not args.world
    emit(ev="ready", id=args.id, epoch=ring.epoch, world=ring.size)
    while step < STEPS:
        try:
            if sync:
                steps = torch.empty(ring.size, dtype=torch.int64)
                ring.all_gather(steps, torch.tensor([step]))
                donor = int(torch.argmax(steps))
                flat = torch.cat([p.detach().view(-1) for p in params] + [torch.tensor([float(step)])])
                ring.broadcast(flat, donor)
                torch.nn.utils.vector_to_parameters(flat[:-1], params)
                step, sync = int(flat[-1].item()), False
                emit(ev="synced", id=args.id, step=step, epoch=ring.epoch, donor=ring.membership.ids[donor])
            if step % 5 == 0 and ring.admit():
                sync = True
                continue
            m = ring.membership
            rank, n = m.rank_of(args.id), m.size
            start = (step * BATCH * n + rank * BATCH) % x.shape[0]
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x[start:start + BATCH]), y[start:start + BATCH])
            loss.backward()
            grads = torch.cat([p.grad.view(-1) for p in params])
            ring.all_reduce(grads, "avg")  # raises MembershipChanged if a peer died meanwhile
        except MembershipChanged as exc:
            emit(ev="retry", id=args.id, step=step, old=exc.old_epoch, new=exc.new_epoch)
            sync = True
            continue
        torch.nn.utils.vector_to_parameters(grads, [p.grad for p in params])
        opt.step()
        step += 1
        if step % 100 == 0 or step == STEPS:
            digest = hashlib.sha256(torch.cat([p.detach().view(-1) for p in params]).numpy().tobytes()).hexdigest()
            emit(ev="step", id=args.id, step=step, loss=round(loss.item(), 4), world=n, epoch=m.epoch,
                 params=digest[:12])
        time.sleep(0.01)
    ring.close()
    return 0


def main() -> int:
    from spotnik_lightning.membership import EmbeddedStoreServer

    events: list[dict] = []
    lock = threading.Lock()
    procs: dict[str, subprocess.Popen] = {}

    def launch(mid: str, world: int) -> None:
        p = subprocess.Popen([sys.executable, __file__, "--worker", "--id", mid, "--world", str(world),
                              "--store", srv.url], stdout=subprocess.PIPE, text=True)
        procs[mid] = p

        def pump() -> None:
            for line in p.stdout:
                with lock:
                    events.append(json.loads(line))
        threading.Thread(target=pump, daemon=True).start()

    def wait(pred, timeout: float, what: str) -> dict:  # noqa: ANN001
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with lock:
                for e in events:
                    if pred(e):
                        return e
            time.sleep(0.05)
        raise TimeoutError(f"demo: timed out waiting for {what}")

    t0 = time.time()
    with EmbeddedStoreServer() as srv:
        try:
            for i in range(4):
                launch(f"w{i}", 4)
            wait(lambda e: e["ev"] == "step" and e["step"] >= 100, 120, "step 100")
            t_kill = time.time()
            procs["w2"].kill()
            print(f"[{t_kill - t0:6.2f}s] demo: SIGKILL w2 (pid {procs['w2'].pid})")
            wait(lambda e: e["ev"] == "synced" and e["epoch"] >= 2, 120, "the repair")
            launch("w4", 0)
            print(f"[{time.time() - t0:6.2f}s] demo: started w4 (joins the running job)")
            for mid in ("w0", "w1", "w3", "w4"):
                wait(lambda e, m=mid: e["ev"] == "step" and e["id"] == m and e["step"] == STEPS, 180, f"{mid} done")
            for p in procs.values():
                p.wait(timeout=30)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
    print("\ntimeline:")
    for e in sorted(events, key=lambda e: e["t"]):
        extra = {k: v for k, v in e.items() if k not in ("t", "ev", "id")}
        print(f"[{e['t'] - t0:6.2f}s] {e['id']:>3} {e['ev']:<6} {extra}")
    final = {e["id"]: e["params"] for e in events if e["ev"] == "step" and e["step"] == STEPS}
    retries = [e for e in events if e["ev"] == "retry"]
    print(f"\nfinal parameter digests: {final}")
    print(f"steps redone after the kill: {len(retries)} (by {sorted({e['id'] for e in retries})})")
    ok = len(set(final.values())) == 1 and len(final) == 4
    print("replicas identical: " + ("yes" if ok else "NO"))
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--id")
    ap.add_argument("--world", type=int, default=0)
    ap.add_argument("--store")
    a = ap.parse_args()
    if a.worker:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        raise SystemExit(worker(a))
    raise SystemExit(main())
