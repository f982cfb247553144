"""torchrun --rdzv-backend=spotnik on one machine (loopback, the embedded store hosted by the first
agent): the policy for one crashed worker process on a multi-worker node.

Policy (docs/torchrun.md): torchrun's agent supervises its node's workers as one group. When one
worker process crashes, that agent stops its siblings and, with ``--max-restarts`` left, starts the
node's workers again: they rejoin the running ring in place and receive the state from a peer.
No other node restarts anything (``num_nodes_waiting`` stays 0), and the training loses only the
node's capacity for the rejoin time. Without restarts left, the node leaves and the rest go on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from helpers import free_port
from torchrun_agents import Agent, agent_env, check_history, finish, torchrun_argv, wait_for

pytestmark = pytest.mark.timeout(150)


def test_one_crashed_worker_restarts_only_its_node(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    endpoint = f"127.0.0.1:{free_port()}"
    run_id = f"local-{uuid.uuid4().hex[:6]}"
    conf = "timeout=60,heartbeat_ms=100,heartbeat_timeout_ms=1500"
    env = agent_env("local-secret")
    agents: list[Agent] = []
    try:
        a = Agent("a", subprocess.Popen,
                  torchrun_argv(endpoint, run_id, "2:3", conf, stop, nproc=2, max_restarts=2), env, tmp_path)
        agents.append(a)
        b = Agent("b", subprocess.Popen,
                  torchrun_argv(endpoint, run_id, "2:3", conf, stop, nproc=2), env, tmp_path)
        agents.append(b)
        # (founding needs MIN x nproc workers, so the founding nodes run the same --nproc-per-node)
        wait_for(lambda: all(len(x.commits(size=4)) >= 5 for x in agents), 90, "4 workers training", agents)
        a_pids, b_pids = a.worker_pids(), b.worker_pids()
        assert len(a_pids) == 2 and len(b_pids) == 2

        victim = min(a_pids)
        os.kill(victim, signal.SIGKILL)
        crashed_at = max(x.max_step() for x in agents)
        # b goes on at once with what is left of the ring; a's restarted pair rejoins
        wait_for(lambda: len(b.commits(after_step=crashed_at)) >= 3, 30, "b training on after the crash", agents)
        wait_for(lambda: len(a.worker_pids() - a_pids) == 2 and len(b.commits(size=4, after_step=crashed_at)) >= 5,
                 60, "a's workers restarted and back in the ring", agents)
        target = finish(agents, stop, margin=10, timeout=40)
    finally:
        for x in agents:
            if x.proc.poll() is None:
                x.kill()

    assert b.worker_pids() == b_pids, "the healthy node's workers must never be restarted"
    assert victim not in {m["pid"] for m in a.events("final")}
    assert not a_pids & {m["pid"] for m in a.events("final")}, "a's surviving sibling is restarted with the node"
    finals = a.events("final") + b.events("final")
    assert len(finals) == 4 and {m["step"] for m in finals} == {target}, finals
    assert len({m["hash"] for m in finals}) == 1, finals
    check_history(agents)
    assert not b.events("error")
