"""The contract shared by every layer: the error hierarchy and validated timeouts.

Everything that can go wrong in spotnik raises a subclass of :class:`SpotnikError`. Lower layers
import from here; this module imports from nobody in the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta


class SpotnikError(RuntimeError):
    """Base class of every error raised by spotnik-lightning."""


class ConfigError(SpotnikError, ValueError):
    """A configuration value or key is invalid; the message names the key."""


class BackendConnectionError(SpotnikError):
    """The membership store (embedded or etcd) cannot be reached or answered with an error."""


class MembershipTimeoutError(SpotnikError, TimeoutError):
    """A bounded wait (bootstrap, join, repair, collective) ran out of time.

    The message names the operation, the epoch and the peer waited for.
    """


class EpochFencedError(SpotnikError):
    """This worker lost the compare-and-swap for the next epoch, or was excluded from it.

    It must stop running collectives: another membership owns the job now. ``epoch`` is the epoch
    the store holds, ``members`` its member ids (empty when unknown).
    """

    def __init__(self, message: str, epoch: int = -1, members: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.members = members


#: The name the issue tracker uses for the same error.
FencedOut = EpochFencedError


class RingBrokenError(SpotnikError):
    """The ring cannot continue (closed, left, or repair impossible, e.g. every peer is gone)."""


class MembershipChanged(SpotnikError):  # noqa: N818 - the name is part of the public contract
    """A collective was interrupted by a membership change and must be retried.

    Raised by a collective that was in flight (or queued) when the ring repaired or admitted
    workers. Nothing of the interrupted collective's result may be used; the caller retries on the
    new membership (``new_epoch``).
    """

    def __init__(self, old_epoch: int, new_epoch: int, reason: str = "") -> None:
        super().__init__(f"membership changed from epoch {old_epoch} to {new_epoch}: {reason}")
        self.old_epoch = old_epoch
        self.new_epoch = new_epoch
        self.reason = reason


class ProtocolError(SpotnikError):
    """A peer sent a malformed, truncated, oversized or unauthenticated frame."""


class FetchError(SpotnikError):
    """A fetch from a peer's served snapshot cache failed; the caller's buffer holds nothing usable.

    ``gone`` is True when the peer died, left, was removed from the membership, could not be
    reached or stopped answering (drop it: asking again will not help); False when the peer is
    alive but has no usable snapshot (nothing published under the name, older than asked for, or
    of another size). The message names the peer, the epoch and the operation.
    """

    def __init__(self, message: str, peer: str, epoch: int, gone: bool) -> None:
        super().__init__(message)
        self.peer = peer
        self.epoch = epoch
        self.gone = gone


def _positive(name: str, value: timedelta) -> timedelta:
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise ConfigError(f"timeout {name!r} must be a positive timedelta, got {value!r}")
    return value


@dataclass(frozen=True)
class RingTimeouts:
    """Every bounded wait of the ring, validated positive.

    heartbeat_interval: how often a worker pings its ring neighbours (UDP).
    heartbeat_timeout: silence after which a neighbour is declared dead (detection bound for
        SIGSTOP / link down; a killed peer is found at once through EOF).
    connect: one TCP connect + handshake.
    collective: the longest a collective may make no progress before the peer is suspected.
    repair: the longest a repair may take before the worker gives up with RingBrokenError.
    join: the longest a newcomer waits to be admitted.
    bootstrap: the longest the founding workers wait for each other.
    """

    heartbeat_interval: timedelta = timedelta(milliseconds=50)
    heartbeat_timeout: timedelta = timedelta(milliseconds=250)
    connect: timedelta = timedelta(seconds=5)
    collective: timedelta = timedelta(seconds=60)
    repair: timedelta = timedelta(seconds=30)
    join: timedelta = timedelta(seconds=120)
    bootstrap: timedelta = timedelta(seconds=120)

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            _positive(name, getattr(self, name))
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("heartbeat_timeout must be longer than heartbeat_interval")
