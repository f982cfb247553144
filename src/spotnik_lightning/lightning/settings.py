"""Where a SpotnikStrategy finds its membership store and identity (arguments first, then environment)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from spotnik_lightning.api import ConfigError, RingTimeouts
from spotnik_lightning.membership import open_store, parse_endpoints
from spotnik_lightning.membership.c10d import C10dMembershipStore
from spotnik_lightning.membership.store import MembershipStore
from spotnik_lightning.membership.types import TIERS
from spotnik_lightning.ring.backend.lifecycle import _local_address_towards
from spotnik_lightning.ring.backend.settings import Settings

LAUNCH_HELP = ("launch it with torchrun (--rdzv-backend=spotnik or c10d), with `python -m "
               "spotnik_lightning.launch`, or set SPOTNIK_STORE (etcd://h:p or embedded://h:p), SPOTNIK_RUN_ID "
               "and SPOTNIK_WORLD_SIZE")


def _int_env(key: str) -> int | None:
    raw = os.environ.get(key, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{key} must be a positive integer, got {raw!r}")
    return int(raw)


@dataclass
class Resolved:
    store_url: str | None
    run_id: str
    world_size: int | None
    member_id: str
    host: str
    tier: str
    timeouts: RingTimeouts
    store_timeout: timedelta


def resolve(*, store: str | None, run_id: str | None, world_size: int | None, member_id: str | None,
            host: str | None, tier: str | None, heartbeat_ms: int | None, heartbeat_timeout_ms: int | None,
            timeouts: RingTimeouts | None) -> Resolved:
    """Merge the strategy's arguments with ``SPOTNIK_*`` / torchrun environment variables.

    Raises ConfigError naming the setting when something is malformed or when there is no
    distributed launch at all (no store and no torchrun/``MASTER_ADDR`` environment)."""
    env = Settings.from_env()
    url = store or env.store_url
    torchrun = all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))
    if url is None and not torchrun:
        raise ConfigError(f"SpotnikStrategy needs a distributed launch: {LAUNCH_HELP}")
    run = run_id or env.run_id or os.environ.get("TORCHELASTIC_RUN_ID") or "spotnik-lightning"
    if "/" in run:
        raise ConfigError(f"run_id must not contain '/': {run!r}")
    node = os.environ.get("SPOTNIK_NODE_ID")  # set by torchrun --rdzv-backend=spotnik (docs/torchrun.md)
    local_world = _int_env("LOCAL_WORLD_SIZE") or 1
    min_nodes = _int_env("SPOTNIK_MIN_NODES")
    size = (world_size or _int_env("SPOTNIK_WORLD_SIZE")
            or (min_nodes * local_world if node and min_nodes else None) or _int_env("WORLD_SIZE"))
    tier = tier or env.tier
    if tier not in TIERS:
        raise ConfigError(f"tier must be one of {TIERS}, got {tier!r}")
    mid = member_id or os.environ.get("SPOTNIK_MEMBER_ID")
    if not mid and node:  # one id per worker incarnation: a restarted worker joins as a new member
        mid = f"{node}-w{os.environ.get('LOCAL_RANK', '0')}-r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    mid = mid or f"{socket.gethostname()}-{os.getpid()}"
    if url is not None:
        scheme, sep, rest = url.partition("://")
        target = parse_endpoints(rest if sep else scheme)[0][0]
    else:
        target = os.environ["MASTER_ADDR"]
    kw: dict[str, timedelta] = {}
    if heartbeat_ms is not None:
        kw["heartbeat_interval"] = timedelta(milliseconds=heartbeat_ms)
    if heartbeat_timeout_ms is not None:
        kw["heartbeat_timeout"] = timedelta(milliseconds=heartbeat_timeout_ms)
    if timeouts is None:
        base = env.timeouts(None)
        timeouts = RingTimeouts(**{**{f: getattr(base, f) for f in ("heartbeat_interval", "heartbeat_timeout")}, **kw})
    elif kw:
        raise ConfigError("give heartbeat_ms/heartbeat_timeout_ms or timeouts=RingTimeouts(...), not both")
    return Resolved(url, run, size, mid, host or env.host or _local_address_towards(target), tier, timeouts,
                    env.store_timeout)


def open_membership_store(cfg: Resolved) -> MembershipStore:
    """The configured store; without SPOTNIK_STORE, torch's c10d TCPStore at MASTER_ADDR:MASTER_PORT
    (hosted by the torchrun agent, or by rank 0 under a plain launcher). Raises
    BackendConnectionError when it cannot be reached."""
    if cfg.store_url is not None:
        return open_store(cfg.store_url, cfg.run_id, cfg.store_timeout)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_master = not agent_store and os.environ.get("RANK") == "0"
    tcp = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=is_master,
                        timeout=cfg.store_timeout, wait_for_workers=False)
    return C10dMembershipStore(tcp, cfg.run_id, cfg.store_timeout)
