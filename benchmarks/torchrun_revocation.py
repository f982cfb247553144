"""Time lost per revocation and per join: stock ``torchrun --rdzv-backend=c10d`` + DDP-gloo +
``--max-restarts`` + checkpoint-every-k resume, against ``torchrun --rdzv-backend=spotnik``.

    python benchmarks/torchrun_revocation.py --json benchmarks/out/torchrun.json

Both modes run the same job (examples/torchrun_train.py's model, data and optimizer, ``--pace``
seconds of simulated compute per step) on ``--nodes`` torchrun agents (one worker each, loopback,
``--nnodes=2:MAX``) and go through the same schedule, each event triggered once the previous one
is over: warm up ``--gap`` steps; kill the last node (agent and worker, SIGKILL: a VM revocation);
once training is ``--gap`` steps past where it was, kill the next; then start a new node (join) and
wait until its worker has committed ``--gap`` steps; then train to ``--steps``.

*Progress* is the highest step committed by any worker. The time lost to an event is the time
from the event to the next event (or the end) minus the time the progress made in it would have
taken at the run's median step period — restarts, re-rendezvous, checkpoint reload and recomputed
steps all count; a world that trains on while a joiner boots loses nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from spotnik_lightning.bench import json_events, kill_tree

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SPOTNIK_TRAIN = str(ROOT / "examples" / "torchrun_train.py")
DDP_TRAIN = str(ROOT / "benchmarks" / "torchrun_ddp_train.py")
ETCD = "/usr/bin/etcd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Timeline:
    """Every worker's commit lines, in arrival order, with the progress (max step) over time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.commits: list[dict] = []
        self.progress: list[tuple[float, int]] = []  # (t, new max step), increasing

    def add(self, msg: dict) -> None:
        with self.lock:
            self.commits.append(msg)
            if not self.progress or msg["step"] > self.progress[-1][1]:
                self.progress.append((msg["t"], msg["step"]))

    def max_step(self, at: float | None = None) -> int:
        with self.lock:
            return max((s for t, s in self.progress if at is None or t <= at), default=0)


