"""The membership store protocol. Two implementations: embedded (default) and etcd.

The store is touched at bootstrap, once per repair (the epoch CAS) and on joins — never per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta

from spotnik_lightning.membership.types import Member, Membership


class MembershipStore(ABC):
    """Shared state of one run (``run_id``): the current membership and registered workers.

    Every method is bounded by the store's own timeout and raises
    :class:`~spotnik_lightning.api.BackendConnectionError` when the store cannot be reached.
    Implementations are thread-safe.
    """

    run_id: str

    @abstractmethod
    def get_membership(self) -> Membership | None:
        """The membership with the highest epoch, or None before the first was committed."""

    @abstractmethod
    def cas_membership(self, expected_epoch: int, new: Membership) -> tuple[bool, Membership | None]:
        """Commit ``new`` iff the stored epoch equals ``expected_epoch`` (0 = nothing stored yet).

        ``new.epoch`` must be ``expected_epoch + 1`` (ValueError otherwise). Returns
        ``(won, current)``: ``won`` is True when this call wrote ``new``; ``current`` is the
        membership stored after the call (``new`` when won, the winner's otherwise). Exactly one
        caller can win each epoch.
        """

    @abstractmethod
    def register(self, member: Member, ttl: timedelta) -> None:
        """Register ``member`` as alive for ``ttl``; it stays registered while :meth:`keepalive`
        is called more often than ``ttl``. Re-registering the same id replaces the record."""

    @abstractmethod
    def keepalive(self, member_id: str) -> None:
        """Refresh the registration of ``member_id``. If the store lost it (expired while the
        worker could not reach the store, or etcd lost the lease), a member registered through this
        client is registered again with its original ttl; other ids are left alone."""

    @abstractmethod
    def unregister(self, member_id: str) -> None:
        """Remove the registration of ``member_id`` (idempotent)."""

    @abstractmethod
    def registered(self) -> list[Member]:
        """Currently registered (non-expired) members, in registration order."""

    def watch_registrations(self, callback: Callable[[Member], None]) -> Callable[[], None] | None:
        """Call ``callback(member)`` on a store thread for every registration written after this
        call, until the returned cancel function is called. Returns None when the store cannot
        watch (the embedded store: joiners then only ask a ring member directly, which always
        works). ``callback`` must not block."""
        return None

    @abstractmethod
    def put(self, key: str, value: str) -> None:
        """Store a run-scoped auxiliary value (e.g. run metadata)."""

    @abstractmethod
    def get(self, key: str) -> str | None:
        """Read a run-scoped auxiliary value, None if absent."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and background threads (idempotent)."""

    def __enter__(self) -> MembershipStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
