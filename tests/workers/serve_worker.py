"""A ring member that publishes one snapshot and then keeps its main thread busy (tests/test_ring_serve.py).

    python -m tests.workers.serve_worker STORE_URL RUN_ID MEMBER_ID WORLD NUMEL VERSION BUSY SECONDS

Joins the ring (founding it with WORLD members), publishes ``arange(NUMEL)`` as float32 under
"model" with version VERSION, prints ``{"ev": "busy", "pid", "t"}`` and then, for SECONDS, keeps
its only training thread busy: BUSY is "sleep" (time.sleep) or "compute" (matrix products and
pure-Python loops, holding the GIL most of the time). It calls nothing on the ring meanwhile;
then it prints ``{"ev": "idle", "t"}`` and waits for stdin to close before closing the ring.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta


def emit(ev: str, **fields: object) -> None:
    sys.stdout.write(json.dumps({"ev": ev, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


def main() -> int:
    url, run, mid, world, numel, version, busy, seconds = sys.argv[1:9]
    import torch

    from spotnik_lightning.api import RingTimeouts
    from spotnik_lightning.membership import open_store
    from spotnik_lightning.ring import RingGroup

    timeouts = RingTimeouts(heartbeat_interval=timedelta(milliseconds=100), heartbeat_timeout=timedelta(seconds=1))
    ring = RingGroup.create(open_store(url, run), world_size=int(world), member_id=mid, timeouts=timeouts)
    ring.publish("model", torch.arange(int(numel), dtype=torch.float32), int(version))
    emit("busy")
    end = time.monotonic() + float(seconds)
    if busy == "sleep":
        time.sleep(float(seconds))
    else:
        a = torch.randn(600, 600)
        while time.monotonic() < end:
            a = torch.tanh(a @ a)
            sum(i * i for i in range(50_000))
    emit("idle")
    sys.stdin.read()
    ring.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
