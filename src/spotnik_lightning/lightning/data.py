"""Elastic data: a global cursor over each epoch's permutation of the dataset.

Every sample of an epoch is processed exactly once across any sequence of membership changes and
retried steps. The unit is a :class:`StepPlan`, a fixed range ``[start, start + size)`` of the
epoch's permutation. A plan is made when its batch is fetched and never changes afterwards: a
step that was discarded (a peer died mid-step) re-reads the *same* range, split over the new
members by their new ranks, and the cursor advances past a plan only when its step commits.

Batch policy (how big the next plan is):

* ``"per_worker"`` (default): ``per_worker_batch`` samples per member, so the global batch grows and
  shrinks with the world (scale the learning rate with :func:`linear_lr_scale` if wanted);
* ``"global"``: ``global_batch`` samples whatever the world size.

A plan is split as evenly as possible (sizes differ by at most one). The epoch's tail joins the
last plan when fewer samples than members would be left for a plan of its own, so a plan normally
gives every member at least one sample; when it cannot (the world grew after the plan was made),
:meth:`ElasticCursor.split` gives the member without samples a stand-in sample of weight 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spotnik_lightning.api import ConfigError

POLICIES = ("per_worker", "global")


def linear_lr_scale(world: int, base_world: int) -> float:
    """The linear scaling rule (Goyal et al.): lr ∝ global batch, here ∝ world size."""
    if world < 1 or base_world < 1:
        raise ConfigError(f"world sizes must be >= 1, got {world} and {base_world}")
    return world / base_world


@dataclass(frozen=True)
class StepPlan:
    """The samples of one (micro-)step: positions ``[start, start + size)`` of epoch ``epoch``'s permutation."""

    epoch: int
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    def to_list(self) -> list[int]:
        return [self.epoch, self.start, self.size]


@dataclass
class ElasticCursor:
    """Position in the current epoch's permutation; advanced only by :meth:`commit`.

    Deterministic: every member holding the same state computes the same permutation, plans and
    slices, so members never exchange indices.
    """

    dataset_len: int
    per_worker_batch: int
    seed: int = 0
    policy: str = "per_worker"
    global_batch: int | None = None
    shuffle: bool = True
    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        if self.dataset_len < 1:
            raise ConfigError(f"dataset_len must be >= 1, got {self.dataset_len}")
        if self.per_worker_batch < 1:
            raise ConfigError(f"per_worker_batch must be >= 1, got {self.per_worker_batch}")
        if self.policy not in POLICIES:
            raise ConfigError(f"batch policy must be one of {POLICIES}, got {self.policy!r}")
        if self.policy == "global" and (self.global_batch is None or self.global_batch < 1):
            raise ConfigError("the 'global' batch policy needs global_batch >= 1")
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    def permutation(self, epoch: int | None = None) -> torch.Tensor:
        """Epoch ``epoch``'s order of sample indices (default: the current epoch; cached)."""
        epoch = self.epoch if epoch is None else epoch
        if self._perm_epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)  # as DistributedSampler orders
                self._perm = torch.randperm(self.dataset_len, generator=g)
            else:
                self._perm = torch.arange(self.dataset_len)
            self._perm_epoch = epoch
        return self._perm

    def plan(self, world: int, after: StepPlan | None = None) -> StepPlan | None:
        """The plan following ``after`` (default: the next uncommitted position) for ``world``
        members, or None when the epoch has no samples left after it. Does not advance anything."""
        if world < 1:
            raise ConfigError(f"world size must be >= 1, got {world}")
        epoch, start = (self.epoch, self.position) if after is None else (after.epoch, after.stop)
        left = self.dataset_len - start
        if left <= 0:
            return None
        full = self.per_worker_batch * world if self.policy == "per_worker" else int(self.global_batch or 1)
        size = left if left - full < min(world, full) else full  # a tail too small to split joins this plan
        return StepPlan(epoch, start, size)

    def split(self, plan: StepPlan, rank: int, world: int) -> tuple[list[int], bool]:
        """``rank``'s sample indices of ``plan`` with ``world`` members, and whether they count.

        Returns ``(indices, True)`` normally; ``([stand-in], False)`` when the plan has fewer
        samples than members and ``rank`` got none (train on it with weight 0)."""
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} out of range for world size {world}")
        base, extra = divmod(plan.size, world)
        lo = plan.start + rank * base + min(rank, extra)
        hi = lo + base + (1 if rank < extra else 0)
        perm = self.permutation(plan.epoch)
        if lo >= hi:
            return [int(perm[plan.start])], False
        return perm[lo:hi].tolist(), True

    def commit(self, plan: StepPlan) -> bool:
        """The step that consumed ``plan`` committed: advance past it. Plans must commit in order.
        Returns True when this finished the epoch (the cursor then points at the next one)."""
        if (plan.epoch, plan.start) != (self.epoch, self.position):
            raise ConfigError(f"commit of {plan} out of order: cursor is at epoch {self.epoch} "
                              f"position {self.position}")
        self.position = plan.stop
        if self.position >= self.dataset_len:
            self.epoch += 1
            self.position = 0
            return True
        return False

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "dataset_len": self.dataset_len, "per_worker_batch": self.per_worker_batch,
                "policy": self.policy, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        """Adopt a donor's cursor; refuses one over a different dataset or batch configuration."""
        for key in ("seed", "shuffle", "dataset_len", "per_worker_batch", "policy", "global_batch"):
            if state.get(key, getattr(self, key)) != getattr(self, key):
                raise ConfigError(f"cursor state differs in {key!r}: {state[key]!r} != {getattr(self, key)!r}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
