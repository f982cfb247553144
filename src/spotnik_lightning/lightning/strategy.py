"""SpotnikStrategy: Lightning training that goes on, in place, when members die, leave or join.

Per training step (automatic optimization):

1. the batch is this member's slice of the step's :class:`StepPlan`, agreed at the step start
   (:class:`ElasticLoader`);
2. backward all-reduces gradient buckets on the ring as they fill (:class:`GradientReducer`);
3. the members vote (:class:`StepCommitter`); only then does the optimizer apply the step, so a
   step is applied by every member or by none;
4. if the ring changed anywhere in 2–3, the step is discarded (optimizer, schedulers, counters and
   cursor untouched), the members resync on the new membership and the *same* plan is recomputed,
   split by the new ranks.

Joiners are admitted at the start of a step and get the full state from a donor; ``SIGTERM`` makes a
member finish the current step, leave in the vote and exit 0 without anyone retrying anything.
Nothing here opens a socket: all communication goes through the member's :class:`RingGroup`.

The class is split over mixins, each small enough to read alone: :mod:`.changes` (resync, state
transfer, leaving), :mod:`.manual` (manual optimization), :mod:`.collectives` (Lightning's
collectives on the ring); the commit protocol itself is :mod:`.commit`.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero
from torch.utils.data import DataLoader

from spotnik_lightning._register import register_strategy
from spotnik_lightning.api import ConfigError, MembershipChanged, RingTimeouts
from spotnik_lightning.lightning.changes import MembershipHandling
from spotnik_lightning.lightning.collectives import RingCollectives
from spotnik_lightning.lightning.commit import (
    CommitInfo,
    Counters,
    ReplicaDivergenceError,
    StepCommitter,
    StepDiscarded,
    Vote,
)
from spotnik_lightning.lightning.faults import Faults
from spotnik_lightning.lightning.loader import ElasticLoader
from spotnik_lightning.lightning.manual import ManualSteps
from spotnik_lightning.lightning.metrics import SpotnikMetrics
from spotnik_lightning.lightning.settings import open_membership_store, resolve
from spotnik_lightning.lightning.syncing import SyncModes
from spotnik_lightning.lightning.verify import replica_hash
from spotnik_lightning.ring.backend.lifecycle import _close_ring, _track
from spotnik_lightning.ring.group import RingGroup
from spotnik_lightning.sync.primitives import MODEL, snapshot_bytes
from spotnik_lightning.sync.reducer import GradientReducer

log = logging.getLogger("spotnik.lightning")


class SpotnikStrategy(MembershipHandling, ManualSteps, RingCollectives, SyncModes, ParallelStrategy):
    """Data-parallel CPU training on a self-repairing ring (``Trainer(strategy="spotnik")``).

    Args (all optional; the environment set by the launcher fills the rest, see :mod:`.settings`):
        store: membership store URL (``etcd://h:p[,h:p]``, ``embedded://h:p``, ``h:p``).
        run_id, world_size (members that found the ring), member_id, host, tier
        (``transient``/``reliable``; reliable members are preferred donors), secret.
        heartbeat_ms, heartbeat_timeout_ms or timeouts: failure detection and bounds.
        batch_policy: ``"per_worker"`` (default: the DataLoader's batch size per member) or
            ``"global"`` (``global_batch`` samples per step whatever the world size).
        lr_scaling: scale every param group's learning rate by new_world/old_world on each
            membership change (linear scaling rule; with ``per_worker`` batches).
        seed: seed of the epoch permutations (default 0).
        bucket_mb: gradient bucket size (DDP's default 25).
        verify_replicas: after each commit, all-gather a hash of parameters + optimizer state and
            raise :class:`ReplicaDivergenceError` on any difference (costly; for tests).
        atomic: ``False`` applies each step as soon as its gradients are reduced, without the commit
            vote ("pipelined" commit, for comparison only: a member may then apply a step the others
            discard, so replicas can diverge after a failure).
        sync: ``"ssgd"`` (default), ``"sma"`` (local steps, models averaged every ``sma_period``
            steps) or ``"adpsgd"`` (local steps, pairwise averaging with a random peer); switch at
            run time with :meth:`request_sync` (see :mod:`.syncing` and docs/lightning.md).

    Raises ConfigError at setup without a distributed launch, on a non-CPU accelerator, with
    manual optimization, or with an unsupported training DataLoader; BackendConnectionError when
    the store cannot be reached.
    """

    strategy_name = "spotnik"

    def __init__(self, store: str | None = None, *, run_id: str | None = None, world_size: int | None = None,
                 member_id: str | None = None, host: str | None = None, tier: str | None = None,
                 secret: str | bytes | None = None, heartbeat_ms: int | None = None,
                 heartbeat_timeout_ms: int | None = None, timeouts: RingTimeouts | None = None,
                 batch_policy: str = "per_worker", global_batch: int | None = None, lr_scaling: bool = False,
                 seed: int = 0, bucket_mb: float = 25.0, verify_replicas: bool = False, atomic: bool = True,
                 sync: str = "ssgd", sma_period: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_sync(sync, sma_period)
        if batch_policy not in ("per_worker", "global"):
            raise ConfigError(f"batch_policy must be 'per_worker' or 'global', got {batch_policy!r}")
        if batch_policy == "global" and (global_batch is None or global_batch < 1):
            raise ConfigError("batch_policy='global' needs global_batch >= 1")
        self._args = dict(store=store, run_id=run_id, world_size=world_size, member_id=member_id, host=host,
                          tier=tier, heartbeat_ms=heartbeat_ms, heartbeat_timeout_ms=heartbeat_timeout_ms,
                          timeouts=timeouts)
        self._secret = secret
        self.batch_policy, self.global_batch, self.lr_scaling = batch_policy, global_batch, lr_scaling
        self.seed, self.bucket_mb, self.verify_replicas, self.atomic = seed, bucket_mb, verify_replicas, atomic
        self.ring: RingGroup | None = None
        self.counters = Counters()
        self.commit_listeners: list[Callable[[CommitInfo], None]] = []
        self._faults = Faults()
        self._cfg: Any = None
        self._store: Any = None
        self._joiner = False
        self._prefetched: tuple[int, torch.Tensor] | None = None  # a joiner's model snapshot, see setup
        self._provisional = (0, 1)
        self._committer: StepCommitter | None = None
        self._reducer: GradientReducer | None = None
        self._loader: ElasticLoader | None = None
        self._adopted: dict | None = None
        self._coll_done = 0  # Lightning-level collectives completed (see collectives.py)
        self._coll_last = torch.empty(0, dtype=torch.uint8)
        self._admit_next = False
        self._leave_requested = False
        self._left = False
        self._quiet = False
        self._manual = False
        self._skip_batch = False
        self._user_batch_start: Any = None
        self._vote: Vote | None = None
        self._world_seen = 0  # the world size the learning rates are scaled for (lr_scaling)
        self._ckpt_world = 0
        self._attempts = 0
        self._rebuilt: Any = None
        self._prev_sigterm: Any = None
        self._launcher = None

    # ------------------------------------------------------------------ identity
    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def global_rank(self) -> int:
        if self.ring is not None and not self._left:
            return self.ring.rank
        return self._provisional[0]

    @property
    def world_size(self) -> int:
        if self.ring is not None and not self._left:
            return self.ring.size
        return self._provisional[1]

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def is_global_zero(self) -> bool:
        return not self._left and self.global_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _view(self) -> tuple[int, int, int]:
        assert self.ring is not None
        return self.ring.epoch, self.ring.rank, self.ring.size

    def _set_rank_zero(self) -> None:
        rank_zero.rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        from lightning.fabric.utilities import rank_zero as fabric_rank_zero

        fabric_rank_zero.rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ setup
    def _configure_launcher(self) -> None:
        self._launcher = None  # members are started by an external launcher (torchrun, spotnik launch)

    def setup_environment(self) -> None:
        """Check the accelerator, connect to the store and found the ring (or, if it is already
        running, prepare to join it in :meth:`setup`, once this worker is ready to train)."""
        if not isinstance(self.accelerator, CPUAccelerator):
            raise ConfigError(f"SpotnikStrategy trains on CPU only; got accelerator {type(self.accelerator).__name__} "
                              "(use Trainer(accelerator='cpu'))")
        self._cfg = resolve(**self._args)
        self._store = open_membership_store(self._cfg)
        current = self._store.get_membership()
        if current is not None and current.epoch > 0 and self._cfg.member_id not in current:
            self._joiner = True
            self._provisional = (current.size, current.size + 1)
        else:
            if self._cfg.world_size is None:
                raise ConfigError("the ring is not running yet: world_size (or SPOTNIK_WORLD_SIZE / WORLD_SIZE) "
                                  "is needed to found it")
            self._create_ring(self._cfg.world_size)
        super().setup_environment()
        self._set_rank_zero()

    def _create_ring(self, world_size: int | None, prefetch: tuple[str, torch.Tensor] | None = None) -> None:
        cfg = self._cfg
        self.ring = RingGroup.create(self._store, world_size=world_size, member_id=cfg.member_id, host=cfg.host,
                                     tier=cfg.tier, secret=self._secret, timeouts=cfg.timeouts, prefetch=prefetch)
        _track(self.ring, 10.0)
        self._committer = StepCommitter(self.ring)
        self.ring.listeners.append(self._on_membership_event)

    def setup(self, trainer: pl.Trainer) -> None:
        self._manual = not trainer.lightning_module.automatic_optimization
        if self._manual and self._sync != "ssgd":
            raise ConfigError(f"sync={self._sync!r} needs automatic optimization (manual steps use ssgd)")
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if not any(isinstance(cb, SpotnikMetrics) for cb in trainer.callbacks):
            trainer.callbacks.append(SpotnikMetrics(self))
        module = trainer.lightning_module
        if self._user_batch_start is None:
            self._user_batch_start = module.on_train_batch_start
            module.on_train_batch_start = self._on_train_batch_start  # type: ignore[method-assign]
        if self._joiner:
            trainer.num_sanity_val_steps = 0  # the members are training: no collectives of our own now
            # Prefetch a member's served model before asking to join (used if the members are in
            # AD-PSGD: the donor then sends the state without model and optimizer state).
            snap = torch.empty(snapshot_bytes(self._model_tensors()), dtype=torch.uint8)
            self._create_ring(None, prefetch=(MODEL, snap))  # blocks until admitted at the members' next step
            self._prefetched = (self.ring.prefetched[0], snap) if self.ring.prefetched else None
            self._set_rank_zero()
            self._resync(voted=False, joiner=True)
            # Lightning's own start-up collectives (barriers, length checks) ran long ago on the
            # members: until its first training step, this member's collectives stay local.
            self._quiet = True
        else:
            self._broadcast_initial_state()
            self._world_seen = self.ring.size
        assert self.ring is not None and self.model is not None
        committed = lambda: self._committer.committed if self._committer else 0  # noqa: E731
        self._reducer = GradientReducer(
            self.ring, self.model.parameters(), bucket_mb=self.bucket_mb, first_bucket_mb=min(1.0, self.bucket_mb),
            on_launch=lambda i: self._faults.at("backward", committed()) if i == 0 else None,
            on_bucket=lambda i: self._faults.at("between_buckets", committed()) if i == 0 else None)

    def _broadcast_initial_state(self) -> None:
        """Founders start from rank 0's parameters and buffers (as DDP does)."""
        assert self.model is not None
        with torch.no_grad():
            for t in self.model.state_dict().values():
                if isinstance(t, torch.Tensor) and t.numel():
                    self._collective(lambda t=t: self.ring.broadcast(t, 0), lambda _, t=t: t.reshape(-1).view(
                        torch.uint8).clone(), lambda b, t=t: t.copy_(b.view(t.dtype).view(t.shape)))

    def process_dataloader(self, dataloader: object) -> object:
        """Replace the training DataLoader with an :class:`ElasticLoader` (other stages unchanged)."""
        # Lightning passes the stage to _process_dataloader, not to us; read it from the caller,
        # falling back to the trainer's current stage.
        stage = sys._getframe(1).f_locals.get("stage") or self.lightning_module.trainer.state.stage
        if stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader) or self.ring is None:
            return dataloader
        self._loader = ElasticLoader.wrap(dataloader, self._view, seed=self.seed, policy=self.batch_policy,
                                          global_batch=self.global_batch)
        if self._adopted is not None:
            self._loader.adopt(self._adopted["cursor"])
            self._adopted = None
        return self._loader

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._ckpt_world and self.ring is not None:  # resumed: the checkpoint's rates are for its world
            self._world_seen, self._ckpt_world = self._ckpt_world, 0
            self._note_world()
        self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        log.info("SIGTERM at %s: leaving after the current step", self.ring.member_id if self.ring else "?")
        self._leave_requested = True

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Lightning calls this after the forward and ``zero_grad``: where DDP's gradients are
        freed, so is the previous step's autograd memory (see :meth:`GradientReducer.release`)."""
        super().pre_backward(closure_loss)
        if self._reducer is not None:
            self._reducer.release()

    # ------------------------------------------------------------------ per step
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or self._loader is None or not self._loader.fetched:
            return super().batch_to_device(batch, device, dataloader_idx)
        self._quiet = False
        if not self._loader.step:  # first micro-batch of a step: the step boundary
            if self._admit_next:
                self._admit()
        fresh, status = self._loader.take(batch)
        if status == "skip":  # the agreed plans already cover the epoch: end it without training
            self._skip_batch = True
            return super().batch_to_device(batch, device, dataloader_idx)
        if status == "last":  # Lightning's own end-of-epoch logic (validation, accumulation) follows
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
        if fresh is not batch:
            fresh = self.lightning_module._on_before_batch_transfer(fresh, dataloader_idx=dataloader_idx)
        return super().batch_to_device(fresh, device, dataloader_idx)

    def _on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        """Wraps the LightningModule's hook: -1 (Lightning: end this epoch) for a surplus batch."""
        if self._skip_batch:
            self._skip_batch = False
            return -1
        return self._user_batch_start(batch, batch_idx)

    def _admit(self) -> None:
        self._admit_next = False
        assert self.ring is not None
        try:
            added = self.ring.admit()
        except MembershipChanged as exc:
            self._note_change(exc)
            added = []
        if added:
            self.counters.joins += len(added)
            log.info("admitted %s at step %d", [m.id for m in added], self._committer.committed)
        self._resync(voted=False, joiner=False)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Sync, vote, then apply — or discard, resync and recompute the same step (see module doc).
        With manual optimization: sync and vote, then apply; a failure raises out of ``opt.step()``
        and :meth:`training_step` reruns the whole step."""
        if self._reducer is None or self._loader is None or self._left:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model or self.lightning_module
        if self._manual:  # sync and vote now; a failure unwinds the whole training_step (see training_step)
            self._attempt(lambda: None)()
            return self.precision_plugin.optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self._attempts = 0
        while True:
            try:
                out = self.precision_plugin.optimizer_step(optimizer, model=model, closure=self._attempt(closure),
                                                           **kwargs)
            except StepDiscarded as d:
                self._attempts += 1
                res = self._recover(d)
                if res.outcome == "commit":
                    out = self.precision_plugin.optimizer_step(optimizer, model=model, closure=lambda d=d: d.loss,
                                                               **kwargs)
                    self._after_commit(Vote(self.world_size), post=False)  # the others are past this step
                    return out
                self.counters.retried_steps += 1
                self._rebuild_step(closure, optimizer)
                continue
            self._faults.at("after_commit", self._committer.committed)
            self._after_commit(self._vote or Vote(self.world_size))
            return out

    def _attempt(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        assert self._reducer is not None and self._loader is not None and self._committer is not None
        mine, total = self._loader.local_share()
        weight = mine / total if total else 0.0

        def run() -> Any:
            self._vote = None
            self._step_sync = self._sync
            if self._sync == "ssgd":
                self._reducer.arm(weight)
                try:
                    loss = closure()
                finally:
                    err = self._reducer.finish()
                if err is not None:
                    raise StepDiscarded(err, voted=False, loss=loss)
            else:  # model-averaging modes: the local gradient of this member's slice
                loss = closure()
                if not weight:  # no samples of the plan (a stand-in sample): no local update
                    self.lightning_module.zero_grad(set_to_none=True)
            self._faults.at("vote", self._committer.committed)
            if not self.atomic:
                return loss
            t0 = time.perf_counter()
            try:
                self._vote = self._committer.vote(leaving=self._leave_requested, request=self._request_code(),
                                                  dirty=self._dirty)
            except MembershipChanged as exc:
                raise StepDiscarded(exc, voted=True, loss=loss) from None
            c = self.counters
            c.vote_ms = (time.perf_counter() - t0) * 1e3
            c.votes, c.vote_ms_total = c.votes + 1, c.vote_ms_total + c.vote_ms
            return loss

        return run

    def _rebuild_step(self, closure: Any, optimizer: Any) -> None:
        """Re-plan every micro-batch of the discarded step for the new membership and recompute
        those before the last one (the last one runs in the next attempt's closure)."""
        assert self._loader is not None and self._reducer is not None
        batches = [super(SpotnikStrategy, self).batch_to_device(
            self.lightning_module._on_before_batch_transfer(b, dataloader_idx=0)) for b in self._loader.replan()]
        if closure is None:  # manual optimization: one plan per training_step
            self._rebuilt = batches[-1]
            return
        kwargs = closure._step_fn.args[0]  # Lightning's Closure: partial(_training_step, kwargs)
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(batches):
            kwargs["batch"] = batch
            if i < len(batches) - 1:
                with self._reducer.disarmed():
                    closure()

    def _after_commit(self, vote: Vote, advance: bool = True, post: bool = True) -> None:
        """Book a committed step: count it, advance the cursor, run the post-step work (model
        averaging, replica check), tell the listeners, act on the vote's joiners / leavers.
        ``post=False``: the step was applied inside a recovery (the other members are past it): no
        ring operation here — the next one is theirs too; the replica hash is computed locally."""
        assert self._committer is not None and self._loader is not None and self.ring is not None
        resyncs = len(self.counters.resyncs)
        if advance:
            self._committer.committed += 1
        done = self._loader.commit_step()
        epoch, rank, world = done[-1].view if done else self._view()  # the membership the step committed on
        members = list(self.ring.membership.ids)
        check = self._post_step(vote, collectives=post)
        digest = None
        if self.verify_replicas:
            if post and check:
                digest = self._verify(params_only=check == "params", leaving=vote.leaving)
            elif not post and self._step_sync == "ssgd" and not vote.dirty:  # caught up: hash, no all-gather
                digest = replica_hash(self.lightning_module, self.optimizers)
        if self.commit_listeners:
            info = CommitInfo(self._committer.committed, epoch, rank, world, members, [e.plan.to_list() for e in done],
                              [i for e in done if e.counted for i in e.indices], self._attempts + 1, digest)
            for fn in self.commit_listeners:
                fn(info)
        if vote.joiners and len(self.counters.resyncs) == resyncs:
            # (after a resync here, members that caught up never saw this vote: the leader flags
            # the joiners again in the next one)
            self._admit_next = True
        if vote.leaving and post and digest is None:
            self._departure_barrier(vote.leaving)
        if vote.leaving:
            if self.ring.member_id in vote.leaving:
                self._leave()
            else:
                self._await_departure(vote.leaving)

    def _verify(self, params_only: bool = False, leaving: list[str] | None = None) -> str:
        """All-gather the replica hash and compare. A membership change met here makes the member
        resync at once (after a vote with ``leaving`` members it is their departure)."""
        digest = replica_hash(self.lightning_module, [] if params_only else self.optimizers)
        mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8)
        try:
            out = torch.empty(self.ring.size * mine.numel(), dtype=torch.uint8)
            self.ring.all_gather(out, mine)
        except MembershipChanged as exc:  # resync at once: the others meet it in their next operation
            if leaving:  # the leavers' departure (a leaver goes on to leave)
                if self.ring.member_id not in leaving:
                    self._saw_departure(leaving, exc)
                return digest
            self._note_change(exc)
            self._resync(voted=False, joiner=False)
            return digest
        rows = out.view(self.ring.size, -1)
        if not bool((rows == mine).all()):
            raise ReplicaDivergenceError(f"replicas differ after step {self._committer.committed} at epoch "
                                         f"{self.ring.epoch}: {[bytes(r.tolist()).hex() for r in rows]}")
        return digest

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self._loader is not None and self._committer is not None:
            checkpoint["spotnik"] = {"cursor": self._loader.cursor.state_dict(), "committed": self._committer.committed,
                                     "world_seen": self._world_seen, **self._sync_state()}
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        ckpt = super().load_checkpoint(checkpoint_path, weights_only=False)
        state = ckpt.get("spotnik")
        if state is not None:
            # a new job resumes: fresh membership epochs, same data position (pending plans are re-made)
            self._adopted = {"cursor": state["cursor"]}
            if self._committer is not None:
                self._committer.committed = int(state["committed"])
            self._ckpt_world = int(state.get("world_seen", 0))
            self._load_sync_state(state)
        return ckpt

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    # ------------------------------------------------------------------ teardown
    def on_exception(self, exception: BaseException) -> None:
        if self.ring is not None and not self._left and isinstance(exception, SystemExit):
            self._left = True
            self.ring.leave()  # SIGTERM outside a step: leave at once, the others repair

    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None and self._user_batch_start is not None:
            del module.on_train_batch_start  # the instance attribute; the class's hook shows again
            self._user_batch_start = None
        if self._prev_sigterm is not None:
            signal.signal(signal.SIGTERM, self._prev_sigterm)
            self._prev_sigterm = None
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None
        if self.ring is not None:
            _close_ring(self.ring)
        elif self._store is not None:
            self._store.close()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("spotnik", cls, description="spotnik: training through revocations on a "
                                   "self-repairing ring")


register_strategy()  # when this module was imported before Lightning, the import hook deferred to here
