"""The spotnik backend's name and its environment: :class:`Settings` (``SPOTNIK_*`` parsing/validation)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from spotnik_lightning.api import ConfigError, RingTimeouts
from spotnik_lightning.membership.types import TIERS

BACKEND_NAME = "spotnik"


def _env_ms(env: dict[str, str], key: str) -> timedelta | None:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or int(text) <= 0:
        raise ConfigError(f"{key} must be a positive integer number of milliseconds, got {raw!r}")
    return timedelta(milliseconds=int(text))


@dataclass(frozen=True)
class Settings:
    """The backend's environment, parsed and validated once (:meth:`from_env`)."""

    store_url: str | None = None
    run_id: str | None = None
    host: str | None = None
    tier: str = "transient"
    heartbeat_interval: timedelta | None = None
    heartbeat_timeout: timedelta | None = None
    store_timeout: timedelta = timedelta(seconds=10)
    shutdown_wait: timedelta = timedelta(seconds=10)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        """Read the ``SPOTNIK_*`` keys listed in :mod:`spotnik_lightning.ring.backend`. Raises ConfigError naming the
        key for a malformed value."""
        env = dict(os.environ if env is None else env)
        url = env.get("SPOTNIK_STORE", "").strip() or None
        run_id = env.get("SPOTNIK_RUN_ID", "").strip() or None
        if run_id is not None and "/" in run_id:
            raise ConfigError(f"SPOTNIK_RUN_ID must not contain '/': {run_id!r}")
        host = env.get("SPOTNIK_HOST", "").strip() or None
        tier = env.get("SPOTNIK_TIER", "").strip() or "transient"
        if tier not in TIERS:
            raise ConfigError(f"SPOTNIK_TIER must be one of {TIERS}, got {tier!r}")
        interval = _env_ms(env, "SPOTNIK_HEARTBEAT_MS")
        hb_timeout = _env_ms(env, "SPOTNIK_HEARTBEAT_TIMEOUT_MS")
        store_timeout = _env_ms(env, "SPOTNIK_STORE_TIMEOUT_MS") or timedelta(seconds=10)
        shutdown_wait = _env_ms(env, "SPOTNIK_SHUTDOWN_WAIT_MS") or timedelta(seconds=10)
        settings = cls(url, run_id, host, tier, interval, hb_timeout, store_timeout, shutdown_wait)
        try:
            settings.timeouts(timedelta(minutes=30))
        except ConfigError as exc:
            raise ConfigError(f"SPOTNIK_HEARTBEAT_MS / SPOTNIK_HEARTBEAT_TIMEOUT_MS: {exc}") from None
        return settings

    def timeouts(self, torch_timeout: timedelta | None) -> RingTimeouts:
        """The ring's timeouts: heartbeats from the environment, bootstrap/join/collective from
        torch's process-group ``timeout`` (RingTimeouts defaults where not given)."""
        base = RingTimeouts()
        kw: dict[str, timedelta] = {}
        if self.heartbeat_interval is not None:
            kw["heartbeat_interval"] = self.heartbeat_interval
        if self.heartbeat_timeout is not None:
            kw["heartbeat_timeout"] = self.heartbeat_timeout
        elif self.heartbeat_interval is not None and self.heartbeat_interval >= base.heartbeat_timeout:
            kw["heartbeat_timeout"] = 5 * self.heartbeat_interval
        if isinstance(torch_timeout, timedelta) and torch_timeout > timedelta(0):
            kw.update(bootstrap=torch_timeout, join=torch_timeout, collective=torch_timeout)
        return RingTimeouts(**kw)
