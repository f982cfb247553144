"""Elastic data: a global cursor over each epoch's permutation of the dataset.

Every sample of an epoch is processed exactly once across any sequence of membership changes and
retried steps, because the cursor advances only when a step *commits*: a step that was discarded
(a peer died mid-step) leaves it where it was, and the retry on the new membership re-reads the
same part of the permutation, split by the new ranks.

Batch policy when the world size changes:

* ``"per_worker"`` (default): each member keeps ``per_worker_batch`` samples; the global batch
  grows and shrinks with the world (scale the learning rate with :func:`linear_lr_scale` if
  wanted);
* ``"global"``: the global batch stays ``global_batch``; its samples are split as evenly as
  possible over the members (sizes differ by at most one).

The last batch of an epoch holds what is left; it is split the same way, so some members may get
fewer (or no) samples — the caller's loss averaging must weight by sample count if that matters.
The cursor is a small value: :meth:`state_dict` goes to a joining worker with the model.
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


@dataclass
class ElasticCursor:
    """Position in the current epoch's permutation; advanced only by :meth:`commit`.

    Deterministic: every member holding the same state computes the same permutation and the same
    slices, so members never exchange indices.
    """

    dataset_len: int
    per_worker_batch: int
    seed: int = 0
    policy: str = "per_worker"
    global_batch: int | None = None
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

    def permutation(self) -> torch.Tensor:
        """This epoch's order of sample indices (cached; seeded by ``seed`` and ``epoch``)."""
        if self._perm_epoch != self.epoch:
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % (1 << 63))
            self._perm = torch.randperm(self.dataset_len, generator=g)
            self._perm_epoch = self.epoch
        return self._perm

    def step_size(self, world: int) -> int:
        """How many samples the next step consumes with ``world`` members (clipped at epoch end)."""
        if world < 1:
            raise ConfigError(f"world size must be >= 1, got {world}")
        full = self.per_worker_batch * world if self.policy == "per_worker" else self.global_batch
        return min(full, self.dataset_len - self.position)

    def indices(self, rank: int, world: int) -> list[int]:
        """Sample indices of ``rank``'s slice of the next step. Does not advance the cursor."""
        if not 0 <= rank < world:
            raise ConfigError(f"rank {rank} out of range for world size {world}")
        total = self.step_size(world)
        if self.policy == "per_worker":
            start = self.position + rank * self.per_worker_batch
            stop = min(start + self.per_worker_batch, self.position + total)
        else:
            base, extra = divmod(total, world)
            start = self.position + rank * base + min(rank, extra)
            stop = start + base + (1 if rank < extra else 0)
        if start >= stop:
            return []
        return self.permutation()[start:stop].tolist()

    def commit(self, world: int) -> bool:
        """The step run with ``world`` members committed: advance past its samples. Returns True
        when this finished the epoch (the cursor then points at the start of the next one)."""
        self.position += self.step_size(world)
        if self.position >= self.dataset_len:
            self.epoch += 1
            self.position = 0
            return True
        return False

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "dataset_len": self.dataset_len, "per_worker_batch": self.per_worker_batch,
                "policy": self.policy, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        """Adopt a donor's cursor; refuses one over a different dataset or batch configuration."""
        for key in ("seed", "dataset_len", "per_worker_batch", "policy", "global_batch"):
            if state[key] != getattr(self, key):
                raise ConfigError(f"cursor state differs in {key!r}: {state[key]!r} != {getattr(self, key)!r}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
