"""Synchronisation modes of :class:`~spotnik_lightning.lightning.strategy.SpotnikStrategy` (a mixin).

* ``"ssgd"`` (default): gradients all-reduced during backward, replicas bit-identical.
* ``"sma"``: local steps; every ``sma_period`` committed steps the models are averaged
  (:mod:`spotnik_lightning.sync.sma`).
* ``"adpsgd"``: local steps; after each, the member publishes its model in its served cache and
  averages with the latest published model of a random live peer, fetched without involving the
  peer's training thread (:mod:`spotnik_lightning.sync.adpsgd`).

In every mode the commit vote still runs (48 bytes): it keeps committed step counts, leavers,
joiners, switch requests and the "dirty" flags agreed. A member's ring operations per step are,
in this order: [resync] [admission] gradient all-reduce (ssgd only) · vote · mode's averaging ·
switch averaging · replica check. The averaging steps run only when the vote and the agreed mode
say so, so every member issues the same sequence. A membership change observed in one of the
post-commit operations skips the rest of them and makes the next operation the resync — which is
also where the other members go after observing the change in their own next collective. After a
vote with leavers (SIGTERM) no averaging runs in that step: the leavers depart at once and the
others observe the departure in the barrier that follows, as in S-SGD. AD-PSGD's averaging is a
fetch, not a collective: a failed fetch is skipped and reports nothing, so a change behind it is
observed by the member's next collective (the next vote, or the switch averaging).

Switching: :meth:`request_sync` puts a request in this member's next votes; when a vote completes,
the lowest rank's request is the agreed one and every member switches after applying that step.
Switching to ``ssgd`` from a model-averaging mode (or any step in ``ssgd`` while some member's
vote says "dirty") first averages parameters, floating buffers *and* floating optimizer state
(momentum buffers, Adam moments) over all members with one all-reduce per dtype, so replicas are
bit-identical again (members lacking some parameter's optimizer state first get fresh, zeroed state
of the others' layout: :func:`~spotnik_lightning.sync.complete_optimizer_state`). If that
averaging is interrupted, the members still dirty say so in the next
vote and the averaging reruns after the next step. Model-averaging modes keep optimizer state local.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from spotnik_lightning.api import ConfigError, MembershipChanged
from spotnik_lightning.lightning.commit import Vote
from spotnik_lightning.sync import ADPSGD, MODES, SMA, average_all, complete_optimizer_state

log = logging.getLogger("spotnik.lightning")

CODES = {name: i + 1 for i, name in enumerate(MODES)}
NAMES = {code: name for name, code in CODES.items()}


class SyncModes:
    """Mixin: needs ``ring``, ``_committer``, ``counters``, ``lightning_module``, ``optimizers``,
    ``_note_change`` and ``_resync``."""

    ring: Any
    _committer: Any
    lightning_module: Any
    optimizers: Any
    _manual: bool

    def _init_sync(self, sync: str, sma_period: int) -> None:
        if sync not in MODES:
            raise ConfigError(f"sync must be one of {MODES}, got {sync!r}")
        self._sync = sync
        self._step_sync = sync  # the mode the current step's update was computed in
        self._sync_request: str | None = None
        self._dirty = False  # this replica may differ from its peers'
        self._sma = SMA(sma_period)
        self._adpsgd = ADPSGD()
        self.sync_switches: list[dict] = []

    @property
    def sync_mode(self) -> str:
        """The synchronisation mode in effect (agreed by all members)."""
        return self._sync

    @property
    def sync_requested(self) -> str | None:
        """This member's pending request (None: none), cleared when a vote agrees on any request."""
        return self._sync_request

    def request_sync(self, name: str) -> None:
        """Ask for ``name`` (``"ssgd"``, ``"sma"``, ``"adpsgd"``) from the next agreed step boundary.
        Carried in this member's votes until a vote agrees on a request (any member's); asking for
        the mode in effect cancels a pending request. Raises ConfigError for an unknown name or a
        model-averaging mode under manual optimization."""
        if name not in MODES:
            raise ConfigError(f"sync must be one of {MODES}, got {name!r}")
        if name != "ssgd" and getattr(self, "_manual", False):
            raise ConfigError("model-averaging modes need automatic optimization")
        self._sync_request = None if name == self._sync else name

    def _request_code(self) -> int:
        return CODES[self._sync_request] if self._sync_request else 0

    def _model_tensors(self) -> list[torch.Tensor]:
        module = self.lightning_module
        return [p.data for p in module.parameters()] + [b for b in module.buffers() if b.is_floating_point()]

    def _state_tensors(self) -> list[torch.Tensor]:
        """Model tensors plus every floating optimizer-state tensor, in parameter order."""
        out = self._model_tensors()
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    st = opt.state.get(p, {})
                    out += [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor) and st[k].is_floating_point()]
        return out

    def _set_sync(self, name: str, reason: str, replica_differs: bool = True) -> None:
        if name == self._sync:
            return
        ring, committer = self.ring, self._committer
        entry = {"member": ring.member_id if ring else None, "step": committer.committed if committer else 0,
                 "from": self._sync, "to": name, "reason": reason, "epoch": ring.epoch if ring else 0,
                 "world": ring.size if ring else 0}
        if name == "ssgd" and replica_differs:
            self._dirty = True  # identical again only after the switch averaging
        self._sync = name
        if self._sync_request == name:
            self._sync_request = None
        self.sync_switches.append(entry)
        log.info("spotnik_sync_switch %s", json.dumps(entry, sort_keys=True))

    def _post_step(self, vote: Vote, collectives: bool) -> str | None:
        """After applying a step: the mode's averaging, an agreed switch and the switch averaging.
        ``collectives=False`` (a step applied locally during a resync): no ring operation at all.
        Returns what a replica check may compare now: ``"full"`` (parameters and optimizer state
        identical on all members), ``"params"`` (just after an SMA averaging) or None."""
        ran, step = self._step_sync, self._committer.committed
        if ran != "ssgd":
            self._dirty = True
        if vote.request:  # before any ring operation: a resync met in one reports the agreed new mode
            self._sync_request = None
            self._set_sync(NAMES[vote.request], "vote")
        check: str | None = "full" if ran == "ssgd" and not vote.dirty else None
        ok = collectives
        # Leavers depart right after this commit and the others observe that in the departure
        # barrier: no averaging now (a pairwise exchange would race with the departure).
        average = ok and not vote.leaving
        if average and ran != "ssgd":
            try:
                if ran == "sma":
                    if self._sma.after_step(self.ring, self._model_tensors(), step):
                        check = "params"
                else:  # a failed fetch is skipped; a change behind it is met by the next collective
                    self._adpsgd.after_step(self.ring, self._model_tensors(), step)
            except MembershipChanged as exc:
                ok = average = self._observed_in_post_step(exc)
        if self._sync == "ssgd" and (vote.dirty or ran != "ssgd"):
            check = None
            if average:
                try:
                    complete_optimizer_state(self.ring, self.optimizers)  # e.g. a joiner that never stepped
                    average_all(self.ring, self._state_tensors())
                    self._dirty = False
                    check = "full"
                except MembershipChanged as exc:
                    ok = self._observed_in_post_step(exc)
        return check if ok else None

    def _observed_in_post_step(self, exc: MembershipChanged) -> bool:
        """A change met during post-step averaging: skip the rest and resync at once (every member
        meets the change once, in whatever operation it is in, and resyncs there)."""
        self._note_change(exc)  # type: ignore[attr-defined]
        self._resync(voted=False, joiner=False)  # type: ignore[attr-defined]
        return False

    def _sync_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the synchronisation: the agreed mode and the SMA period (the
        SMA phase is the committed step count, which the checkpoint keeps anyway)."""
        return {"sync": self._sync, "sma_period": self._sma.period}

    def _load_sync_state(self, state: dict[str, Any]) -> None:
        """Resume in the checkpoint's mode and SMA period (every member loads the same checkpoint,
        so they agree; its replica is rank 0's, so the members are identical again: not dirty).
        A checkpoint without them (older) keeps the configured mode. Raises ConfigError for a
        model-averaging mode under manual optimization."""
        name = state.get("sync")
        if name is None:
            return
        if name not in MODES:
            raise ConfigError(f"checkpoint holds an unknown sync mode {name!r}")
        if name != "ssgd" and getattr(self, "_manual", False):
            raise ConfigError(f"the checkpoint was saved in sync={name!r}, which needs automatic optimization")
        period = int(state.get("sma_period", self._sma.period))
        if period != self._sma.period:
            log.info("resuming with the checkpoint's SMA period %d (configured: %d)", period, self._sma.period)
            self._sma = SMA(period)
        self._dirty = False
        self._set_sync(name, "checkpoint", replica_differs=False)

    def _agree_sync(self, code: int, joiner: bool = False) -> None:
        """Adopt the mode a resync agreed on (a member that missed a switching vote catches up; a
        joiner learns the mode; its replica is the donor's, with the donor's ``dirty`` flag)."""
        if code in NAMES:
            self._set_sync(NAMES[code], "join" if joiner else "resync", replica_differs=not joiner)
