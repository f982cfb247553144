"""The spotnik torchrun rendezvous handler against a real etcd and the embedded store: its contract
with the agent (never makes it restart anyone), the worker environment, MIN/MAX, and bad input
(clear error, nothing started half-way)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
from helpers import free_port, wait_until
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from spotnik_lightning.api import ConfigError
from spotnik_lightning.elastic import create_handler
from spotnik_lightning.membership import Member, Membership, open_store

pytestmark = pytest.mark.timeout(60)
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """next_rendezvous exports SPOTNIK_* into os.environ: give each test its own copy."""
    saved = dict(os.environ)
    monkeypatch.setenv("SPOTNIK_SECRET", "handler-test-secret")
    yield
    os.environ.clear()
    os.environ.update(saved)


def params(endpoint: str, run_id: str = "r1", nnodes: tuple[int, int] = (1, 4), **conf: str) -> RendezvousParameters:
    return RendezvousParameters("spotnik", endpoint, run_id, nnodes[0], nnodes[1], local_addr="127.0.0.1", **conf)


@pytest.mark.parametrize("endpoint", ["", "etcd://", "etcd://h", "ftp://h:1", "h:0", "h:99999", "a:1,b:2",
                                      "embedded://a:1,b:2", "::1:2379"])
def test_malformed_endpoint_is_refused_naming_it(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="--rdzv-endpoint"):
        create_handler(params(endpoint))


@pytest.mark.parametrize(("conf", "match"), [
    ({"heartbeat": "100"}, "unknown key"),
    ({"tier": "gold"}, "tier"),
    ({"heartbeat_ms": "-5"}, "heartbeat_ms"),
    ({"timeout": "soon"}, "timeout"),
    ({"secret": "abc"}, "visible"),
    ({"secret_env": "SPOTNIK_NO_SUCH_VAR"}, "SPOTNIK_NO_SUCH_VAR"),
    ({"secret_file": "/nonexistent/secret"}, "secret_file"),
])
def test_bad_conf_is_refused_naming_the_key(conf: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        create_handler(params("127.0.0.1:1", **conf))


def test_bad_run_id_and_nnodes_are_refused() -> None:
    with pytest.raises(ConfigError, match="rdzv-id"):
        create_handler(params("127.0.0.1:1", run_id="a/b"))


def test_unreachable_etcd_fails_fast() -> None:
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="unreachable"):
        create_handler(params(f"etcd://127.0.0.1:{free_port()}", store_timeout_ms="500"))
    assert time.monotonic() - t0 < 15


def test_contract_with_the_agent(etcd_server) -> None:  # noqa: ANN001
    h = create_handler(params(etcd_server.url, run_id="contract", tier="reliable", heartbeat_ms="40",
                              heartbeat_timeout_ms="400"))
    try:
        t0 = time.monotonic()
        info = h.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert h.num_nodes_waiting() == 0
        again = h.next_rendezvous()  # a local restart: no waiting, same private world
        assert again is info and time.monotonic() - t0 < 5
        env = os.environ
        assert env["SPOTNIK_STORE"] == etcd_server.url and env["SPOTNIK_RUN_ID"] == "contract"
        assert env["SPOTNIK_TIER"] == "reliable" and env["SPOTNIK_HOST"] == "127.0.0.1"
        assert (env["SPOTNIK_HEARTBEAT_MS"], env["SPOTNIK_HEARTBEAT_TIMEOUT_MS"]) == ("40", "400")
        assert env["SPOTNIK_SECRET"] == "handler-test-secret" and env["SPOTNIK_NODE_ID"] == h.node_id
        assert (env["SPOTNIK_MIN_NODES"], env["SPOTNIK_MAX_NODES"]) == ("1", "4")
        nodes = open_store(etcd_server.url, "contract.nodes")
        assert [m.id for m in nodes.registered()] == [h.node_id]
        assert not h.is_closed()
    finally:
        h.shutdown()
    assert nodes.registered() == []
    nodes.close()


def test_min_nodes_wait_and_mismatched_run_id(etcd_server) -> None:  # noqa: ANN001
    # a host with another --rdzv-id never sees its peers: a clear timeout, its node record removed
    h = create_handler(params(etcd_server.url, run_id="typo", nnodes=(2, 2), timeout="1"))
    try:
        with pytest.raises(RendezvousTimeoutError, match="only 1 of MIN=2.*same --rdzv-id"):
            h.next_rendezvous()
        assert open_store(etcd_server.url, "typo.nodes").registered() == []
        assert "SPOTNIK_STORE" not in os.environ  # nothing exported: no worker may start
    finally:
        h.shutdown()


def test_max_nodes_refuses_the_extra_node(etcd_server) -> None:  # noqa: ANN001
    a = create_handler(params(etcd_server.url, run_id="full", nnodes=(1, 1)))
    b = create_handler(params(etcd_server.url, run_id="full", nnodes=(1, 1), timeout="1"))
    try:
        a.next_rendezvous()
        with pytest.raises(RendezvousTimeoutError, match="MAX=1"):
            b.next_rendezvous()
    finally:
        a.shutdown()
        b.shutdown()


def test_mismatched_secret_is_refused_before_anything_starts(etcd_server, monkeypatch) -> None:  # noqa: ANN001
    a = create_handler(params(etcd_server.url, run_id="sec"))
    try:
        monkeypatch.setenv("SPOTNIK_SECRET", "another-secret")
        with pytest.raises(RendezvousStateError, match="secret"):
            create_handler(params(etcd_server.url, run_id="sec"))
    finally:
        a.shutdown()


def test_dead_run_is_refused(etcd_server) -> None:  # noqa: ANN001
    store = open_store(etcd_server.url, "dead")
    store.cas_membership(0, Membership(1, (Member("gone", "127.0.0.1", 1),)))
    store.close()
    h = create_handler(params(etcd_server.url, run_id="dead"))
    try:
        with pytest.raises(RendezvousStateError, match="new --rdzv-id"):
            h.next_rendezvous()
    finally:
        h.shutdown()


def test_embedded_store_is_hosted_by_the_first_agent() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    a = create_handler(params(endpoint, run_id="emb", nnodes=(2, 2), timeout="20", node_ttl_ms="1500"))
    b = create_handler(params(endpoint, run_id="emb", nnodes=(2, 2), timeout="20", node_ttl_ms="1500"))
    try:
        assert a._server is not None and b._server is None
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(b.next_rendezvous)  # blocks until MIN=2 nodes are registered
            time.sleep(2.0)  # longer than the node lease: the waiting node must keep its record alive
            assert not waiting.done()
            assert a.next_rendezvous().world_size == 1
            assert waiting.result(timeout=10).world_size == 1
        assert os.environ["SPOTNIK_STORE"] == f"embedded://{endpoint}"
    finally:
        b.shutdown()
        a.shutdown()  # the host unregisters last; its server stops


@pytest.mark.parametrize("case", ["unreachable", "secret"])
def test_torchrun_reports_bad_input_and_starts_no_worker(case: str, etcd_server, tmp_path: Path) -> None:  # noqa: ANN001
    endpoint = f"etcd://127.0.0.1:{free_port()}" if case == "unreachable" else etcd_server.url
    holder = None
    if case == "secret":
        holder = create_handler(params(etcd_server.url, run_id="tr-sec"))  # the run's first node
    marker = tmp_path / "worker-ran"
    env = {**os.environ, "SPOTNIK_SECRET": "not-the-run-secret", "no_proxy": "*", "NO_PROXY": "*"}
    try:
        res = subprocess.run([TORCHRUN, "--rdzv-backend=spotnik", f"--rdzv-endpoint={endpoint}", "--rdzv-id=tr-sec",
                              "--nnodes=1:2", "--rdzv-conf=store_timeout_ms=500", "--no-python", "touch",
                              str(marker)], capture_output=True, text=True, timeout=45, env=env)
    finally:
        if holder is not None:
            holder.shutdown()
    assert res.returncode != 0
    assert ("unreachable" if case == "unreachable" else "job secret") in res.stderr, res.stderr[-3000:]
    assert not marker.exists()


def test_below_min_is_logged_and_nothing_stops(etcd_server, caplog) -> None:  # noqa: ANN001
    ring = open_store(etcd_server.url, "below")
    ring.cas_membership(0, Membership(1, (Member("w0", "127.0.0.1", 1),)))
    a = create_handler(params(etcd_server.url, run_id="below", nnodes=(2, 3), node_ttl_ms="600"))
    b = create_handler(params(etcd_server.url, run_id="below", nnodes=(2, 3), node_ttl_ms="600"))
    ring.register(Member("w0", "127.0.0.1", 1), timedelta(seconds=5))  # a live worker: the run is not dead
    try:
        a.next_rendezvous()
        b.next_rendezvous()
        caplog.set_level(logging.INFO, logger="spotnik.torchrun")
        b.shutdown()  # one of MIN=2 nodes is gone
        wait_until(lambda: "below MIN=2" in caplog.text, 10, "the below-MIN warning")
        assert a.num_nodes_waiting() == 0 and a.next_rendezvous().world_size == 1  # a goes on, untouched
    finally:
        a.shutdown()
        ring.close()
