"""Fault injection at named points of a training step, for tests and benchmarks.

``SPOTNIK_FAULT="<point>@<step>[,<point>@<step>...]"`` makes this worker SIGKILL itself when it
reaches ``point`` while ``step`` steps are committed (i.e. during step ``step + 1``). Points:

* ``backward`` — in the middle of backward, when the first gradient bucket is handed to the ring;
* ``between_buckets`` — after the first bucket was all-reduced, before the second one starts;
* ``vote`` — just before the commit vote (the others are in the vote, waiting for this member);
* ``after_commit`` — right after the optimizer applied the step, before anything else.

Unset (the normal case), every call is a dictionary lookup.
"""

from __future__ import annotations

import os
import signal

from spotnik_lightning.api import ConfigError

POINTS = ("backward", "between_buckets", "vote", "after_commit")


def parse(spec: str | None) -> set[tuple[str, int]]:
    """Parse a ``SPOTNIK_FAULT`` value; raises ConfigError naming the bad part."""
    out: set[tuple[str, int]] = set()
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        point, sep, step = part.partition("@")
        if not sep or point not in POINTS or not step.isdigit():
            raise ConfigError(f"SPOTNIK_FAULT: expected <point>@<step> with point in {POINTS}, got {part!r}")
        out.add((point, int(step)))
    return out


class Faults:
    """The faults configured for this process (read once from the environment)."""

    def __init__(self, spec: str | None = None) -> None:
        self.points = parse(os.environ.get("SPOTNIK_FAULT") if spec is None else spec)

    def at(self, point: str, committed: int) -> None:
        if (point, committed) in self.points:
            os.kill(os.getpid(), signal.SIGKILL)
