"""A throw-away network test bed: N "hosts" as network namespaces behind a software switch.

Layout (nothing is created in the root namespace, so the machine's own network is never touched)::

    spk-<tag>-sw   the switch namespace: bridge "data0" (the data network, 10.213.<k>.0/24) and
                   bridge "mgmt" (the management network, 10.213.<k+1>.0/24, whose bridge
                   itself holds 10.213.<k+1>.254: services such as the store run here)
    spk-<tag>-h<i> host i: eth0 = 10.213.<k>.<i+1> on the data network (veth to port vd<i>),
                   eth1 = 10.213.<k+1>.<i+1> on the management network (veth to port vm<i>)

Faults are made with iproute2 only (no firewall, no extra package):

* :meth:`NetnsBed.partition` moves the data ports of each group but the first onto a bridge of
  its own: traffic between groups is silently dropped (like a broken switch), while every host
  still reaches the management network (the store);
* :meth:`NetnsBed.link_down` / :meth:`NetnsBed.link_up` take a host's data link (and optionally
  its management link) down and up;
* :meth:`NetnsBed.kill_host` kills every process inside a host (a VM revocation);
* :meth:`NetnsBed.rate_limit` shapes a host's egress with ``tc tbf``.

:meth:`NetnsBed.cleanup` kills every process the bed started (by PID, plus any process left inside
its namespaces), deletes the namespaces (which destroys the veths and bridges) and is idempotent;
it also runs at interpreter exit. Use the bed as a context manager or through a fixture that
calls cleanup in ``finally``.

Requires root (CAP_NET_ADMIN and CAP_SYS_ADMIN); creation raises :class:`NetnsUnavailable` when
``ip netns add`` is refused.
"""

from __future__ import annotations

import atexit
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

