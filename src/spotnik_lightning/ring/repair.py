"""Ring repair and admission: reconcile → accept → restart (Spotnik §3.2), fenced by the store.

Reconcile: a worker that suspects a peer (EOF, reset, missed heartbeats, a failed connect) aborts
the collective in flight, adds the peer to its *dead set* and sends a token ``rec(base, dead,
origin, round)`` to its successor in its view (members minus dead), bridging over holes by
connecting to the next live member. Every worker merges the token with its own dead set (both
ways) and forwards it; a token whose origin is dead is dropped. When a token comes back to its
origin carrying exactly the origin's dead set, every live worker has reconciled it.

Accept: the origin sends ``acc(base, dead)`` around; a worker that knows of more deaths drops it
(its own token carries the larger set), others adopt it and forward it.

Restart: when the accept returns, the origin commits ``members - dead`` as epoch base+1 with one
compare-and-swap in the store. Exactly one membership wins each epoch; the origin sends
``rst(membership, path)`` along its view and every worker on the path installs it — or, if it is
not a member of the winning membership (the other side of a partition), is fenced out.

Messages per worker per repair: one forward per token (at most one token per detector, i.e.
O(K) for K concurrent revocations), one accept and one restart per origin that completes.
Joins reuse restart: the leader commits ``members + joiners`` and sends ``rst`` along it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from spotnik_lightning.api import (
    BackendConnectionError,
    EpochFencedError,
    MembershipChanged,
    MembershipTimeoutError,
    ProtocolError,
    RingBrokenError,
)
from spotnik_lightning.membership.types import Member, Membership
from spotnik_lightning.ring.events import MembershipEvent
from spotnik_lightning.ring.state import CLOSED, FENCED, LEAVING, REPAIRING, RUNNING
from spotnik_lightning.ring.state import Interrupted as _Interrupted

log = logging.getLogger("spotnik.ring")


class RepairMixin:
    """The membership state machine of :class:`~spotnik_lightning.ring.group.RingGroup`.

    All handlers run on reader / control threads; they hold the group lock only to update state
    and hand network I/O to the control thread.
    """

    def _init_repair_state(self) -> None:
        self._dead: set[str] = set()
        self._token_round = 0
        self._accepting: frozenset[str] | None = None
        self._repair_t0 = 0.0
        self._repair_progress = 0.0
        self._repair_msgs = 0
        self._detections: list[dict] = []
        self._join_watch: Callable[[], None] | None = None

    # ------------------------------------------------------------------ detection
    def _suspect(self, peer: str, reason: str) -> None:
        """Declare ``peer`` dead (idempotent) and start or extend the repair."""

        with self._cv:
            if self._state not in (RUNNING, REPAIRING) or peer == self.me.id:
                return
            if peer not in self._membership or peer in self._dead:
                return
            self._begin_repair_locked(f"{peer}: {reason}")
            self._dead.add(peer)
            self._detections.append({"peer": peer, "by": self.me.id, "reason": reason,
                                     "t_ms": round(1000 * (time.monotonic() - self._repair_t0), 2)})
            log.info("%s suspects %s at epoch %d: %s", self.me.id, peer, self._membership.epoch, reason)
            self._originate_locked()
            notice = {"t": "ex", "base": self._membership.epoch, "reason": reason}
        # tell the peer it is excluded (if it is alive, e.g. only slow, it fences itself rather
        # than suspecting us back and splitting the ring further)
        self._close_links_to(peer, notice)

    def _begin_repair_locked(self, reason: str) -> None:
        if self._state == RUNNING:
            self._state = REPAIRING
            self._repair_t0 = self._repair_progress = time.monotonic()
            self._repair_msgs = 0
            self._detections = []
            self._dead = set()
            self._accepting = None
            for op in list(self._ops.values()):
                op.fail(_Interrupted(reason))
            for link in list(self._out.values()):
                link.drop_data()
            self._cv.notify_all()
        self._repair_progress = time.monotonic()

    def _view_locked(self) -> list[str]:
        return [i for i in self._membership.ids if i not in self._dead]

    def _originate_locked(self) -> None:
        self._token_round += 1
        msg = {"t": "rec", "base": self._membership.epoch, "dead": sorted(self._dead),
               "origin": self.me.id, "round": self._token_round}
        self._ctrl(lambda: self._send_ring_next(msg))

    def _send_ring_next(self, msg: dict) -> None:
        """Control thread: send ``msg`` to my successor in the current view, bridging over
        members that cannot be reached (they are suspected in turn)."""
        while True:
            with self._cv:
                view = self._view_locked()
                if self.me.id not in view or msg.get("base") != self._membership.epoch:
                    return
                succ = self._neighbours(view)[1] or self.me.id
            if self._send_ctrl(succ, msg):
                return
            self._suspect(succ, "unreachable during repair")

    def _send_path(self, msg: dict) -> None:
        """Control thread: forward a restart along its path, skipping unreachable members."""
        path = msg["path"]
        start = path.index(self.me.id) + 1 if self.me.id in path else 0
        for peer in path[start:]:
            if self._send_ctrl(peer, msg):
                return

    # ------------------------------------------------------------------ control messages
    def _on_ctrl(self, peer: str, msg: dict) -> None:
        kind = msg.get("t")
        if kind in ("rec", "acc", "ex", "lv") and peer != self.me.id:
            with self._cv:
                member = peer in self._membership
            if not member:
                # repair traffic only comes from members; an authenticated outsider (or a member
                # already removed) cannot start, steer or end a repair: drop its connection
                raise ProtocolError(f"{kind!r} message from {peer}, not a member at epoch {self._membership.epoch}")
        try:
            if kind in ("rec", "acc"):  # validate every field before any state changes
                msg = {"t": kind, "base": int(msg["base"]), "dead": [str(d) for d in msg["dead"]],
                       "origin": str(msg["origin"]), **({"round": int(msg["round"])} if kind == "rec" else {})}
            if kind == "rec":
                self._on_reconcile(peer, msg)
            elif kind == "acc":
                self._on_accept_msg(peer, msg)
            elif kind == "rst":
                self._on_restart(peer, msg)
            elif kind == "join":
                self._on_join(peer, msg)
            elif kind == "lv":
                self._suspect(peer, "left the ring")
            elif kind == "ex":
                int(msg["base"])
                with self._cv:
                    # an accusation from a peer we already accused is the mirror image of ours:
                    # the epoch CAS decides between us, not whichever notice arrived first
                    if peer in self._dead:
                        return
                    if int(msg["base"]) == self._membership.epoch and self._state in (RUNNING, REPAIRING):
                        self._fence_locked(f"excluded by {peer} at epoch {msg['base']}: {msg.get('reason')}")
            else:
                log.warning("ignoring unknown control message %r from %s", kind, peer)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed {kind!r} message from {peer}: {exc}") from exc

    def _base_ok_locked(self, base: int) -> bool:
        """True if a repair message for ``base`` concerns the current epoch. A newer base means we
        missed a restart: catch up from the store and let the sender's retry reach us."""
        if base > self._membership.epoch:
            self._ctrl(self._sync_from_store)
        return base == self._membership.epoch

    def _on_reconcile(self, peer: str, msg: dict) -> None:
        with self._cv:
            if self._state not in (RUNNING, REPAIRING) or not self._base_ok_locked(int(msg["base"])):
                return
            origin, rnd = msg["origin"], msg["round"]
            if origin not in self._membership or origin in self._dead:
                return  # a dead (or unknown) origin's token must not spread its view any further
            incoming = set(msg["dead"]) & set(self._membership.ids)
            if self.me.id in incoming:
                self._fence_locked(f"peers declared {self.me.id} dead at epoch {self._membership.epoch}")
                return
            self._begin_repair_locked(f"reconcile from {peer}")
            new = incoming - self._dead
            self._dead |= incoming
            if origin == self.me.id:
                if rnd != self._token_round:
                    return  # superseded by a newer token of mine
                if set(msg["dead"]) == self._dead:
                    self._accepting = frozenset(self._dead)
                    acc = {"t": "acc", "base": self._membership.epoch, "dead": sorted(self._dead),
                           "origin": self.me.id}
                    self._ctrl(lambda: self._send_ring_next(acc))
                else:
                    self._originate_locked()
            else:
                fwd = dict(msg, dead=sorted(self._dead))
                self._ctrl(lambda: self._send_ring_next(fwd))
        for p in new:
            self._close_links_to(p)

    def _on_accept_msg(self, peer: str, msg: dict) -> None:
        with self._cv:
            if self._state not in (RUNNING, REPAIRING) or not self._base_ok_locked(int(msg["base"])):
                return
            acc_dead = set(msg["dead"])
            origin = msg["origin"]
            if origin not in self._membership or origin in self._dead:
                return
            if self.me.id in acc_dead:
                self._fence_locked(f"peers accepted a membership without {self.me.id}")
                return
            self._begin_repair_locked(f"accept from {peer}")
            if origin == self.me.id:
                if self._accepting == frozenset(acc_dead) == frozenset(self._dead):
                    base = self._membership.epoch
                    self._ctrl(lambda: self._commit(base, frozenset(acc_dead)))
                return
            if not self._dead <= acc_dead:
                return  # we know more: our own token carries the larger dead set
            new = acc_dead - self._dead
            self._dead |= acc_dead
            self._ctrl(lambda: self._send_ring_next(msg))
        for p in new:
            self._close_links_to(p)

    def _commit(self, base: int, dead: frozenset[str]) -> None:
        """Control thread: the fencing CAS for epoch base+1, then restart along the view."""
        with self._cv:
            if self._state != REPAIRING or self._membership.epoch != base or frozenset(self._dead) != dead:
                return
            view = self._view_locked()
            old_size = self._membership.size
            proposal = self._membership.without(set(dead), epoch=base + 1)
        if old_size > 2 and 2 * len(view) <= old_size:
            # We kept at most half the ring: we may be the cut-off side of a partition rather than
            # the survivors of many revocations. Give a larger side a head start at the CAS.
            time.sleep(2 * self.timeouts.heartbeat_timeout.total_seconds())
            with self._cv:
                if self._state != REPAIRING or self._membership.epoch != base:
                    return
        deadline = self._repair_t0 + self.timeouts.repair.total_seconds()
        while True:
            with self._cv:
                if self._state != REPAIRING:
                    return  # closed (or fenced) while waiting: commit nothing
            try:
                won, current = self.store.cas_membership(base, proposal)
                break
            except BackendConnectionError as exc:
                if time.monotonic() > deadline:
                    self._broken(f"store unreachable for the epoch {base + 1} commit: {exc}")
                    return
                log.warning("epoch %d commit at %s waits for the store: %s", base + 1, self.me.id, exc)
                time.sleep(0.2)
        if current is None:
            return
        i = view.index(self.me.id)
        path = view[i + 1:] + view[:i]
        log.info("%s %s epoch %d (%d members)", self.me.id, "committed" if won else "lost the CAS for",
                 current.epoch, current.size)
        # forward before installing: on every link the restart then precedes new-epoch data
        self._send_path({"t": "rst", "m": current.to_json(), "path": path, "origin": self.me.id})
        with self._cv:
            self._adopt_locked(current, "repair")

    def _on_restart(self, peer: str, msg: dict) -> None:
        m = Membership.from_json(msg["m"])
        for member in m.members:  # joiners' addresses are needed to forward before installing
            self._known.setdefault(member.id, member)
        # forward first (see _commit); a connect here blocks only this reader, bounded
        self._send_path(msg)
        with self._cv:
            self._adopt_locked(m, "join" if self.me.id not in self._membership else "repair")

    def _on_join(self, peer: str, msg: dict) -> None:
        member = Member.from_dict(msg["member"])
        with self._cv:
            if self._state not in (RUNNING, REPAIRING):
                return
            self._known[member.id] = member
            leader = self._membership.members[0].id
            if leader == self.me.id:
                if member.id not in self._membership:
                    self._pending_join[member.id] = member
                return
        self._ctrl(lambda: self._send_ctrl(leader, msg))

    # ------------------------------------------------------------------ install / fence
    def _adopt_locked(self, m: Membership, kind: str) -> None:
        if m.epoch <= self._membership.epoch or self._state in (CLOSED, LEAVING, FENCED):
            return
        if self.me.id in m:
            self._install_locked(m, kind)
        else:
            self._fence_locked(f"epoch {m.epoch} was committed without {self.me.id}", m)

    def _install_locked(self, m: Membership, kind: str) -> None:
        old = self._membership
        was_repairing = self._state == REPAIRING
        carry = self._dead & set(m.ids)
        for member in m.members:
            self._known[member.id] = member
        self._membership = m
        self._state = RUNNING
        self._seq = 0
        self._p2p_seq.clear()
        for op in list(self._ops.values()):
            op.fail(_Interrupted(f"epoch {m.epoch} installed"))
        for pid in list(self._pending_join):
            if pid in m:
                del self._pending_join[pid]
        now = time.monotonic()
        for pid in m.ids:
            self._last_seen[pid] = now
        if kind != "bootstrap":  # label by what changed, whoever initiated it
            kind = "repair" if any(i not in m for i in old.ids) else "join"
        event = MembershipEvent(
            kind=kind, member=self.me.id, old_epoch=old.epoch, new_epoch=m.epoch, members=list(m.ids),
            removed=[i for i in old.ids if i not in m], added=[i for i in m.ids if i not in old] if old.size else [],
            latency_ms=round(1000 * (now - self._repair_t0), 2) if was_repairing else 0.0,
            messages=self._repair_msgs if was_repairing else 0, detections=list(self._detections))
        self._dead = set()
        self._accepting = None
        self._detections = []
        self.events.append(event)
        event.log()
        self._cv.notify_all()
        for cb in list(self.listeners):
            cb(event)
        self._ctrl(self._update_join_watch)
        gone = [i for i in old.ids if i not in m]
        if gone:
            self._ctrl(lambda: [self._close_links_to(p) for p in gone])
        for p in carry:  # still dead in the new epoch: repair again at once
            self._ctrl(lambda p=p: self._suspect(p, "dead before epoch change"))

    def _fence_locked(self, reason: str, m: Membership | None = None) -> None:
        if self._state in (FENCED, CLOSED, LEAVING):
            return
        self._error = EpochFencedError(f"{self.me.id} fenced out: {reason}", m.epoch if m else -1,
                                       m.ids if m else ())
        self._state = FENCED
        for op in list(self._ops.values()):
            op.fail(self._error)
        ev = MembershipEvent(kind="fenced", member=self.me.id, old_epoch=self._membership.epoch,
                             new_epoch=m.epoch if m else -1, members=list(m.ids) if m else [])
        self.events.append(ev)
        ev.log()
        log.warning("%s", self._error)
        self._cv.notify_all()

    def _broken(self, reason: str) -> None:
        with self._cv:
            if self._state in (CLOSED, FENCED):
                return
            self._error = RingBrokenError(f"{self.me.id} at epoch {self._membership.epoch}: {reason}")
            self._state = FENCED
            for op in list(self._ops.values()):
                op.fail(self._error)
            self._cv.notify_all()

    def _repair_stalled(self) -> bool:
        now = time.monotonic()
        if now - self._repair_t0 > self.timeouts.repair.total_seconds():
            self._ctrl(lambda: self._broken(
                f"repair did not finish within {self.timeouts.repair.total_seconds():.0f} s "
                f"(dead: {sorted(self._dead)})"))
            return False
        return now - self._repair_progress > max(1.0, 4 * self.timeouts.heartbeat_timeout.total_seconds())

    def _sync_from_store(self) -> None:
        """Control thread: install a newer membership from the store (a restart we missed)."""
        try:
            m = self.store.get_membership()
        except BackendConnectionError as exc:
            log.warning("%s cannot read the store while repairing: %s", self.me.id, exc)
            return
        with self._cv:
            self._repair_progress = time.monotonic()
            if m is not None:
                self._adopt_locked(m, "repair")

    # ------------------------------------------------------------------ joins
    def _update_join_watch(self) -> None:
        """Control thread: the leader watches the store for new registrations (where the store can
        watch); any other member does not."""
        with self._cv:
            leader = self._state == RUNNING and self._membership.size and self._membership.members[0].id == self.me.id
            cancel = self._join_watch
        if leader and cancel is None:
            try:
                self._join_watch = self.store.watch_registrations(self._on_registration) or (lambda: None)
            except BackendConnectionError as exc:
                log.warning("%s cannot watch the store for joiners (they can still ask directly): %s",
                            self.me.id, exc)
        elif not leader and cancel is not None:
            self._join_watch = None
            cancel()

    def _on_registration(self, member: Member) -> None:
        """Store thread: a worker registered; the leader admits it at the next admit()."""
        with self._cv:
            if self._state not in (RUNNING, REPAIRING) or member.id in self._membership:
                return
            if self._membership.members[0].id != self.me.id:
                return
            self._known[member.id] = member
            self._pending_join[member.id] = member
        log.info("%s saw %s register; admitting it at the next admit()", self.me.id, member.id)

    def admit(self) -> list[Member]:
        """Admit registered joiners at a step boundary. Every member must call it, in the same
        order relative to collectives. Returns the members added (empty in the common case, which
        costs one 8-byte all-reduce). Raises MembershipChanged if a repair intervened.
        Blocks until the joiners are installed (bounded by the repair timeout)."""
        with self._cv:
            old = self._membership
            leader = old.members[0].id == self.me.id
            pending = [m for m in self._pending_join.values() if m.id not in old] if leader else []
        flag = torch.tensor([len(pending)], dtype=torch.int64)
        self.all_reduce(flag, "max")
        if int(flag.item()) == 0:
            return []
        if leader:
            self._admit_as_leader(old, pending)
        with self._cv:
            deadline = time.monotonic() + self.timeouts.repair.total_seconds()
            while self._membership.epoch == old.epoch and self._state in (RUNNING, REPAIRING):
                if time.monotonic() > deadline:
                    raise MembershipTimeoutError(
                        f"admit at {self.me.id}: epoch {old.epoch + 1} with joiners was not installed "
                        f"within {self.timeouts.repair.total_seconds():.0f} s (leader {old.members[0].id})")
                self._cv.wait(0.1)
            if self._state not in (RUNNING, REPAIRING):
                raise self._error or RingBrokenError(f"ring is {self._state}")
            self._wait_not_repairing_locked(old.epoch, "admit")
            new = self._membership
            self._observed = new.epoch  # the caller learns of the admission from our return value
        if any(i not in new for i in old.ids):
            raise MembershipChanged(old.epoch, new.epoch, "members were lost while admitting joiners")
        return [m for m in new.members if m.id not in old]

    def _admit_as_leader(self, old: Membership, pending: list[Member]) -> None:
        proposal = old.with_members(pending, epoch=old.epoch + 1)
        deadline = time.monotonic() + self.timeouts.repair.total_seconds()
        while True:
            try:
                won, current = self.store.cas_membership(old.epoch, proposal)
                break
            except BackendConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        with self._cv:
            self._repair_t0 = time.monotonic()
            self._repair_msgs = 0
        if current is not None:
            ids = list(current.ids)
            i = ids.index(self.me.id) if self.me.id in ids else 0
            self._send_path({"t": "rst", "m": current.to_json(), "path": ids[i + 1:] + ids[:i],
                             "origin": self.me.id})
            with self._cv:
                self._adopt_locked(current, "join")
