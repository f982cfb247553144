"""Small helpers shared by the tests (importable as ``helpers``: tests/ is on sys.path)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable

from spotnik_lightning.bench import json_events


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it; racy but standard)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``predicate`` until it is true; raise AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def collect_events(proc: subprocess.Popen, into: list[dict]) -> threading.Thread:
    """Append the JSON objects ``proc`` prints on its (text) stdout to ``into``, from a daemon
    thread (returned, started) that ends when the process closes its stdout."""
    def read() -> None:
        assert proc.stdout is not None
        for ev in json_events(proc.stdout):
            into.append(ev)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t