IP = "ip"
ETCD_BIN = "/usr/bin/etcd"


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, or no CAP_NET_ADMIN/CAP_SYS_ADMIN)."""


def _run(argv: Sequence[str], check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    return res


class NetnsBed:
    """``n_hosts`` namespaces on one switch. Hosts are named ``bed.hosts[i]``; their data
    addresses are ``bed.addr[host]``, management addresses ``bed.mgmt_addr[host]``; the switch
    namespace is ``bed.switch`` and its management address ``bed.switch_addr``."""

    def __init__(self, n_hosts: int) -> None:
        if n_hosts < 1:
            raise ValueError("n_hosts must be >= 1")
        self.tag = secrets.token_hex(3)
        k = 2 * random.randrange(1, 127)  # data 10.213.k.0/24, management 10.213.k+1.0/24
        self.data_net, self.mgmt_net = f"10.213.{k}", f"10.213.{k + 1}"
        self.switch = f"spk-{self.tag}-sw"
        self.hosts = [f"spk-{self.tag}-h{i}" for i in range(n_hosts)]
        self.addr = {h: f"{self.data_net}.{i + 1}" for i, h in enumerate(self.hosts)}
        self.mgmt_addr = {h: f"{self.mgmt_net}.{i + 1}" for i, h in enumerate(self.hosts)}
        self.switch_addr = f"{self.mgmt_net}.254"
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._bridges = ["data0", "mgmt"]
        self._closed = False
        atexit.register(self.cleanup)
        try:
            self._build()
        except BaseException:
            self.cleanup()
            raise

    # ------------------------------------------------------------------ construction
    def _add_ns(self, name: str) -> None:
        res = _run([IP, "netns", "add", name], check=False)
        if res.returncode != 0:
            raise NetnsUnavailable(f"`ip netns add {name}` failed: {res.stderr.strip()}")
        self._created.append(name)
        self._ip(name, "link", "set", "lo", "up")

    def _ip(self, ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run([IP, "-n", ns, *args], check=check)

    def _build(self) -> None:
        self._add_ns(self.switch)
        for br in ("data0", "mgmt"):
            self._ip(self.switch, "link", "add", br, "type", "bridge")
            self._ip(self.switch, "link", "set", br, "up")
        self._ip(self.switch, "addr", "add", f"{self.switch_addr}/24", "dev", "mgmt")
        for i, host in enumerate(self.hosts):
            self._add_ns(host)
            for port, dev, br, addr in ((f"vd{i}", "eth0", "data0", self.addr[host]),
                                        (f"vm{i}", "eth1", "mgmt", self.mgmt_addr[host])):
                self._ip(self.switch, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", host)
                self._ip(self.switch, "link", "set", port, "master", br, "up")
                self._ip(host, "addr", "add", f"{addr}/24", "dev", dev)
                self._ip(host, "link", "set", dev, "up")

    # ------------------------------------------------------------------ processes
    def run(self, host: str, argv: Sequence[str], **popen_kwargs: object) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` (a host or the switch namespace). The process is
        killed by :meth:`cleanup` if it is still running then."""
        if self._closed:
            raise RuntimeError("the test bed is cleaned up")
        if host not in self._created:
            raise ValueError(f"{host!r} is not a namespace of this bed")
        proc = subprocess.Popen([IP, "netns", "exec", host, *argv], **popen_kwargs)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def check_call(self, host: str, argv: Sequence[str], timeout: float = 10.0) -> str:
        """Run ``argv`` inside ``host`` to completion; return its stdout (raises on failure)."""
        return _run([IP, "netns", "exec", host, *argv], timeout=timeout).stdout

    # ------------------------------------------------------------------ faults
    def _index(self, host: str) -> int:
        return self.hosts.index(host)

    def link_down(self, host: str, mgmt: bool = False) -> None:
        """Take ``host``'s data link down (also its management link when ``mgmt``)."""
        self._ip(host, "link", "set", "eth0", "down")
        if mgmt:
            self._ip(host, "link", "set", "eth1", "down")

    def kill_host(self, host: str) -> list[int]:
        """A VM revocation: SIGKILL every process inside ``host``'s namespace (by PID); returns
        the PIDs signalled."""
        pids = self._pids_in(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def link_up(self, host: str) -> None:
        for dev in ("eth0", "eth1"):
            self._ip(host, "link", "set", dev, "up")

    def rate_limit(self, host: str, rate: str, burst: str = "32kb", latency: str = "100ms") -> None:
        """Shape ``host``'s egress on the data link to ``rate`` (tc syntax, e.g. "10mbit")."""
        self.check_call(host, ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
                               "burst", burst, "latency", latency])

    def clear_rate_limit(self, host: str) -> None:
        _run([IP, "netns", "exec", host, "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)

    def partition(self, *groups: Sequence[str]) -> None:
        """Cut the data network into ``groups`` (hosts not named stay with the first group).
        Hosts within a group still talk; across groups nothing passes. The management network
        (and so the store) stays reachable from everyone."""
        for g, group in enumerate(groups[1:], start=1):
            br = f"data{g}"
            if br not in self._bridges:
                self._ip(self.switch, "link", "add", br, "type", "bridge")
                self._ip(self.switch, "link", "set", br, "up")
                self._bridges.append(br)
            for host in group:
                self._ip(self.switch, "link", "set", f"vd{self._index(host)}", "master", br)

    def heal(self) -> None:
        """Undo :meth:`partition`: every data port back on one bridge."""
        for i in range(len(self.hosts)):
            self._ip(self.switch, "link", "set", f"vd{i}", "master", "data0")

    # ------------------------------------------------------------------ teardown
    def _pids_in(self, ns: str) -> list[int]:
        res = _run([IP, "netns", "pids", ns], check=False)
        return [int(p) for p in res.stdout.split() if p.isdigit()]

    def cleanup(self) -> None:
        """Kill every process the bed started (then any other left in its namespaces), delete the
        namespaces. Idempotent; never raises; bounded (a few seconds per stubborn process)."""
        self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    proc.terminate()
                except OSError:
                    pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(3.0)
                except subprocess.TimeoutExpired:
                    print(f"netns bed: pid {proc.pid} survived SIGKILL", file=sys.stderr)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
        for ns in list(self._created):
            try:
                # only processes inside our own namespaces: started by us (e.g. grandchildren)
                for pid in self._pids_in(ns):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                res = _run([IP, "netns", "del", ns], check=False)
                if res.returncode != 0 and Path(f"/run/netns/{ns}").exists():
                    print(f"netns bed: cannot delete {ns}: {res.stderr.strip()}", file=sys.stderr)
                    continue
                self._created.remove(ns)
            except Exception as exc:  # keep cleaning the others
                print(f"netns bed: cleanup of {ns} failed: {exc}", file=sys.stderr)
        self._procs = [p for p in self._procs if p.poll() is None]

    def __enter__(self) -> NetnsBed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def require_bed(n_hosts: int) -> NetnsBed:
    """A bed for a test, or a loud failure: when namespaces cannot be created the test FAILS,
    unless ``SPOTNIK_NO_NETNS=1`` is set, in which case it is skipped with the reason."""
    import pytest

    try:
        return NetnsBed(n_hosts)
    except NetnsUnavailable as exc:
        if os.environ.get("SPOTNIK_NO_NETNS") == "1":
            pytest.skip(f"NETWORK NAMESPACE TESTS SKIPPED (SPOTNIK_NO_NETNS=1): {exc}")
        pytest.fail(f"cannot create network namespaces ({exc}); run as root, or set SPOTNIK_NO_NETNS=1 "
                    f"to skip the namespace tests explicitly")


def start_etcd(bed: NetnsBed, data_dir: Path, port: int = 2379, timeout: float = 20.0) -> subprocess.Popen:
    """Start a single-node etcd in the switch namespace on ``bed.switch_addr:port`` (the
    management network, reachable from every host) with short elections, like the conftest
    fixture; block until it reports healthy. The bed's cleanup kills it."""
    if not os.access(ETCD_BIN, os.X_OK):
        raise RuntimeError(f"{ETCD_BIN} not found: install it with `apt-get install etcd-server`")
    data_dir.mkdir(parents=True, exist_ok=True)
    client = f"http://{bed.switch_addr}:{port}"
    peer = f"http://127.0.0.1:{port + 1}"
    log_path = data_dir.parent / f"etcd-{bed.tag}.log"
    cmd = [
        ETCD_BIN,
        "--name", "spotnik-netns",
        "--data-dir", str(data_dir),
        "--listen-client-urls", client,
        "--advertise-client-urls", client,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"spotnik-netns={peer}",
        "--heartbeat-interval", "100",
        "--election-timeout", "500",
    ]  # fmt: skip
    with open(log_path, "ab") as log:
        proc = bed.run(bed.switch, cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    probe = (
        "import sys, time, urllib.request\n"
        f"end = time.monotonic() + {timeout}\n"
        "while time.monotonic() < end:\n"
        "    try:\n"
        f"        with urllib.request.urlopen('{client}/health', timeout=0.5) as r:\n"
        "            if b'\"true\"' in r.read():\n"
        "                sys.exit(0)\n"
        "    except OSError:\n"
        "        pass\n"
        "    time.sleep(0.1)\n"
        "sys.exit(1)\n"
    )
    res = subprocess.run([IP, "netns", "exec", bed.switch, sys.executable, "-c", probe],
                         capture_output=True, timeout=timeout + 10, stdin=subprocess.DEVNULL,
                         env={**os.environ, "no_proxy": "*", "NO_PROXY": "*"})
    if res.returncode != 0 or proc.poll() is not None:
        tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        raise RuntimeError(f"etcd in {bed.switch} not healthy within {timeout} s; log tail:\n{tail}")
    return proc
