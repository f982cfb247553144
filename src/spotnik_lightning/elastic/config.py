"""``torchrun --rdzv-backend=spotnik`` settings: the loose ``--rdzv-endpoint`` / ``--rdzv-conf`` bag
parsed once into a frozen :class:`RdzvConfig`.

Every key is validated here and unknown keys are refused (torch's own handlers silently ignore
misspelt keys). Parsing is pure: no store is contacted, no file other than ``secret_file`` is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from spotnik_lightning.api import ConfigError
from spotnik_lightning.membership import parse_endpoints
from spotnik_lightning.membership.types import TIERS

#: The ``--rdzv-conf`` keys this handler understands, with what they mean (documented in docs/torchrun.md).
KEYS = {
    "tier": "reliable | transient (default transient): the tier of this node's workers",
    "heartbeat_ms": "ring heartbeat interval in ms (default: the ring's, 50)",
    "heartbeat_timeout_ms": "silence after which a ring neighbour is declared dead, in ms (default 250)",
    "store_timeout_ms": "bound of one membership-store call, in ms (default 5000)",
    "timeout": "seconds an agent waits for MIN nodes (or a free slot below MAX) before giving up (torchrun's, 900)",
    "node_ttl_ms": "lease of an agent's node record; a dead agent's node disappears after it (default 10000)",
    "secret_file": "path of a file holding the job secret (first line)",
    "secret_env": "name of an environment variable holding the job secret (default SPOTNIK_SECRET if set)",
    "host": "address of this node that peers can reach (default: --local-addr, else the route to the store)",
}

#: The suffix of the run id under which agents register their node records (not ring members).
NODES_SUFFIX = ".nodes"


def _ms(key: str, raw: Any, default: int | None) -> timedelta | None:
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None if default is None else timedelta(milliseconds=default)
    text = str(raw).strip()
    if not (text.isascii() and text.isdigit()) or int(text) <= 0:
        raise ConfigError(f"--rdzv-conf {key} must be a positive integer (milliseconds), got {raw!r}")
    return timedelta(milliseconds=int(text))


def _seconds(key: str, raw: Any, default: float) -> timedelta:
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return timedelta(seconds=default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"--rdzv-conf {key} must be a positive number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ConfigError(f"--rdzv-conf {key} must be a positive number of seconds, got {raw!r}")
    return timedelta(seconds=value)


def _secret(conf: dict[str, Any], env: dict[str, str]) -> tuple[bytes | None, str]:
    """(secret or None, where it came from). None: workers fall back to the machine-local secret."""
    if "secret" in conf:
        raise ConfigError("--rdzv-conf secret=... is refused: the command line is visible to every user (ps); "
                          "use secret_file=PATH or secret_env=VAR")
    if conf.get("secret_file") and conf.get("secret_env"):
        raise ConfigError("--rdzv-conf: give secret_file or secret_env, not both")
    if conf.get("secret_file"):
        path = Path(str(conf["secret_file"])).expanduser()
        try:
            text = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"--rdzv-conf secret_file={path}: cannot read it: {exc}") from exc
        secret = text[0].strip() if text else ""
        if not secret:
            raise ConfigError(f"--rdzv-conf secret_file={path}: the file is empty")
        return secret.encode(), f"file {path}"
    var = str(conf.get("secret_env") or "").strip()
    if var:
        value = env.get(var, "")
        if not value:
            raise ConfigError(f"--rdzv-conf secret_env={var}: the environment variable {var} is unset or empty")
        return value.encode(), f"${var}"
    if env.get("SPOTNIK_SECRET"):
        return env["SPOTNIK_SECRET"].encode(), "$SPOTNIK_SECRET"
    return None, "machine-local ~/.cache/spotnik/secret"


@dataclass(frozen=True)
class RdzvConfig:
    """Everything the handler needs, validated.

    ``store_url`` is what workers get as SPOTNIK_STORE; ``embedded`` is the (host, port) an agent
    should try to host the embedded store on (None for etcd).
    """

    run_id: str
    store_url: str
    embedded: tuple[str, int] | None
    min_nodes: int
    max_nodes: int
    tier: str
    heartbeat: timedelta | None
    heartbeat_timeout: timedelta | None
    store_timeout: timedelta
    wait_timeout: timedelta
    node_ttl: timedelta
    secret: bytes | None
    secret_source: str
    host: str | None

    @classmethod
    def parse(cls, endpoint: str, run_id: str, min_nodes: int, max_nodes: int, conf: dict[str, Any],
              local_addr: str | None = None, env: dict[str, str] | None = None) -> RdzvConfig:
        """Validate torchrun's rendezvous parameters. Raises ConfigError naming the bad value:
        unknown key, malformed endpoint (accepted: ``etcd://h:p[,h:p]``, ``embedded://h:p``,
        ``h:p``), bad run id, bad numbers, unreadable or conflicting secret sources."""
        env = dict(os.environ if env is None else env)
        unknown = sorted(set(conf) - set(KEYS) - {"secret"})
        if unknown:
            raise ConfigError(f"--rdzv-conf: unknown key(s) {unknown} for the spotnik rendezvous; "
                              f"accepted: {sorted(KEYS)}")
        if not isinstance(run_id, str) or not run_id.strip() or "/" in run_id or run_id.endswith(NODES_SUFFIX):
            raise ConfigError(f"--rdzv-id must be non-empty, without '/' and not end in {NODES_SUFFIX!r}: {run_id!r}")
        if not 1 <= min_nodes <= max_nodes:
            raise ConfigError(f"--nnodes must be MIN:MAX with 1 <= MIN <= MAX, got {min_nodes}:{max_nodes}")
        store_url, embedded = parse_endpoint(endpoint)
        tier = str(conf.get("tier") or "transient").strip()
        if tier not in TIERS:
            raise ConfigError(f"--rdzv-conf tier must be one of {TIERS}, got {tier!r}")
        secret, source = _secret(conf, env)
        host = str(conf.get("host") or "").strip() or (local_addr or "").strip() or None
        return cls(
            run_id=run_id, store_url=store_url, embedded=embedded, min_nodes=min_nodes, max_nodes=max_nodes,
            tier=tier, heartbeat=_ms("heartbeat_ms", conf.get("heartbeat_ms"), None),
            heartbeat_timeout=_ms("heartbeat_timeout_ms", conf.get("heartbeat_timeout_ms"), None),
            store_timeout=_ms("store_timeout_ms", conf.get("store_timeout_ms"), 5000),  # type: ignore[arg-type]
            wait_timeout=_seconds("timeout", conf.get("timeout"), 900.0),
            node_ttl=_ms("node_ttl_ms", conf.get("node_ttl_ms"), 10000),  # type: ignore[arg-type]
            secret=secret, secret_source=source, host=host)

    def worker_env(self, host: str, node_id: str) -> dict[str, str]:
        """The SPOTNIK_* variables workers inherit (the contract in docs/torchrun.md)."""
        env = {"SPOTNIK_STORE": self.store_url, "SPOTNIK_RUN_ID": self.run_id, "SPOTNIK_TIER": self.tier,
               "SPOTNIK_HOST": host, "SPOTNIK_NODE_ID": node_id, "SPOTNIK_MIN_NODES": str(self.min_nodes),
               "SPOTNIK_MAX_NODES": str(self.max_nodes),
               "SPOTNIK_STORE_TIMEOUT_MS": str(int(self.store_timeout.total_seconds() * 1000))}
        if self.heartbeat is not None:
            env["SPOTNIK_HEARTBEAT_MS"] = str(int(self.heartbeat.total_seconds() * 1000))
        if self.heartbeat_timeout is not None:
            env["SPOTNIK_HEARTBEAT_TIMEOUT_MS"] = str(int(self.heartbeat_timeout.total_seconds() * 1000))
        if self.secret is not None:
            env["SPOTNIK_SECRET"] = self.secret.decode()
        return env


def parse_endpoint(endpoint: str) -> tuple[str, tuple[str, int] | None]:
    """``(store url for workers, embedded (host, port) or None)`` from ``--rdzv-endpoint``.

    Raises ConfigError naming the endpoint and the accepted forms.
    """
    forms = "etcd://host:port[,host:port...], embedded://host:port or host:port"
    text = (endpoint or "").strip()
    if not text:
        raise ConfigError(f"--rdzv-endpoint is required for the spotnik rendezvous ({forms})")
    scheme, sep, rest = text.partition("://")
    if sep and scheme not in ("etcd", "embedded"):
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: unknown scheme {scheme!r}; expected {forms}")
    try:
        eps = parse_endpoints(rest if sep else text)
    except ConfigError as exc:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: {exc}; expected {forms}") from None
    if sep and scheme == "etcd":
        return "etcd://" + ",".join(_fmt(h, p) for h, p in eps), None
    if len(eps) != 1:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: the embedded store has exactly one host:port; "
                          f"for several endpoints use etcd://")
    host, port = eps[0]
    return f"embedded://{_fmt(host, port)}", (host, port)


def _fmt(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
