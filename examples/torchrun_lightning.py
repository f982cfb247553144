"""A plain Lightning script for ``torchrun --rdzv-backend=spotnik``: nothing spotnik-specific but
``strategy="spotnik"`` (the store, run id, tier, secret and founding size come from the rendezvous).

    torchrun --rdzv-backend=spotnik --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=job1 --nnodes=2:4 \\
        --nproc-per-node=1 examples/torchrun_lightning.py --epochs 2

Prints one JSON line per committed step and one at the end (used by tests/test_torchrun_lightning.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import spotnik_lightning  # noqa: F401 - registers strategy="spotnik"
from spotnik_lightning.bench.lightning_worker import MLP, TeacherData
from spotnik_lightning.lightning.verify import replica_hash


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--n-data", type=int, default=512)
    ap.add_argument("--pace", type=float, default=0.02)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = MLP(pace_s=args.pace)
    trainer = pl.Trainer(strategy="spotnik", accelerator="cpu", max_epochs=args.epochs, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)

    def out(**kw: object) -> None:  # one write per line: lines of the workers never interleave
        os.write(1, (json.dumps({"pid": os.getpid(), **kw}) + "\n").encode())

    trainer.strategy.commit_listeners.append(
        lambda i: out(ev="commit", step=i.step, world=i.world, members=i.members, plans=i.plans))
    trainer.fit(model, DataLoader(TeacherData(args.n_data), batch_size=4, shuffle=True))
    s = trainer.strategy
    out(ev="final", step=trainer.global_step, hash=replica_hash(model, trainer.optimizers),
        member=s.ring.member_id if s.ring else None, resyncs=s.counters.resyncs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
