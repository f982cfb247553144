"""Fixtures that start real servers: etcd (``/usr/bin/etcd``) and the embedded store."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port

from spotnik_lightning.membership import EmbeddedStoreServer

ETCD_BIN = "/usr/bin/etcd"


class EtcdServer:
    """One single-node etcd on free loopback ports with its own data dir.

    ``stop()`` and ``start()`` restart it with the same data dir and ports. Elections are tuned
    short (100 ms heartbeat, 500 ms election) so startup is quick and a 1 s lease TTL is honoured
    (etcd's minimum lease TTL is 1.5 x the election timeout).
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.peer_port = free_port()
        self.url = f"etcd://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir.parent / "etcd.log"

    def start(self, timeout: float = 20.0) -> None:
        """Start etcd and block until /health answers true; raise RuntimeError after ``timeout``."""
        assert self.proc is None, "etcd already running"
        client = f"http://127.0.0.1:{self.port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            ETCD_BIN,
            "--name", "spotnik-test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"spotnik-test={peer}",
            "--heartbeat-interval", "100",
            "--election-timeout", "500",
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=0.5) as r:
                    if b'"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"etcd on port {self.port} not healthy within {timeout} s; log tail:\n{tail}")

    def stop(self) -> None:
        """Terminate etcd (by PID) and wait for it; kill it if it ignores SIGTERM for 5 s."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd for this test, killed at teardown. Fails (not skips) when etcd is missing."""
    if not os.access(ETCD_BIN, os.X_OK):
        pytest.fail(f"{ETCD_BIN} not found: install it with `apt-get install etcd-server`")
    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def embedded_server() -> Iterator[EmbeddedStoreServer]:
    """An in-process EmbeddedStoreServer on a free loopback port, stopped at teardown."""
    server = EmbeddedStoreServer("127.0.0.1", 0)
    server.start()
    try:
        yield server
    finally:
        server.stop()