class Node:
    """One torchrun agent in its own session; its workers' JSON lines go to the timeline."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], timeline: Timeline, log_dir: Path) -> None:
        self.name, self.timeline = name, timeline
        self.lines: list[dict] = []
        with open(log_dir / f"{name}.stderr", "wb") as err:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                         start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for msg in json_events(self.proc.stdout):
            msg["node"] = self.name
            self.lines.append(msg)
            if msg.get("ev") == "commit":
                self.timeline.add(msg)

    def kill(self) -> None:
        """SIGKILL the agent and every process below it (by PID), all at once."""
        kill_tree(self.proc.pid)
        self.proc.wait(10)


def wait_until(pred, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"benchmark: {what} did not happen within {timeout:.0f} s")
        time.sleep(0.05)


def start_etcd(tmp: Path) -> tuple[subprocess.Popen, str]:
    port, peer = free_port(), free_port()
    client = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([ETCD, "--data-dir", str(tmp / "etcd"), "--listen-client-urls", client,
                             "--advertise-client-urls", client, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{client}/health", timeout=0.5) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    wait_until(healthy, 20, "etcd health")
    return proc, f"etcd://127.0.0.1:{port}"


def run_mode(mode: str, args: argparse.Namespace, tmp: Path) -> dict:
    """Run the schedule once under ``mode`` ("c10d" or "spotnik"); return its measurements."""
    timeline = Timeline()
    env = {**os.environ, "SPOTNIK_SECRET": "bench", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "no_proxy": "*", "NO_PROXY": "*"}
    etcd = None
    run_id = f"bench-{mode}-{os.getpid()}"
    nnodes = f"--nnodes=2:{args.nodes + 1}"
    if mode == "spotnik":
        etcd, endpoint = start_etcd(tmp)
        launcher = [TORCHRUN, "--rdzv-backend=spotnik", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", nnodes,
                    "--rdzv-conf=timeout=120", "--nproc-per-node=1", "--max-restarts=0"]
        train = [SPOTNIK_TRAIN, "--steps", str(args.steps), "--pace", str(args.pace)]
    else:
        ckpt = tmp / "ckpt"
        ckpt.mkdir()
        conf = "--rdzv-conf=" + (args.c10d_conf or "timeout=120")
        launcher = [TORCHRUN, "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                    f"--rdzv-id={run_id}", nnodes, conf, "--nproc-per-node=1", f"--max-restarts={args.max_restarts}"]
        train = [DDP_TRAIN, "--steps", str(args.steps), "--pace", str(args.pace), "--ckpt-dir", str(ckpt),
                 "--ckpt-every", str(args.ckpt_every)]
    nodes: list[Node] = []
    events: list[dict] = []
    try:
        t0 = time.time()
        for i in range(args.nodes):
            nodes.append(Node(f"{mode}{i}", launcher + train, env, timeline, tmp))
            if i == 0:
                time.sleep(0.5)  # the first agent hosts the c10d store; let it bind first
        wait_until(lambda: timeline.max_step() >= args.gap, 180, f"{mode}: warm-up")
        alive = args.nodes
        for victim in (nodes[-1], nodes[-2]):
            before, te = timeline.max_step(), time.time()
            victim.kill()
            alive -= 1
            events.append({"kind": "revocation", "t": te})
            expected = alive

            def recovered(b: int = before, n: int = expected) -> bool:
                with timeline.lock:
                    return any(c["step"] > b + args.gap and c["size"] == n for c in timeline.commits[-50:])

            wait_until(recovered, 300, f"{mode}: recovery from the revocation of {victim.name}")
        te = time.time()
        joiner = Node(f"{mode}-joiner", launcher + train, env, timeline, tmp)
        nodes.append(joiner)
        events.append({"kind": "join", "t": te})
        wait_until(lambda: sum(1 for m in joiner.lines if m.get("ev") == "commit") >= args.gap, 300,
                   f"{mode}: the joiner training")
        for n in nodes:  # the killed ones have exited already
            try:
                n.proc.wait(max(1.0, 900 - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{mode}: node {n.name} did not finish") from None
        t_end = time.time()
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.kill()
        if etcd is not None:
            etcd.terminate()
            etcd.wait(10)
    return summarise(mode, timeline, events, t0, t_end, nodes, args)


def stalls(progress: list[tuple[float, int]], start: float, end: float, period: float) -> float:
    """Seconds of stall caused by an event at ``start``: the excess over one median period of the
    gap between progress commits that spans ``start``, plus that of every later gap ending before
    ``end`` that is longer than 2 periods (shorter ones are noise)."""
    lost = 0.0
    for (ta, _), (tb, _) in zip(progress, progress[1:], strict=False):
        if ta < start <= tb:
            lost += max(0.0, tb - ta - period)
        elif start <= ta and tb < end and tb - ta > 2 * period:
            lost += tb - ta - period
    return lost


def summarise(mode: str, timeline: Timeline, events: list[dict], t0: float, t_end: float, nodes: list[Node],
              args: argparse.Namespace) -> dict:
    times = [t for t, _ in timeline.progress]
    period = statistics.median(b - a for a, b in zip(times, times[1:], strict=False))
    bounds = [e["t"] for e in events[1:]] + [t_end]
    out = []
    for e, t_next in zip(events, bounds, strict=True):
        gained = timeline.max_step(t_next) - timeline.max_step(e["t"])
        out.append({"kind": e["kind"], "window_s": round(t_next - e["t"], 3), "progress_steps": gained,
                    "stall_s": round(stalls(timeline.progress, e["t"], t_next, period), 3),
                    "window_lost_s": round(max(0.0, (t_next - e["t"]) - gained * period), 3)})
    finals = [m for n in nodes for m in n.lines if m.get("ev") == "final"]
    pids = {m["pid"] for n in nodes for m in n.lines if "pid" in m}

    def mean(kind: str, key: str) -> float:
        return round(statistics.mean(x[key] for x in out if x["kind"] == kind), 3)

    return {"mode": mode, "wall_s": round(t_end - t0, 2), "median_step_ms": round(1000 * period, 2),
            "final_step": max((m["step"] for m in finals), default=None), "workers_finished": len(finals),
            "worker_processes_started": len(pids), "events": out,
            "lost_per_revocation_s": mean("revocation", "stall_s"), "lost_per_join_s": mean("join", "stall_s"),
            "window_lost_per_revocation_s": mean("revocation", "window_lost_s"),
            "window_lost_per_join_s": mean("join", "window_lost_s")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4, help="agents at the start (one worker each)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--gap", type=int, default=40, help="steps of progress between events")
    ap.add_argument("--pace", type=float, default=0.05, help="simulated compute per step, seconds")
    ap.add_argument("--ckpt-every", type=int, default=20, help="stock: checkpoint every k steps")
    ap.add_argument("--max-restarts", type=int, default=10, help="stock: torchrun --max-restarts")
    ap.add_argument("--c10d-conf", default="",
                    help="stock: --rdzv-conf (default timeout=120; torch defaults otherwise)")
    ap.add_argument("--modes", default="c10d,spotnik")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    if args.nodes < 3:
        ap.error("--nodes must be >= 3 (two are revoked, MIN is 2)")
    results = []
    for mode in args.modes.split(","):
        tmp = Path(tempfile.mkdtemp(prefix=f"spotnik-bench-{mode}-"))
        try:
            results.append(run_mode(mode, args, tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(json.dumps(results[-1]), flush=True)
    report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "settings": vars(args) | {"json": None},
              "results": results}
    by = {r["mode"]: r for r in results}
    if "c10d" in by and "spotnik" in by and by["spotnik"]["lost_per_revocation_s"] > 0:
        ratio = by["c10d"]["lost_per_revocation_s"] / by["spotnik"]["lost_per_revocation_s"]
        report["revocation_ratio"] = round(ratio, 1)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "results"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
