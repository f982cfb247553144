"""Helpers for tests that launch ``torchrun --rdzv-backend=spotnik`` agents running
examples/torchrun_train.py and read the JSON lines their workers print (importable as
``torchrun_agents``: tests/ is on sys.path)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from spotnik_lightning.bench import json_events, kill_tree

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TRAIN = str(Path(__file__).resolve().parents[1] / "examples" / "torchrun_train.py")


def torchrun_argv(endpoint: str, run_id: str, nnodes: str, conf: str, stop_file: Path, *, nproc: int = 1,
                  local_addr: str | None = None, max_restarts: int = 0, pace: float = 0.01) -> list[str]:
    """The command line of one agent training until the target written into ``stop_file``."""
    argv = [TORCHRUN, "--rdzv-backend=spotnik", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.2", f"--rdzv-conf={conf}"]
    if local_addr:
        argv.append(f"--local-addr={local_addr}")
    return argv + [TRAIN, "--steps", "1000000", "--stop-file", str(stop_file), "--pace", str(pace)]


def agent_env(secret: str) -> dict[str, str]:
    return {**os.environ, "SPOTNIK_SECRET": secret, "PYTHONUNBUFFERED": "1", "no_proxy": "*", "NO_PROXY": "*",
            "OMP_NUM_THREADS": "1"}


def _runs_train(pid: int) -> bool:
    """A worker that outlived its agent is still ours only if it runs our training script."""
    try:
        return TRAIN in psutil.Process(pid).cmdline()
    except psutil.Error:
        return False


class Agent:
    """One torchrun agent (started by ``start(argv, stdout=PIPE, stderr=file)``) and the JSON
    lines of its workers, collected by a reader thread."""

    def __init__(self, name: str, start: Callable[..., subprocess.Popen], argv: Sequence[str], env: dict[str, str],
                 log_dir: Path) -> None:
        self.name = name
        self.lines: list[dict] = []
        self._lock = threading.Lock()
        self.stderr_path = log_dir / f"{name}.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = start(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for msg in json_events(self.proc.stdout):  # (torchrun itself may print to stdout)
            if "ev" in msg:
                with self._lock:
                    self.lines.append(msg)

    def events(self, ev: str | None = None) -> list[dict]:
        with self._lock:
            return [m for m in self.lines if ev is None or m["ev"] == ev]

    def commits(self, size: int | None = None, after_step: int = -1) -> list[dict]:
        return [m for m in self.events("commit") if (size is None or m["size"] == size) and m["step"] > after_step]

    def max_step(self) -> int:
        return max((m["step"] for m in self.events("commit")), default=0)

    def worker_pids(self) -> set[int]:
        return {m["pid"] for m in self.events()}

    def kill(self) -> None:
        """SIGKILL the agent and every process below it, by PID (torchrun puts each worker in a
        session of its own, so a process-group kill would miss them). Waits for the agent."""
        kill_tree(self.proc.pid, [pid for pid in self.worker_pids() if _runs_train(pid)])
        self.proc.wait(10)

    def wait(self, timeout: float) -> int | None:
        """Wait for the agent to exit; returns its exit code, or None if it did not exit in time."""
        try:
            rc = self.proc.wait(max(0.1, timeout))
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(5)
        return rc

    def describe(self) -> str:
        tail = self.stderr_path.read_text(errors="replace")[-1500:] if self.stderr_path.exists() else ""
        evs = [(m["ev"], m.get("size"), m.get("pid")) for m in self.events()]
        compact: list = []
        for e in evs:
            if compact and compact[-1][0] == e:
                compact[-1][1] += 1
            else:
                compact.append([e, 1])
        errors = self.events("error")
        return (f"{self.name} (rc={self.proc.poll()}, max step {self.max_step()}): {compact[-12:]}\n"
                f"  errors: {errors}\n  stderr tail: {tail}")


def wait_for(pred: Callable[[], bool], timeout: float, what: str, agents: Sequence[Agent]) -> None:
    """Poll ``pred`` until it holds; fail with every agent's story after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:.0f} s waiting for {what}\n"
                                 + "\n".join(a.describe() for a in agents))
        time.sleep(0.1)


def check_history(agents: Sequence[Agent]) -> None:
    """Every commit of a step carries the same state hash on every worker (replicas never
    diverge), and no worker reported an error."""
    by_step: dict[int, set[str]] = {}
    for a in agents:
        for m in a.events("commit"):
            by_step.setdefault(m["step"], set()).add(m["hash"])
    forks = {s: h for s, h in by_step.items() if len(h) > 1}
    assert not forks, f"replicas diverged at steps {sorted(forks)[:5]}: {list(forks.items())[:3]}"


def finish(agents: Sequence[Agent], stop_file: Path, margin: int, timeout: float) -> int:
    """Ask the survivors to stop ``margin`` steps past the furthest commit; wait for their agents
    to exit 0. Returns the target step."""
    target = max(a.max_step() for a in agents) + margin
    tmp = stop_file.with_suffix(".tmp")
    tmp.write_text(str(target))
    tmp.replace(stop_file)
    deadline = time.monotonic() + timeout
    for a in agents:
        rc = a.wait(deadline - time.monotonic())
        assert rc == 0, f"agent {a.name} exited with {rc}\n" + "\n".join(x.describe() for x in agents)
    return target
