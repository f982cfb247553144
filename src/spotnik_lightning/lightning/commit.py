"""The step-commit protocol on the ring: the commit vote and the resync after a membership change.

A step's gradients are all-reduced (``sync.reducer``); then every member *votes* (one all-gather
of six integers: present, committed step count, leaving, joiners waiting, requested sync mode,
replica possibly differing from its peers ("dirty", model-averaging modes)). A member applies the
step only after its vote completed, so an applied step implies that every member of that epoch
had its fully reduced gradients. If the ring changes during the step, the member discards the step
and calls :meth:`StepCommitter.resync` — its first collective on the new membership, since the ring
reports each change to each member exactly once. Resync all-gathers ``(committed, voted, reliable,
joiner, sync mode, collectives done, version of a model snapshot a joiner prefetched)``; then

* if some members completed one more of Lightning's own collectives (outside steps) than others,
  the result is served to those that had not (:meth:`StepCommitter._serve`);

* a member exactly one step behind that had voted applies its pending step locally (the vote
  completed somewhere, so its gradients are the step's reduced gradients: the result is
  bit-identical to the members that applied it, and nothing is sent);
* a member further behind, or a joiner, receives the donor's full state (an up-to-date member,
  reliable tier first, lowest rank) point-to-point over the ring — in AD-PSGD, a joiner that
  prefetched a recent model snapshot from a member's served cache before it registered gets the
  state *without* model and optimizer state (a few KB: it keeps its snapshot and starts with fresh
  local optimizer state), so the members barely wait for it;
* everybody else retries the discarded step on the new membership.

If the ring changes again during the resync, the resync restarts (it is idempotent). The resync
also agrees on the synchronisation mode: the mode of the first member holding the latest committed
step (members that commit their pending step locally missed that step's vote, and so any switch
it agreed on).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from spotnik_lightning.api import MembershipChanged, MembershipTimeoutError, SpotnikError
from spotnik_lightning.lightning import packing
from spotnik_lightning.ring.group import RingGroup

log = logging.getLogger("spotnik.lightning")


class StepDiscarded(BaseException):
    """Raised inside the optimizer closure (or ``opt.step()`` in manual optimization): the step must
    not be applied. A BaseException, so user code's ``except Exception`` cannot swallow it."""

    def __init__(self, error: SpotnikError, voted: bool, loss: Any) -> None:
        super().__init__(str(error))
        self.error, self.voted, self.loss = error, voted, loss


@dataclass
class CommitInfo:
    """What :attr:`SpotnikStrategy.commit_listeners` receive after every committed step."""

    step: int
    epoch: int
    rank: int
    world: int
    members: list[str]
    plans: list[list[int]]
    indices: list[int]
    attempts: int
    replica_hash: str | None = None


@dataclass
class Counters:
    """What a member saw: membership changes, retried steps, joins, leaves, the last recovery time
    (discard to resume), the commit votes' durations (last, count, total of completed votes) and
    one entry per resync (the ``spotnik_resync`` log line's fields)."""

    changes: int = 0
    retried_steps: int = 0
    joins: int = 0
    leaves: int = 0
    last_recovery_ms: float = 0.0
    vote_ms: float = 0.0  # the last commit vote's duration (what the atomic commit adds to a step)
    votes: int = 0
    vote_ms_total: float = 0.0
    resyncs: list[dict] = field(default_factory=list)


class ReplicaDivergenceError(SpotnikError):
    """Replicas disagree on committed state (step count or, with ``verify_replicas``, a hash)."""


@dataclass
class Vote:
    world: int
    leaving: list[str] = field(default_factory=list)  # member ids that leave after this step
    joiners: int = 0
    request: int = 0  # agreed sync-mode request (code, 0: none): the lowest rank's non-zero request
    dirty: bool = False  # some member's replica may differ from the others' (model-averaging modes)
    leaving_ranks: list[int] = field(default_factory=list)


@dataclass
class Resync:
    outcome: str  # "retry" (discard and recompute), "commit" (apply the pending step), "adopted" (state received)
    donor: int | None
    receivers: int
    nbytes: int
    ms: float
    epoch: int
    phases: dict[str, float] = field(default_factory=dict)  # state transfer: milliseconds per phase
    mode: int = 0  # the agreed sync-mode code (that of the first member holding the latest step)
    served: torch.Tensor | None = None  # the interrupted Lightning collective's result, from a peer


