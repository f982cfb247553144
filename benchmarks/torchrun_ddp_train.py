"""The stock baseline of benchmarks/torchrun_revocation.py: the same model, data and optimizer as
examples/torchrun_train.py, trained with DDP over gloo under ``torchrun --rdzv-backend=c10d``, with a
checkpoint every ``--ckpt-every`` steps and a resume from it after every torchrun restart.

Prints the same JSON lines as the spotnik example (``commit`` with step, size, hash; ``final``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from torchrun_train import LR, MOMENTUM, batch, emit, make_model, state_hash  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--pace", type=float, default=0.0)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ckpt = Path(args.ckpt_dir) / "ckpt.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    emit(ev="ready", id=f"rank{rank}", step=step, size=size, restart=os.environ.get("TORCHELASTIC_RESTART_COUNT"))
    params = list(model.parameters())
    while step < args.steps:
        x, y = batch(step, rank, size)
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        step += 1
        bufs = [opt.state[p].get("momentum_buffer", torch.zeros_like(p)) for p in params]
        emit(ev="commit", id=f"rank{rank}", step=step, size=size, hash=state_hash(params, bufs))
        if rank == 0 and step % args.ckpt_every == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            tmp.replace(ckpt)
        if args.pace:
            time.sleep(args.pace)
    emit(ev="final", id=f"rank{rank}", step=step, size=size)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
