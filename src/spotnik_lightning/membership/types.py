"""The membership value type: who is in the ring, in which order, at which epoch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from spotnik_lightning.api import ConfigError

TIERS = ("reliable", "transient")


@dataclass(frozen=True, order=True)
class Member:
    """One worker: a stable id, where its ring port listens, and its reliability tier."""

    id: str
    host: str
    port: int
    tier: str = "transient"

    def __post_init__(self) -> None:
        if not self.id or "/" in self.id:
            raise ConfigError(f"member id must be non-empty and contain no '/': {self.id!r}")
        if self.tier not in TIERS:
            raise ConfigError(f"tier must be one of {TIERS}, got {self.tier!r}")
        if not 0 < int(self.port) < 65536:
            raise ConfigError(f"port out of range for member {self.id!r}: {self.port}")

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def to_dict(self) -> dict:
        return {"id": self.id, "host": self.host, "port": self.port, "tier": self.tier}

    @classmethod
    def from_dict(cls, d: dict) -> Member:
        return cls(id=str(d["id"]), host=str(d["host"]), port=int(d["port"]), tier=str(d.get("tier", "transient")))


@dataclass(frozen=True)
class Membership:
    """An epoch and the ordered members of the ring at that epoch.

    Epochs strictly increase; exactly one Membership exists per epoch (the store's CAS ensures it).
    Rank ``i`` is ``members[i]``; the ring sends from rank i to rank (i + 1) % size.
    """

    epoch: int
    members: tuple[Member, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        ids = [m.id for m in self.members]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"duplicate member ids in membership: {ids}")

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(m.id for m in self.members)

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_of(self, member_id: str) -> int:
        """Rank of ``member_id``; raises KeyError if it is not a member."""
        for i, m in enumerate(self.members):
            if m.id == member_id:
                return i
        raise KeyError(member_id)

    def __contains__(self, member_id: object) -> bool:
        return any(m.id == member_id for m in self.members)

    def get(self, member_id: str) -> Member | None:
        return next((m for m in self.members if m.id == member_id), None)

    def without(self, ids: set[str] | frozenset[str], epoch: int | None = None) -> Membership:
        """A copy without ``ids`` (order kept), at ``epoch`` (default: unchanged)."""
        return Membership(self.epoch if epoch is None else epoch, tuple(m for m in self.members if m.id not in ids))

    def with_members(self, new: list[Member] | tuple[Member, ...], epoch: int | None = None) -> Membership:
        """A copy with ``new`` appended (those already present are skipped)."""
        extra = tuple(m for m in new if m.id not in self)
        return Membership(self.epoch if epoch is None else epoch, self.members + extra)

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "members": [m.to_dict() for m in self.members]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Membership:
        d = json.loads(text)
        return cls(int(d["epoch"]), tuple(Member.from_dict(m) for m in d["members"]))