class StepCommitter:
    """Vote and resync for one member. ``committed`` counts the steps this member applied."""

    def __init__(self, ring: RingGroup, committed: int = 0) -> None:
        self.ring = ring
        self.committed = committed

    def vote(self, leaving: bool, request: int = 0, dirty: bool = False) -> Vote:
        """All-gather this member's vote. Raises MembershipChanged when the ring changed (the
        step must not be applied yet: see :meth:`resync`) and ReplicaDivergenceError when members
        disagree on the committed step count. ``request``: a sync-mode code this member asks for
        (0: none); the lowest rank's non-zero request is the agreed one. ``dirty``: this member's
        replica may differ from its peers'."""
        ring = self.ring
        n, ids = ring.size, list(ring.membership.ids)
        info = torch.tensor([1, self.committed, int(leaving), ring.joiners_waiting, request, int(dirty)],
                            dtype=torch.int64)
        out = torch.empty(n * 6, dtype=torch.int64)
        ring.all_gather(out, info)
        rows = out.view(n, 6)
        if bool((rows[:, 1] != self.committed).any()):
            raise ReplicaDivergenceError(
                f"committed step counts differ at epoch {ring.epoch}: "
                f"{dict(zip(ids, rows[:, 1].tolist(), strict=True))}")
        requests = [int(r) for r in rows[:, 4].tolist() if r]
        return Vote(n, [ids[r] for r in range(n) if rows[r, 2]], int(rows[:, 3].sum()),
                    requests[0] if requests else 0, bool(rows[:, 5].any()),
                    [r for r in range(n) if rows[r, 2]])

    def resync(self, *, voted: bool, joiner: bool, capture: Callable[..., list[torch.Tensor]],
               adopt: Callable[[Any], None], timeout_s: float, behind_may_adopt: bool = False,
               before_send: Callable[[], None] | None = None, coll_done: int = 0,
               coll_last: Callable[[], torch.Tensor] | None = None, mode: int = 0,
               have_model: int = -1, light_mode: int = 0, light_lag: int = 20) -> Resync:
        """Agree on committed state after a membership change (see the module doc). ``voted``:
        this member voted in the step it is discarding; ``joiner``: it has no state yet.
        ``capture()`` (donor) packs the state (:func:`packing.pack`), ``adopt(state)`` (receiver)
        loads the unpacked state.
        ``before_send`` (tests) runs on the donor between capture and send. ``coll_done`` counts
        the member's completed collectives outside steps (Lightning's); a member one behind gets
        the last one's result (``coll_last()`` of a member that completed it) in ``served``.
        ``behind_may_adopt``: members behind receive state too (manual optimization, where a
        discarded step was rolled back and cannot be applied locally); otherwise only joiners do.
        ``mode``: this member's sync-mode code (the result's ``mode`` is the agreed one).
        ``have_model`` (joiners): the version of a model snapshot it already holds (-1: none). When
        the agreed mode is ``light_mode`` (non-zero) and that version is at least ``top − light_lag``,
        the donor sends it ``capture(light=True)`` — the state without the model and optimizer state.
        Blocks until done; raises MembershipTimeoutError after ``timeout_s`` of repeated changes."""
        t0 = time.monotonic()
        while True:
            try:
                return self._resync_once(voted, joiner, capture, adopt, t0, behind_may_adopt, before_send,
                                         coll_done, coll_last, mode, (have_model, light_mode, light_lag))
            except MembershipChanged as exc:
                if time.monotonic() - t0 > timeout_s:
                    raise MembershipTimeoutError(
                        f"resync of {self.ring.member_id} did not settle within {timeout_s:.0f} s "
                        f"(last change epoch {exc.old_epoch} -> {exc.new_epoch})") from exc
                log.info("membership changed again during resync at %s: %s", self.ring.member_id, exc)

    def _resync_once(self, voted: bool, joiner: bool, capture: Callable[..., list[torch.Tensor]],
                     adopt: Callable[[Any], None], t0: float, behind_may_adopt: bool,
                     before_send: Callable[[], None] | None, coll_done: int,
                     coll_last: Callable[[], torch.Tensor] | None, mode: int,
                     light: tuple[int, int, int]) -> Resync:
        ring = self.ring
        n, me = ring.size, ring.rank
        reliable = int(ring.me.tier == "reliable")
        have_model, light_mode, light_lag = light
        info = torch.tensor([-1 if joiner else self.committed, int(voted), reliable, int(joiner), mode,
                             -1 if joiner else coll_done, have_model if joiner else -1], dtype=torch.int64)
        out = torch.empty(n * 7, dtype=torch.int64)
        ring.all_gather(out, info)
        rows = out.view(n, 7).tolist()
        served = self._serve(rows, coll_last)
        top = max(r[0] for r in rows)
        if top < 0:
            raise ReplicaDivergenceError(f"no member of epoch {ring.epoch} holds any state (all joiners)")

        def commits_locally(r: list[int]) -> bool:
            return r[0] == top - 1 and r[1] == 1 and r[3] == 0

        needy = [i for i, r in enumerate(rows) if r[0] < top and not commits_locally(r)]
        phases: dict[str, float] = {}
        stray = [i for i in needy if rows[i][3] == 0 and not behind_may_adopt]
        if stray:  # the vote rules this out; every member sees the same rows, so all stop here
            raise ReplicaDivergenceError(f"members {stray} of epoch {ring.epoch} are behind by more than a step "
                                         f"without a pending step: {rows}")
        donor = None
        nbytes = 0
        agreed = next(r[4] for r in rows if r[0] == top)

        def light_for(i: int) -> bool:  # a joiner holding a recent model snapshot, in the light mode
            return bool(light_mode) and agreed == light_mode and rows[i][3] == 1 and rows[i][6] >= top - light_lag

        if needy:
            donor = min((i for i, r in enumerate(rows) if r[0] == top), key=lambda i: (rows[i][2] == 0, i))
            tick = time.monotonic()

            def lap(name: str) -> None:
                nonlocal tick
                now = time.monotonic()
                phases[name] = round((now - tick) * 1e3, 2)
                tick = now

            if me == donor:
                captured = {kind: capture(light=True) if kind else capture()
                            for kind in sorted({light_for(r) for r in needy})}
                lap("capture")
                if before_send is not None:
                    before_send()
                for r in needy:
                    parts = captured[light_for(r)]
                    nbytes += sum(p.numel() * p.element_size() for p in parts)
                    ring.send(torch.tensor([parts[0].numel()], dtype=torch.int64), r)
                    for p in parts:
                        ring.send(p, r)
                lap("send")
            elif me in needy:
                size = torch.zeros(1, dtype=torch.int64)
                ring.recv(size, donor)
                lap("wait")
                skeleton = torch.empty(int(size.item()), dtype=torch.uint8)
                ring.recv(skeleton, donor)
                head, flats = packing.layout(skeleton)
                for f in flats:
                    ring.recv(f, donor)
                lap("receive")
                nbytes = skeleton.numel() + sum(f.numel() * f.element_size() for f in flats)
                adopt(packing.unpack(head, flats))
                lap("apply")
                self.committed = top
        if me in needy:
            outcome = "adopted"
        elif commits_locally(rows[me]):
            outcome = "commit"
        else:
            outcome = "retry"
        return Resync(outcome, donor, len(needy), nbytes, (time.monotonic() - t0) * 1e3, ring.epoch, phases, agreed,
                      served)

    def _serve(self, rows: list[list[int]], coll_last: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
        """If some members completed one more collective outside steps than others (a change hit
        its last hop), the lowest such member broadcasts that collective's result; returns it to
        the members that had not completed it (None to everyone else)."""
        ring, me = self.ring, self.ring.rank
        counts = [r[5] for r in rows if r[3] == 0]
        if not counts or max(counts) == min(counts):
            return None
        if max(counts) - min(counts) > 1:
            raise ReplicaDivergenceError(f"collective counts differ by more than one at epoch {ring.epoch}: {rows}")
        src = min(i for i, r in enumerate(rows) if r[3] == 0 and r[5] == max(counts))
        blob = coll_last() if me == src and coll_last is not None else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([blob.numel()], dtype=torch.int64)
        ring.broadcast(size, src)
        buf = blob if me == src else torch.empty(int(size.item()), dtype=torch.uint8)
        if buf.numel():
            ring.broadcast(buf, src)
        return buf if rows[me][3] == 0 and rows[me][5] == min(counts) else None
