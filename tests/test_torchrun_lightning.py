"""A Lightning script under ``torchrun --rdzv-backend=spotnik``: the rendezvous and the strategy agree
on the membership with no extra flags; a node that starts mid-run joins in place."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

from helpers import collect_events, free_port
from torchrun_agents import TORCHRUN, agent_env

SCRIPT = str(Path(__file__).resolve().parents[1] / "examples" / "torchrun_lightning.py")


class _Node:
    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        self.lines: list[dict] = []
        self._t = collect_events(self.proc, self.lines)

    def of(self, ev: str) -> list[dict]:
        return [x for x in self.lines if x.get("ev") == ev]


def test_lightning_script_under_spotnik_torchrun_with_a_join(tmp_path: Path) -> None:
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"tl-{uuid.uuid4().hex[:6]}"
    argv = [TORCHRUN, "--rdzv-backend=spotnik", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            "--nnodes=2:3", "--nproc-per-node=1", "--monitor-interval=0.2",
            "--rdzv-conf=timeout=60,heartbeat_ms=100,heartbeat_timeout_ms=1500",
            # long enough (~15 s) for the third node to start torch and Lightning and join
            SCRIPT, "--epochs", "3", "--n-data", "1024", "--pace", "0.03"]
    env = agent_env("tl-secret")
    nodes = [_Node(argv, env, tmp_path / "a.log"), _Node(argv, env, tmp_path / "b.log")]
    try:
        deadline = time.monotonic() + 90
        while not any(len(n.of("commit")) >= 5 for n in nodes):
            assert time.monotonic() < deadline, "the two founding nodes did not start training"
            assert all(n.proc.poll() is None for n in nodes), "a node exited early"
            time.sleep(0.1)
        nodes.append(_Node(argv, env, tmp_path / "c.log"))  # a new VM: joins the running job
        for n in nodes:
            assert n.proc.wait(timeout=120) == 0, n.log.read_text()[-3000:]
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.proc.kill()
                n.proc.wait(timeout=10)
    finals = [n.of("final")[-1] for n in nodes]
    assert len({f["hash"] for f in finals}) == 1 and len({f["step"] for f in finals}) == 1
    assert [r["outcome"] for r in finals[2]["resyncs"]][:1] == ["adopted"]
    worlds = [c["world"] for c in nodes[0].of("commit")]
    assert worlds[0] == 2 and worlds[-1] == 3
    # one ring: the members every node saw on its last commit are the same three workers
    assert len({tuple(sorted(n.of("commit")[-1]["members"])) for n in nodes}) == 1


def test_lightning_script_under_stock_torchrun_uses_its_store() -> None:
    # no SPOTNIK_* settings: the ring keeps its membership in torchrun's own TCPStore
    env = {k: v for k, v in agent_env("x").items() if not k.startswith("SPOTNIK_")}
    out = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", SCRIPT, "--epochs", "1", "--n-data", "64",
                          "--pace", "0"], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    finals = [json.loads(x) for x in out.stdout.splitlines() if '"final"' in x]
    assert len(finals) == 2 and len({f["hash"] for f in finals}) == 1 and {f["step"] for f in finals} == {8}
