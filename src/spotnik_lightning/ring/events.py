"""Membership-change events, logged once per change as one structured line."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field

log = logging.getLogger("spotnik.membership")


@dataclass
class MembershipEvent:
    """One installed membership change as seen by one worker.

    kind: "bootstrap", "repair", "join" or "fenced". latency_ms: from this worker's first sign of
    the change (detection or first repair message) to installing the new epoch. messages: control
    frames this worker sent for the change. detections: who was suspected, by whom, and why.
    """

    kind: str
    member: str
    old_epoch: int
    new_epoch: int
    members: list[str]
    removed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    latency_ms: float = 0.0
    messages: int = 0
    detections: list[dict] = field(default_factory=list)

    def log(self) -> None:
        log.info("membership_change %s", json.dumps(asdict(self), sort_keys=True))
