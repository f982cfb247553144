"""A local cluster of ring workers forked from a pre-imported "zygote" process.

Starting a Python worker costs about a second of torch import on this class of machine; forking
one from a zygote that already imported torch and spotnik costs milliseconds, so tests and the
recovery benchmark can run dozens of workers and replace killed ones quickly. Every worker is a
real process with its own sockets; the cluster kills only the PIDs it spawned.

The zygote reads JSON commands on stdin (``spawn``, ``quit``) and is single-threaded, so forking
is safe. Workers write JSON lines to the zygote's stdout (see ``loop_worker``), which the
:class:`LocalCluster` reads on a thread into an event list.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

from spotnik_lightning.bench import json_events


def _entry(spec: str) -> Callable[[dict], int]:
    module, _, fn = spec.partition(":")
    return getattr(importlib.import_module(module), fn)


def _zygote(preload: list[str]) -> None:
    import spotnik_lightning.ring  # noqa: F401 - imported before forking, on purpose

    for name in ["spotnik_lightning.bench.loop_worker", *preload]:
        importlib.import_module(name)

    children: set[int] = set()
    os.write(1, b'{"ev":"zygote"}\n')
    stdin = sys.stdin.buffer
    buf = b""
    while True:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            os.write(1, (json.dumps({"ev": "exit", "pid": pid, "code": code, "t": time.time()}) + "\n").encode())
        ready, _, _ = select.select([stdin], [], [], 0.05)
        if not ready:
            continue
        chunk = os.read(stdin.fileno(), 65536)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                buf = b""
                chunk = b""
                break
            pid = os.fork()
            if pid == 0:
                os.close(0)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                code = 1
                try:
                    os.environ.update(cmd["cfg"].get("env") or {})
                    sys.stdout = sys.stderr  # prints go to stderr; fd 1 carries the JSON event lines
                    code = _entry(cmd["cfg"].get("entry", "spotnik_lightning.bench.loop_worker:run"))(cmd["cfg"])
                except SystemExit as exc:  # e.g. Lightning's SIGTERMException: a clean, requested exit
                    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                except BaseException:
                    traceback.print_exc()
                    raise
                finally:
                    os._exit(code)
            children.add(pid)
            os.write(1, (json.dumps({"ev": "spawned", "id": cmd["cfg"]["id"], "pid": pid}) + "\n").encode())
        if not chunk:
            break
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in children:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


class LocalCluster:
    """Spawn, kill and observe loop workers. Use as a context manager: exit kills everything
    this cluster started (by PID) and stops the zygote."""

    def __init__(self, store_url: str, run_id: str, netns: str | None = None, preload: tuple[str, ...] = (),
                 **defaults: object) -> None:
        self.store_url, self.run_id = store_url, run_id
        self.defaults = defaults
        cmd = [sys.executable, "-m", "spotnik_lightning.bench.cluster", "--zygote", ",".join(preload)]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.events: list[dict] = []
        self.pids: dict[str, int] = {}
        self.exited: dict[int, int] = {}
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.wait_for(lambda e: e["ev"] == "zygote", 60, "zygote start")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for ev in json_events(self.proc.stdout):
            with self._cv:
                self.events.append(ev)
                if ev["ev"] == "spawned":
                    self.pids[ev["id"]] = ev["pid"]
                elif ev["ev"] == "exit":
                    self.exited[ev["pid"]] = ev["code"]
                self._cv.notify_all()

    def spawn(self, member_id: str, **cfg: object) -> int:
        """Start a worker; returns its PID. cfg: ``entry`` ("module:function" taking the cfg dict,
        default the loop worker), ``env`` (extra environment), and the entry's own keys (loop
        worker: world_size (None = join), numel, hb_timeout_ms, hb_interval_ms, admit_every,
        pace_s, duration_s, iters, tier, host)."""
        full = {"store": self.store_url, "run_id": self.run_id, "id": member_id, **self.defaults, **cfg}
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": "spawn", "cfg": full}) + "\n").encode())
        self.proc.stdin.flush()
        self.wait_for(lambda e: e["ev"] == "spawned" and e["id"] == member_id, 30, f"spawn of {member_id}")
        return self.pids[member_id]

    def signal(self, member_id: str, sig: int) -> float:
        """Send ``sig`` to a worker this cluster spawned; returns the wall time just before."""
        t = time.time()
        os.kill(self.pids[member_id], sig)
        return t

    def wait_for(self, pred: Callable[[dict], bool], timeout: float, what: str) -> dict:
        """The first event (already seen or future) matching ``pred``; TimeoutError naming
        ``what`` and the last events otherwise."""
        deadline = time.monotonic() + timeout
        with self._cv:
            seen = 0
            while True:
                for ev in self.events[seen:]:
                    if pred(ev):
                        return ev
                seen = len(self.events)
                left = deadline - time.monotonic()
                if left <= 0:
                    tail = "\n".join(json.dumps(e) for e in self.events[-15:])
                    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; last events:\n{tail}")
                self._cv.wait(min(left, 0.2))

    def wait_all(self, ids: list[str], pred: Callable[[dict], bool], timeout: float, what: str,
                 since: int = 0) -> dict[str, dict]:
        """For each id, the first event after index ``since`` matching ``pred``."""
        deadline = time.monotonic() + timeout
        found: dict[str, dict] = {}
        with self._cv:
            while True:
                for ev in self.events[since:]:
                    if ev.get("id") in ids and ev.get("id") not in found and pred(ev):
                        found[ev["id"]] = ev
                if len(found) == len(ids):
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(ids) - set(found))
                    tail = "\n".join(json.dumps(e) for e in self.events[-20:])
                    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what} from {missing}; "
                                       f"last events:\n{tail}")
                self._cv.wait(min(left, 0.2))

    def mark(self) -> int:
        with self._cv:
            return len(self.events)

    def of(self, kind: str) -> list[dict]:
        with self._cv:
            return [e for e in self.events if e["ev"] == kind]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"cmd":"quit"}\n')
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                for pid in self.pids.values():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._reader.join(timeout=5)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        _zygote([m for m in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if m])
    else:
        sys.exit("usage: python -m spotnik_lightning.bench.cluster --zygote [module,module...]")
