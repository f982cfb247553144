"""Plain-torch data-parallel training over a spotnik ring, launched by ``torchrun --rdzv-backend=spotnik``.

    torchrun --rdzv-backend=spotnik --rdzv-endpoint=etcd://10.0.0.1:2379 --rdzv-id=job1 \\
        --nnodes=2:8 --nproc-per-node=1 examples/torchrun_train.py --steps 500

Every worker builds its RingGroup from the SPOTNIK_* environment the rendezvous handler exported
(docs/torchrun.md); the first MIN_NODES x nproc workers found the ring, later ones join in place.
After any membership change the members agree on the step counter (highest committed wins) and
the lowest-ranked up-to-date member broadcasts model and optimizer state, so a joiner (or a
survivor one step behind) continues bit-identical to the others.

Output: one JSON object per line on stdout (``ev`` = ready | commit | synced | final | error), each
with ``pid``, ``id`` and wall time ``t``; ``commit`` and ``final`` carry ``step``, ``epoch``,
``size`` and ``hash`` (CRC32 of parameters + momentum). The run ends at ``--steps``, or earlier at
a target the members agree on from ``--stop-file`` (checked every ``--admit-every`` steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path

import torch

DIM = 32
LR, MOMENTUM = 0.01, 0.9


def emit(**fields: object) -> None:
    """One JSON line, written with one write(2) so lines of many processes never interleave."""
    fields.setdefault("t", time.time())
    fields.setdefault("pid", os.getpid())
    os.write(1, (json.dumps(fields, separators=(",", ":")) + "\n").encode())


def make_model() -> torch.nn.Module:
    """The same initial model on every worker (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh(), torch.nn.Linear(DIM, 1))


def batch(step: int, rank: int, size: int, per_worker: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s slice of global batch ``step`` (deterministic, independent of history)."""
    g = torch.Generator().manual_seed(step * 100_003 + rank * 7 + size)
    x = torch.randn(per_worker, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def state_vector(params: list[torch.Tensor], bufs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in params + bufs])


def load_vector(vec: torch.Tensor, params: list[torch.Tensor], bufs: list[torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in params + bufs:
            n = t.numel()
            t.copy_(vec[offset:offset + n].view_as(t))
            offset += n


def state_hash(params: list[torch.Tensor], bufs: list[torch.Tensor]) -> str:
    return f"{zlib.crc32(state_vector(params, bufs).numpy().tobytes()):08x}"


def read_stop(path: str | None) -> int:
    if not path:
        return 0
    try:
        return int(Path(path).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="train until this many steps are committed")
    ap.add_argument("--stop-file", default=None, help="a file the operator writes a target step into")
    ap.add_argument("--admit-every", type=int, default=5, help="steps between admission / stop checks")
    ap.add_argument("--pace", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    args = ap.parse_args(argv)

    from spotnik_lightning.api import MembershipChanged, RingTimeouts, SpotnikError
    from spotnik_lightning.membership import open_store
    from spotnik_lightning.ring import RingGroup

    torch.set_num_threads(1)
    env = os.environ
    local_rank, nproc = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))
    # unique per process incarnation: a restarted worker must not reuse its predecessor's id
    mid = f"{env['SPOTNIK_NODE_ID']}-w{local_rank}-r{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    hb = int(env.get("SPOTNIK_HEARTBEAT_MS", 50))
    timeouts = RingTimeouts(heartbeat_interval=timedelta(milliseconds=hb),
                            heartbeat_timeout=timedelta(milliseconds=int(env.get("SPOTNIK_HEARTBEAT_TIMEOUT_MS",
                                                                                 max(250, 5 * hb)))),
                            join=timedelta(seconds=90), bootstrap=timedelta(seconds=90))
    store = open_store(env["SPOTNIK_STORE"], env["SPOTNIK_RUN_ID"],
                       timedelta(milliseconds=int(env.get("SPOTNIK_STORE_TIMEOUT_MS", 5000))))
    try:
        ring = RingGroup.create(store, world_size=int(env["SPOTNIK_MIN_NODES"]) * nproc, member_id=mid,
                                host=env.get("SPOTNIK_HOST", "127.0.0.1"), tier=env.get("SPOTNIK_TIER", "transient"),
                                timeouts=timeouts)
    except SpotnikError as exc:
        emit(ev="error", id=mid, error=f"{type(exc).__name__}: {exc}")
        return 3
    emit(ev="ready", id=mid, epoch=ring.epoch, size=ring.size, rank=ring.rank)

    model = make_model()
    params = [p for p in model.parameters()]
    bufs = [torch.zeros_like(p) for p in params]
    grads = torch.zeros(sum(p.numel() for p in params))
    step, target, sync, code = 0, args.steps, True, 0
    try:
        while True:
            try:
                if sync:
                    # highest committed step wins; the lowest rank holding it donates the state
                    k = torch.tensor([step], dtype=torch.int64)
                    ring.all_reduce(k, "max")
                    donor = torch.tensor([ring.rank if step == int(k) else ring.size], dtype=torch.int64)
                    ring.all_reduce(donor, "min")
                    vec = state_vector(params, bufs)
                    ring.broadcast(vec, int(donor))
                    load_vector(vec, params, bufs)
                    step, sync = int(k), False
                    emit(ev="synced", id=mid, step=step, epoch=ring.epoch, size=ring.size, donor=int(donor))
                if step % args.admit_every == 0:
                    if ring.admit():
                        sync = True
                        continue
                    stop = torch.tensor([read_stop(args.stop_file)], dtype=torch.int64)
                    ring.all_reduce(stop, "max")
                    if int(stop) > 0:
                        target = min(args.steps, max(int(stop), step))
                if step >= target:
                    # a last agreement round: whoever saw a change here resyncs with the rest
                    ring.barrier()
                    break
                rank, size, epoch = ring.rank, ring.size, ring.epoch
                x, y = batch(step, rank, size)
                model.zero_grad(set_to_none=False)
                torch.nn.functional.mse_loss(model(x), y).backward()
                torch.cat([p.grad.reshape(-1) for p in params], out=grads)
                ring.all_reduce(grads, "sum")
            except MembershipChanged:
                sync = True
                continue
            grads /= size
            offset = 0
            with torch.no_grad():
                for p, b in zip(params, bufs, strict=True):
                    n = p.numel()
                    b.mul_(MOMENTUM).add_(grads[offset:offset + n].view_as(p))
                    p.sub_(LR * b)
                    offset += n
            step += 1
            emit(ev="commit", id=mid, step=step, epoch=epoch, size=size, hash=state_hash(params, bufs))
            if args.pace:
                time.sleep(args.pace)
        emit(ev="final", id=mid, step=step, epoch=ring.epoch, size=ring.size, hash=state_hash(params, bufs))
    except SpotnikError as exc:
        emit(ev="error", id=mid, step=step, error=f"{type(exc).__name__}: {exc}")
        code = 6
    ring.leave()
    return code


if __name__ == "__main__":
    sys.exit(main())
