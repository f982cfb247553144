"""Benchmarks of spotnik-lightning (``spotnik bench ...``).

* :mod:`spotnik_lightning.bench.allreduce` — ring all-reduce vs gloo bus bandwidth and memory.
* ``spotnik_lightning.bench.recovery`` — time to repair the ring after a worker dies.

The submodules are imported lazily by the CLI; this package holds only the helpers they share.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

__all__ = ["format_size", "json_events", "kill_tree", "parse_size", "parse_sizes"]

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
          "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "kb": 1000, "mb": 1000**2, "gb": 1000**3}
_SIZE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse a byte count: ``1MiB``, ``16MiB``, ``512KiB``, ``1GiB``, ``4096`` (plain bytes).

    Binary units KiB/MiB/GiB (also K/M/G), decimal KB/MB/GB; case-insensitive. Raises ValueError
    naming the text for anything else, and for zero.
    """
    m = _SIZE.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"bad size {text!r}: expected a positive byte count like 4096, 512KiB, 16MiB or 1GiB")
    value = int(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"bad size {text!r}: must be positive")
    return value


def parse_sizes(text: str) -> list[int]:
    """Parse a comma-separated list of sizes (see :func:`parse_size`)."""
    items = [s for s in text.split(",")] if isinstance(text, str) else []
    if not items or any(not s.strip() for s in items):
        raise ValueError(f"bad size list {text!r}: expected e.g. 1MiB,16MiB")
    return [parse_size(s) for s in items]


def format_size(nbytes: int) -> str:
    """``1048576`` → ``1MiB``; sizes that are not a whole number of a unit stay in bytes / KiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def json_events(lines: Iterable[bytes | str]) -> Iterator[dict]:
    """The JSON objects among ``lines`` (a child's stdout), in order; other lines (a launcher's own
    output, partial writes) are skipped. Blocks on ``lines``; ends when they do."""
    import json

    for raw in lines:
        try:
            msg = json.loads(raw)
        except ValueError:
            continue
        if isinstance(msg, dict):
            yield msg


def kill_tree(pid: int, also: Iterable[int] = ()) -> None:
    """SIGKILL process ``pid``, all its descendants and the processes ``also`` (by PID, e.g. workers
    in sessions of their own that may have outlived their parent). Gone processes are skipped."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for extra in also:
        try:
            procs.append(psutil.Process(extra))
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
