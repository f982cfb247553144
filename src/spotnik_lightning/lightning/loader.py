"""The training loader the strategy puts in place of the user's DataLoader.

:class:`ElasticLoader` yields one batch per :class:`StepPlan` of the :class:`ElasticCursor`, built
in this process (``collate_fn([dataset[i] for i in my slice])``) for the member's current rank.
Plans are fixed when fetched (Lightning fetches one batch ahead); the strategy re-splits a batch
whose membership changed before it ran (:meth:`rebuild`) and commits the plans of a step when the
step commits (:meth:`commit_step`). The iterator has no ``__len__``: an epoch ends when the
cursor's permutation is covered, however the world changed on the way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.dataloader import default_collate

from spotnik_lightning.api import ConfigError
from spotnik_lightning.lightning.data import ElasticCursor, StepPlan


@dataclass
class Fetched:
    """A plan and the batch built for it: its indices, whether they count, and for which view."""

    plan: StepPlan
    indices: list[int]
    counted: bool
    view: tuple[int, int, int]  # (membership epoch, rank, world) the batch was split for


class ElasticLoader:
    """Iterable over the current epoch's remaining plans. ``view()`` returns the caller's current
    ``(membership epoch, rank, world)``; it is read at fetch time and again by :meth:`rebuild`."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any], cursor: ElasticCursor,
                 view: Callable[[], tuple[int, int, int]]) -> None:
        self.dataset, self.collate_fn, self.cursor, self.view = dataset, collate_fn, cursor, view
        self.fetched: deque[Fetched] = deque()  # yielded, not yet handed to a step
        self.step: list[Fetched] = []           # handed to the current step, not committed
        self._replay: deque[StepPlan] = deque()  # plans adopted from a donor, to yield first
        self._last: StepPlan | None = None

    @classmethod
    def wrap(cls, dl: DataLoader, view: Callable[[], tuple[int, int, int]], *, seed: int, policy: str,
             global_batch: int | None) -> ElasticLoader:
        """Build from a user's map-style DataLoader (its dataset, batch size, collate_fn, shuffle).
        Raises ConfigError for an IterableDataset, a custom sampler, or no batch size."""
        if isinstance(dl.dataset, IterableDataset):
            raise ConfigError("the spotnik strategy needs a map-style training dataset (an IterableDataset has no "
                              "global order to keep a cursor over)")
        if not isinstance(dl.sampler, (RandomSampler, SequentialSampler)):
            raise ConfigError(f"the spotnik strategy replaces the training sampler; {type(dl.sampler).__name__} "
                              "is not supported (use shuffle=True/False)")
        if dl.batch_size is None:
            raise ConfigError("the training DataLoader needs a batch_size (the per-worker batch)")
        cursor = ElasticCursor(len(dl.dataset), dl.batch_size, seed=seed, policy=policy, global_batch=global_batch,
                               shuffle=isinstance(dl.sampler, RandomSampler))
        return cls(dl.dataset, dl.collate_fn or default_collate, cursor, view)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        self._last = None
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        while True:
            if self._replay:
                plan: StepPlan | None = self._replay.popleft()
            else:
                view = self.view()
                plan = self.cursor.plan(view[2], after=self._last)
            if plan is None:
                return
            self._last = plan
            entry, batch = self._build(plan)
            self.fetched.append(entry)
            yield batch

    def _build(self, plan: StepPlan) -> tuple[Fetched, Any]:
        view = self.view()
        indices, counted = self.cursor.split(plan, view[1], view[2])
        return Fetched(plan, indices, counted, view), self.collate_fn([self.dataset[i] for i in indices])

    # ------------------------------------------------------------------ strategy side
    def take(self, batch: Any) -> Any:
        """The fetched batch is about to run as part of the current step: move its plan to the
        step, re-splitting it if the membership changed since it was fetched."""
        if not self.fetched:
            raise ConfigError("a training batch arrived that the elastic loader did not produce")
        entry = self.fetched.popleft()
        self.step.append(entry)
        if entry.view != self.view():
            return self.rebuild(len(self.step) - 1)
        return batch

    def rebuild(self, i: int) -> Any:
        """Re-split the step's ``i``-th plan for the current view and return its new batch."""
        entry, batch = self._build(self.step[i].plan)
        self.step[i] = entry
        return batch

    def local_share(self) -> tuple[int, int]:
        """(samples counted by this member, samples in the step) for the current step."""
        mine = sum(len(e.indices) for e in self.step if e.counted)
        return mine, sum(e.plan.size for e in self.step)

    def commit_step(self) -> list[Fetched]:
        """The current step committed: advance the cursor past its plans; returns them."""
        done, self.step = self.step, []
        for e in done:
            self.cursor.commit(e.plan)
        return done

    def pending_plans(self) -> list[StepPlan]:
        """Plans made but not committed, in order (the current step's, then fetched ahead)."""
        return [e.plan for e in self.step] + [e.plan for e in self.fetched]

    def adopt(self, cursor_state: dict, pending: list[list[int]]) -> None:
        """Take a donor's cursor and pending plans (before iteration starts): the plans are
        yielded first, so this member's steps use exactly the donor's plans."""
        self.cursor.load_state_dict(cursor_state)
        self.fetched.clear()
        self.step = []
        self._replay = deque(StepPlan(*p) for p in pending)
