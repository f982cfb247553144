"""One ring worker for the network-partition test, run inside a test-bed namespace.

Creates a RingGroup bound to ``--host`` (its namespace's data address) on the store ``--store``,
then loops ``all_reduce`` of a small tensor filled with ``--value`` and prints one JSON line per
attempt to stdout (flushed)::

    {"ev": "ok", "epoch": 2, "members": ["h0", "h1"], "value": 3.0, "pid": 123, "i": 17, "t": 1.25}

``ev`` is "ready" (after joining), "ok" (the reduced value is in ``value``; ``epoch`` and
``members`` are the membership the collective ran on), "changed" (MembershipChanged: retried),
"timeout" (MembershipTimeoutError: retried), "fenced" (EpochFencedError: the worker stops),
"broken" (RingBrokenError: stops), "error" (anything else: stops) and finally "exit".
It stops after ``--iters`` attempts, ``--duration`` seconds, or when its stdin is closed.
The job secret comes from $SPOTNIK_SECRET.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import timedelta

T0 = time.monotonic()


def emit(ev: str, **fields: object) -> None:
    line = {"ev": ev, "pid": os.getpid(), "t": round(time.monotonic() - T0, 3), **fields}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--member-id", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--value", type=float, required=True)
    p.add_argument("--iters", type=int, default=10_000)
    p.add_argument("--duration", type=float, default=50.0)
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--hb-interval", type=float, default=0.1)
    p.add_argument("--hb-timeout", type=float, default=1.0)
    args = p.parse_args(argv)

    stop = threading.Event()

    def watch_stdin() -> None:
        # raw fd reads: a daemon thread blocked in sys.stdin's buffered reader aborts the
        # interpreter at shutdown ("could not acquire lock for <stdin>")
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()

    import torch

    from spotnik_lightning.api import (
        EpochFencedError,
        MembershipChanged,
        MembershipTimeoutError,
        RingBrokenError,
        RingTimeouts,
    )
    from spotnik_lightning.membership import open_store
    from spotnik_lightning.ring import RingGroup

    torch.set_num_threads(1)
    timeouts = RingTimeouts(heartbeat_interval=timedelta(seconds=args.hb_interval),
                            heartbeat_timeout=timedelta(seconds=args.hb_timeout),
                            connect=timedelta(seconds=3), collective=timedelta(seconds=15),
                            repair=timedelta(seconds=20), bootstrap=timedelta(seconds=30),
                            join=timedelta(seconds=30))
    store = open_store(args.store, args.run_id)
    deadline = T0 + args.duration
    try:
        group = RingGroup.create(store, world_size=args.world, member_id=args.member_id, host=args.host,
                                 timeouts=timeouts, chunk_bytes=64 << 10)
    except Exception as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}")
        emit("exit")
        return 1
    emit("ready", epoch=group.epoch, members=list(group.membership.ids))
    code = 0
    try:
        for i in range(args.iters):
            if stop.is_set() or time.monotonic() > deadline:
                break
            before = group.membership
            t = torch.full((256,), args.value)
            try:
                group.all_reduce(t)
            except MembershipChanged as exc:
                emit("changed", i=i, old_epoch=exc.old_epoch, epoch=exc.new_epoch,
                     members=list(group.membership.ids), reason=exc.reason)
                continue
            except MembershipTimeoutError as exc:
                emit("timeout", i=i, epoch=group.epoch, error=str(exc))
                continue
            except EpochFencedError as exc:
                emit("fenced", i=i, epoch=exc.epoch, members=list(exc.members), error=str(exc))
                break
            except RingBrokenError as exc:
                emit("broken", i=i, epoch=group.epoch, error=str(exc))
                code = 2
                break
            after = group.membership
            # a successful collective ran on one epoch: the one before the call unless a restart
            # was installed between reading it and entering the collective
            m = before if before.epoch == after.epoch else after
            uniform = bool(torch.all(t == t[0]))
            emit("ok", i=i, epoch=m.epoch, members=list(m.ids), value=float(t[0]), uniform=uniform,
                 other_epoch=None if before.epoch == after.epoch else before.epoch,
                 other_members=None if before.epoch == after.epoch else list(before.ids))
            time.sleep(args.interval)
    except Exception as exc:  # reported to the test, which fails on it
        emit("error", error=f"{type(exc).__name__}: {exc}")
        code = 3
    finally:
        group.close()
        store.close()
        emit("exit")
    return code


if __name__ == "__main__":
    sys.exit(main())
