"""A worker that all-reduces in a loop and reports to stdout, one JSON object per line.

Used by the fault tests, the recovery benchmark and the demo. Each member contributes a value
derived from its id, so every worker can check a result against the membership it ran on.
Lines: ``ready``, ``ok`` (first success in each epoch, then every ``report_every``), ``synced``
(the loop counter agreed after a membership change: the first collective on it), ``bad``
(wrong result: must never happen), ``changed`` (MembershipChanged), ``membership`` (an installed
change, with latency and message count), ``fenced``, ``error``, ``done``.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from datetime import timedelta

import torch

from spotnik_lightning.api import EpochFencedError, MembershipChanged, RingTimeouts, SpotnikError
from spotnik_lightning.membership import open_store


def value_of(member_id: str) -> int:
    """The contribution of a member: small, distinct per id, exact in float32 sums."""
    return zlib.crc32(member_id.encode()) % 1000 + 1


def emit(**fields: object) -> None:
    fields.setdefault("t", time.time())
    fields.setdefault("pid", os.getpid())
    line = (json.dumps(fields, separators=(",", ":")) + "\n").encode()
    view = memoryview(line)
    while view:  # one write per line (up to PIPE_BUF bytes): lines from many processes never interleave
        view = view[os.write(1, view):]


def run(cfg: dict) -> int:
    """Run the loop described by ``cfg`` (see LocalCluster.spawn); returns an exit code."""
    from spotnik_lightning.ring import RingGroup

    torch.set_num_threads(1)
    mid = cfg["id"]
    if cfg.get("log_level"):
        import logging

        logging.basicConfig(level=cfg["log_level"], format=f"%(asctime)s.%(msecs)03d {mid} %(threadName)s %(message)s",
                            datefmt="%H:%M:%S")
    timeouts = RingTimeouts(
        heartbeat_interval=timedelta(milliseconds=cfg.get("hb_interval_ms", 50)),
        heartbeat_timeout=timedelta(milliseconds=cfg.get("hb_timeout_ms", 250)),
        join=timedelta(seconds=cfg.get("join_timeout_s", 60)),
        bootstrap=timedelta(seconds=cfg.get("bootstrap_timeout_s", 120)))
    store = open_store(cfg["store"], cfg["run_id"])
    try:
        ring = RingGroup.create(store, world_size=cfg.get("world_size"), member_id=mid,
                                host=cfg.get("host", "127.0.0.1"), timeouts=timeouts, tier=cfg.get("tier", "transient"))
    except SpotnikError as exc:
        emit(ev="error", id=mid, error=f"{type(exc).__name__}: {exc}")
        return 3
    ring.listeners.append(lambda e: emit(ev="membership", id=mid, kind=e.kind, epoch=e.new_epoch,
                                         members=e.members, latency_ms=e.latency_ms, messages=e.messages,
                                         removed=e.removed, added=e.added))
    emit(ev="ready", id=mid, epoch=ring.epoch, rank=ring.rank, size=ring.size)
    numel = int(cfg.get("numel", 1024))
    admit_every = int(cfg.get("admit_every", 10))
    report_every = int(cfg.get("report_every", 200))
    pace = float(cfg.get("pace_s", 0.002))
    deadline = time.monotonic() + float(cfg.get("duration_s", 600))
    max_iters = int(cfg.get("iters", 1 << 62))
    mine = float(value_of(mid))
    last_epoch, k, code = -1, 0, 0
    # After any membership change all members agree on the loop counter (the highest committed
    # one wins): a joiner starts at 0, and a kill during the last all-gather can leave survivors
    # one iteration apart. The ring reports every change once to every member, so they all
    # resynchronise in the same collective order.
    sync = cfg.get("world_size") is None
    try:
        while time.monotonic() < deadline and k < max_iters:
            t = torch.full((numel,), mine)
            try:
                if sync:
                    step = torch.tensor([k], dtype=torch.int64)
                    m = ring.membership
                    ring.all_reduce(step, "max")
                    k, sync = int(step.item()), False
                    emit(ev="synced", id=mid, k=k, epoch=m.epoch, members=list(m.ids))
                if admit_every and k % admit_every == 0 and ring.admit():
                    sync = True
                    continue
                m = ring.membership
                ring.all_reduce(t)
            except MembershipChanged as exc:
                emit(ev="changed", id=mid, old=exc.old_epoch, new=exc.new_epoch)
                sync = True
                continue
            k += 1
            expected = float(sum(value_of(i) for i in m.ids))
            if not bool((t == expected).all()):
                emit(ev="bad", id=mid, epoch=m.epoch, got=float(t[0]), expected=expected, members=list(m.ids))
                code = 4
            if m.epoch != last_epoch or k % report_every == 0:
                emit(ev="ok", id=mid, k=k, epoch=m.epoch, members=list(m.ids), rank=m.rank_of(mid))
                last_epoch = m.epoch
            if pace:
                time.sleep(pace)
    except EpochFencedError as exc:
        emit(ev="fenced", id=mid, error=str(exc), epoch=exc.epoch)
        code = 5
    except SpotnikError as exc:
        emit(ev="error", id=mid, error=f"{type(exc).__name__}: {exc}")
        code = 6
    emit(ev="done", id=mid, k=k, epoch=ring.epoch)
    ring.close()
    return code
