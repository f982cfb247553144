"""Membership changes for :class:`~spotnik_lightning.lightning.strategy.SpotnikStrategy` (a mixin):
recovering a discarded step through a resync, giving state to and taking it from peers, and the
noticed leave (SIGTERM) on both sides.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from spotnik_lightning.api import MembershipChanged, SpotnikError
from spotnik_lightning.lightning import transfer
from spotnik_lightning.lightning.commit import ReplicaDivergenceError, Resync, StepDiscarded
from spotnik_lightning.lightning.syncing import CODES
from spotnik_lightning.sync.primitives import load_snapshot

log = logging.getLogger("spotnik.lightning")


class MembershipHandling:
    """Mixin: needs the strategy's ring, committer, loader, counters and Lightning attributes."""

    ring: Any
    counters: Any
    lr_scaling: bool
    optimizers: Any
    lightning_module: Any
    _committer: Any
    _loader: Any
    _reducer: Any
    _manual: bool
    _joiner: bool
    _left: bool
    _adopted: Any
    _provisional: tuple[int, int]
    _coll_done: int
    _coll_last: Any
    _world_seen: int
    _faults: Any
    _admit_next: bool
    _prefetched: tuple[int, torch.Tensor] | None
    _sync: str
    _dirty: bool
    world_size: int

    def _recover(self, d: StepDiscarded) -> Resync:
        if not isinstance(d.error, MembershipChanged):
            raise d.error
        self._note_change(d.error)
        return self._resync(voted=d.voted, joiner=False, t0=time.monotonic())

    def _note_change(self, exc: MembershipChanged) -> None:
        self.counters.changes += 1
        log.info("step %d discarded at %s: %s", self._committer.committed if self._committer else -1,
                 self.ring.member_id if self.ring else "?", exc)

    def _resync(self, *, voted: bool, joiner: bool, t0: float | None = None) -> Resync:
        assert self._committer is not None and self.ring is not None
        t0 = t0 or time.monotonic()
        res = self._committer.resync(voted=voted and not self._manual, joiner=joiner, capture=self._capture,
                                     adopt=self._adopt, timeout_s=self.ring.timeouts.repair.total_seconds(),
                                     behind_may_adopt=self._manual,
                                     before_send=lambda: self._faults.at("state_send", self._committer.committed),
                                     coll_done=self._coll_done, coll_last=lambda: self._coll_last,
                                     mode=CODES[self._sync], have_model=self._prefetched[0] if joiner and
                                     self._prefetched else -1, light_mode=CODES["adpsgd"])
        self._agree_sync(res.mode, joiner)
        self._admit_next = False  # a vote's joiner flag is not known to all after a change: asked again
        self.counters.last_recovery_ms = (time.monotonic() - t0) * 1e3
        entry = {"member": self.ring.member_id, "epoch": res.epoch, "rank": self.ring.rank, "world": self.ring.size,
                 "committed": self._committer.committed, "outcome": res.outcome, "donor": res.donor,
                 "receivers": res.receivers, "bytes": res.nbytes, "resync_ms": round(res.ms, 2),
                 "recovery_ms": round(self.counters.last_recovery_ms, 2),
                 **{f"{k}_ms": v for k, v in res.phases.items()}}
        self.counters.resyncs.append(entry)
        log.info("spotnik_resync %s", json.dumps(entry, sort_keys=True))
        self._set_rank_zero()
        self._note_world()
        return res

    def _note_world(self) -> None:
        """Called where all members agree on the membership: apply the linear LR scaling rule
        (``lr_scaling``) for the change of world size since the last agreement."""
        n = self.ring.size
        if self.lr_scaling and self._world_seen and n != self._world_seen:
            for opt in self.optimizers:
                for g in opt.param_groups:
                    g["lr"] = g["lr"] * n / self._world_seen
        self._world_seen = n

    def _capture(self, light: bool = False) -> list[torch.Tensor]:
        assert self._loader is not None and self._committer is not None
        return transfer.capture(self.lightning_module.trainer, light=light, extra={
            "committed": self._committer.committed,
            "cursor": self._loader.cursor.state_dict(),
            "world_seen": self._world_seen,
            "coll_done": self._coll_done,
            "dirty": self._dirty,
        })

    def _adopt(self, ckpt: dict[str, Any]) -> None:
        if not self._joiner:
            if not self._manual:
                raise ReplicaDivergenceError("a member that was not joining was sent state: it fell behind further "
                                             "than one step, which the commit vote rules out")
            # manual optimization: a peer finished the training_step this member rolled back
            transfer.apply_training_state(self.lightning_module.trainer, ckpt, loops=False)
            return
        transfer.apply_training_state(self.lightning_module.trainer, ckpt, loops=True)
        if ckpt["spotnik"].get("light"):  # no model sent: the snapshot prefetched before joining
            assert self._prefetched is not None
            load_snapshot(self._model_tensors(), self._prefetched[1])  # type: ignore[attr-defined]
            log.info("%s starts from the model snapshot of step %d it prefetched (committed: %d)",
                     self.ring.member_id, self._prefetched[0], int(ckpt["spotnik"]["committed"]))
        self._prefetched = None
        self._adopted = ckpt["spotnik"]
        self._world_seen = int(ckpt["spotnik"]["world_seen"])  # the donor's learning rates are for its world
        self._coll_done = int(ckpt["spotnik"]["coll_done"])  # its Lightning collectives count from here on
        self._dirty = bool(ckpt["spotnik"].get("dirty", False))  # a copy of the donor: as (un)like the rest
        self._joiner = False

    def _on_membership_event(self, event: Any) -> None:
        log.info("spotnik_membership %s", json.dumps({"kind": event.kind, "epoch": event.new_epoch,
                                                      "members": list(event.members),
                                                      "latency_ms": event.latency_ms}, sort_keys=True))

    # ------------------------------------------------------------------ leaving
    def _leave(self) -> None:
        """Leave after the step this member voted to leave in; Lightning then exits (SIGTERMException)."""
        assert self.ring is not None
        log.info("%s leaves the ring after step %d", self.ring.member_id, self._committer.committed)
        self._provisional = (self.ring.rank, 1)
        if self._reducer is not None:
            self._reducer.close()
        self.ring.leave()
        self._left = True
        self.counters.leaves += 1
        trainer = self.lightning_module.trainer
        trainer._signal_connector.received_sigterm = True

    def _departure_barrier(self, leaving: list[str]) -> None:
        """Everybody, leavers included, after a vote with leavers (unless the replica check already
        was such a collective): a leaver's barrier completes only once every member entered it, i.e.
        completed the vote, so no leaver leaves while a survivor may still need its last pieces of
        the vote. A survivor that meets the departure here observes it (see :meth:`_saw_departure`)."""
        try:
            self.ring.barrier()
        except MembershipChanged as exc:
            if self.ring.member_id not in leaving:
                self._saw_departure(leaving, exc)

    def _await_departure(self, leaving: list[str]) -> None:
        """Survivors: observe the leavers' departure in a barrier (they never enter it), so the
        next step starts on the new membership and nothing is retried."""
        assert self.ring is not None
        deadline = time.monotonic() + self.ring.timeouts.repair.total_seconds()
        while any(i in self.ring.membership for i in leaving):
            if time.monotonic() > deadline:
                raise SpotnikError(f"members {leaving} voted to leave but are still in epoch {self.ring.epoch}")
            try:
                self.ring.barrier()
            except MembershipChanged as exc:
                self._saw_departure(leaving, exc)
        self._set_rank_zero()
        self._note_world()

    def _saw_departure(self, leaving: list[str], exc: MembershipChanged) -> None:
        """A survivor met the leavers' departure: count it and resync at once, like for any change
        (every survivor meets it once, in whichever operation it is in, so all resync)."""
        self.counters.changes += 1
        self.counters.leaves += len(leaving)
        log.info("%s saw %s leave: %s", self.ring.member_id, leaving, exc)
        self._resync(voted=False, joiner=False)
