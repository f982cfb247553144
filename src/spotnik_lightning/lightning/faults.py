"""Fault injection at named points of a training step, for tests and benchmarks.

``SPOTNIK_FAULT="<point>@<step>[#<k>][,...]"`` makes this worker SIGKILL itself when it reaches
``point`` for the ``k``-th time (default 1) while ``step`` steps are committed (i.e. during step
``step + 1``; ``#2`` on ``vote`` hits the second ``opt.step()`` of a manual training step). Points:

* ``backward`` — in the middle of backward, when the first gradient bucket is handed to the ring;
* ``between_buckets`` — after the first bucket was all-reduced, before the second one starts;
* ``vote`` — just before the commit vote (the others are in the vote, waiting for this member);
* ``after_commit`` — right after the optimizer applied the step, before anything else;
* ``state_send`` — a donor, between packing its state and sending it to a joiner;
* ``collective`` / ``collective_done`` — entering / right after completing one of Lightning's
  collectives (checkpoint broadcasts and barriers); after completing, the last pieces this member
  forwards may not have left yet, so some peers complete that collective and others do not.

``<step>`` may be ``*`` (any step).

Unset (the normal case), every call is a dictionary lookup.
"""

from __future__ import annotations

import os
import signal

from spotnik_lightning.api import ConfigError

POINTS = ("backward", "between_buckets", "vote", "after_commit", "state_send", "collective", "collective_done")
ANY = -1


def parse(spec: str | None) -> dict[tuple[str, int], int]:
    """Parse a ``SPOTNIK_FAULT`` value into {(point, step): k}; raises ConfigError naming the bad part."""
    out: dict[tuple[str, int], int] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        point, sep, rest = part.partition("@")
        step, _, nth = rest.partition("#")
        if not sep or point not in POINTS or not (step.isdigit() or step == "*") or not (nth or "1").isdigit():
            raise ConfigError(f"SPOTNIK_FAULT: expected <point>@<step>[#<k>] with point in {POINTS}, got {part!r}")
        out[(point, ANY if step == "*" else int(step))] = int(nth or 1)
    return out


class Faults:
    """The faults configured for this process (read once from the environment)."""

    def __init__(self, spec: str | None = None) -> None:
        self.points = parse(os.environ.get("SPOTNIK_FAULT") if spec is None else spec)
        self._seen: dict[tuple[str, int], int] = {}

    def at(self, point: str, committed: int) -> None:
        key = (point, committed) if (point, committed) in self.points else (point, ANY)
        if key in self.points:
            self._seen[key] = self._seen.get(key, 0) + 1
            if self._seen[key] == self.points[key]:
                os.kill(os.getpid(), signal.SIGKILL)
