"""torchrun --rdzv-backend=spotnik across hosts: network namespaces on a software switch
(tests/netns.py), etcd on the switch's management network (the "reliable" host), one torchrun
agent per host training examples/torchrun_train.py.

One run goes through every scenario of issue 4 in turn — a whole host killed (VM revocation), a
new host started mid-run (join), a host's links taken down (silent loss), two hosts killed at once
— and asserts after each that the survivors go on in place: their worker PIDs never change, every
step's state hash is the same on every worker that committed it, and the run ends at the agreed
step with identical replicas.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import NetnsBed, require_bed, start_etcd
from torchrun_agents import TORCHRUN, Agent, agent_env, check_history, finish, torchrun_argv, wait_for

pytestmark = pytest.mark.timeout(240)
N_HOSTS = 6  # h0..h4 start; h5 joins mid-run


@pytest.fixture
def bed() -> Iterator[NetnsBed]:
    b = require_bed(N_HOSTS)
    try:
        yield b
    finally:
        b.cleanup()


def test_revocations_and_joins_never_restart_survivors(bed: NetnsBed, tmp_path: Path) -> None:
    t0 = time.monotonic()
    start_etcd(bed, tmp_path / "etcd-data")
    endpoint = f"etcd://{bed.switch_addr}:2379"
    run_id = f"tr-{uuid.uuid4().hex[:6]}"
    stop = tmp_path / "stop"
    env = agent_env(f"netns-{run_id}")
    agents: dict[str, Agent] = {}

    def start(i: int) -> Agent:
        host = bed.hosts[i]
        tier = "reliable" if i == 0 else "transient"
        conf = f"timeout=90,heartbeat_ms=100,heartbeat_timeout_ms=1500,tier={tier}"
        argv = torchrun_argv(endpoint, run_id, "2:6", conf, stop, local_addr=bed.addr[host], pace=0.02)
        agent = Agent(f"h{i}", lambda a, **kw: bed.run(host, a, **kw), argv, env, tmp_path)
        agents[agent.name] = agent
        return agent

    def alive(*names: str) -> list[Agent]:
        return [agents[n] for n in names]

    def settle(names: tuple[str, ...], after: int, what: str, timeout: float = 60) -> int:
        """Wait until each named agent committed 5 steps past ``after`` at world size len(names)."""
        group = alive(*names)
        wait_for(lambda: all(len(a.commits(size=len(names), after_step=after)) >= 5 for a in group), timeout, what,
                 list(agents.values()))
        return max(a.max_step() for a in group)

    for i in range(5):
        start(i)
    step = settle(("h0", "h1", "h2", "h3", "h4"), 0, "5 hosts training", timeout=120)
    pids = {name: a.worker_pids() for name, a in agents.items()}
    assert all(len(p) == 1 for p in pids.values()), pids
    t_up = time.monotonic()

    bed.kill_host(bed.hosts[1])  # VM revocation: agent and worker gone at once
    step = settle(("h0", "h2", "h3", "h4"), step, "survivors after h1 was killed")

    joiner = start(5)  # a new VM mid-run
    step = settle(("h0", "h2", "h3", "h4", "h5"), step, "h5 joined in place", timeout=90)
    assert joiner.events("synced")[0]["step"] > 0, "the joiner must start from the ring's state, not from scratch"

    bed.link_down(bed.hosts[2], mgmt=True)  # silent loss: nothing answers any more
    step = settle(("h0", "h3", "h4", "h5"), step, "survivors after h2 went silent")

    bed.kill_host(bed.hosts[3])  # two hosts at once
    bed.kill_host(bed.hosts[4])
    step = settle(("h0", "h5"), step, "survivors after h3 and h4 were killed together")

    survivors = alive("h0", "h5")
    target = finish(survivors, stop, margin=10, timeout=60)
    elapsed = time.monotonic() - t0

    for a in survivors:
        assert a.worker_pids() == (pids.get(a.name) or a.worker_pids()) and len(a.worker_pids()) == 1, a.describe()
        assert not a.events("error"), a.describe()
    finals = [m for a in survivors for m in a.events("final")]
    assert [m["step"] for m in finals] == [target, target], finals
    assert finals[0]["hash"] == finals[1]["hash"], finals
    check_history(list(agents.values()))
    # the killed hosts' workers never committed after their kill, the silent one never rejoined
    for name in ("h1", "h3", "h4"):
        assert agents[name].proc.poll() is not None
    print(f"netns torchrun: ring of 5 up {t_up - t0:.1f} s, whole scenario {elapsed:.1f} s, final step {target}")


def test_agent_whose_etcd_is_unreachable_fails_cleanly(bed: NetnsBed, tmp_path: Path) -> None:
    """Bad input across hosts: no etcd answers at the endpoint. torchrun exits non-zero naming the
    store and never starts a worker."""
    host = bed.hosts[0]
    marker = tmp_path / "worker-ran"
    argv = [TORCHRUN, "--rdzv-backend=spotnik", f"--rdzv-endpoint=etcd://{bed.switch_addr}:2379", "--rdzv-id=nobody",
            "--nnodes=1:2", "--rdzv-conf=store_timeout_ms=500", f"--local-addr={bed.addr[host]}", "--no-python",
            "touch", str(marker)]
    proc = bed.run(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=agent_env("x"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert b"unreachable" in err and bed.switch_addr.encode() in err, err[-2000:]
    assert not marker.exists()
