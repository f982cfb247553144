"""The training loader the strategy puts in place of the user's DataLoader.

Members must agree on every step's :class:`StepPlan` (which samples the step consumes), but each
member learns of a membership change at its own moment. So a plan is made only where all members
stand on the same membership: when the step starts (:meth:`ElasticLoader.take`, after any resync
and admission) and again when a discarded step is retried (:meth:`ElasticLoader.replan`), always
from the committed cursor and the ring's current size.

Lightning fetches one batch ahead, before the current step's plan exists, so the iterator yields
*provisional* batches (its best guess, built for the local view); ``take`` rebuilds a batch whose
guess was wrong. The epoch ends when the agreed plans cover the permutation: ``take`` reports the
step that reaches the end (the strategy marks it as Lightning's last batch, so validation and
epoch-end hooks run as usual) and reports a surplus fetched batch as "skip". The iterator has no
``__len__``.
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

View = tuple[int, int, int]  # (membership epoch, rank, world)


@dataclass
class Fetched:
    """A batch's plan (None: a provisional stand-in past the guessed end), its indices, whether
    they count, and the view it was split for."""

    plan: StepPlan | None
    indices: list[int]
    counted: bool
    view: View


class ElasticLoader:
    """Iterable over the current epoch's steps. ``view()`` returns the caller's current view."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any], cursor: ElasticCursor,
                 view: Callable[[], View]) -> None:
        self.dataset, self.collate_fn, self.cursor, self.view = dataset, collate_fn, cursor, view
        self.fetched: deque[Fetched] = deque()  # yielded, not yet handed to a step
        self.step: list[Fetched] = []           # the current step's agreed plans, not committed
        self.last_step = False                  # the current step reaches the end of the epoch
        self._epoch = cursor.epoch              # the epoch Lightning is iterating

    @classmethod
    def wrap(cls, dl: DataLoader, view: Callable[[], View], *, seed: int, policy: str,
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

    # ------------------------------------------------------------------ iteration (provisional)
    def __iter__(self) -> Iterator[Any]:
        self.fetched.clear()
        self._epoch = self.cursor.epoch
        return self._iterate()

    def _guess_after(self) -> StepPlan | None:
        for e in reversed(self.fetched):
            if e.plan is not None:
                return e.plan
        return self.step[-1].plan if self.step else None

    def _iterate(self) -> Iterator[Any]:
        while True:
            if self.cursor.epoch != self._epoch and not self.step:
                return  # the epoch's last plan committed
            view = self.view()
            after = self._guess_after()
            plan = self.cursor.plan(view[2], after=after)
            if plan is not None and plan.epoch != self._epoch:
                plan = None
            if plan is None and any(e.plan is None for e in self.fetched):
                return  # one stand-in past the guessed end is enough
            entry, batch = self._build(plan, view)
            self.fetched.append(entry)
            yield batch

    def _build(self, plan: StepPlan | None, view: View) -> tuple[Fetched, Any]:
        if plan is None:  # a stand-in: built from the first sample, never trained on
            return Fetched(None, [], False, view), self.collate_fn([self.dataset[int(self.cursor.permutation()[0])]])
        indices, counted = self.cursor.split(plan, view[1], view[2])
        return Fetched(plan, indices, counted, view), self.collate_fn([self.dataset[i] for i in indices])

    # ------------------------------------------------------------------ agreed plans (strategy side)
    def take(self, batch: Any) -> tuple[Any, str]:
        """The fetched ``batch`` is about to run as the current step's next micro-batch: make its
        agreed plan and return ``(batch to train on, status)``; status is ``"ok"``, ``"last"``
        (this plan ends the epoch) or ``"skip"`` (the epoch is already covered: do not train)."""
        if not self.fetched:
            raise ConfigError("a training batch arrived that the elastic loader did not produce")
        entry = self.fetched.popleft()
        view = self.view()
        plan = self.cursor.plan(view[2], after=self.step[-1].plan if self.step else None)
        if plan is None or plan.epoch != self._epoch:
            return batch, "skip"
        if entry.plan != plan or entry.view != view:
            entry, batch = self._build(plan, view)
        self.step.append(entry)
        self.last_step = plan.stop >= self.cursor.dataset_len
        return batch, "last" if self.last_step else "ok"

    def replan(self) -> list[Any]:
        """After a discarded step: re-make every plan of the step for the current view, from the
        committed cursor (the last one takes the rest of the epoch if the step was the epoch's last,
        since Lightning ends the epoch after it). Returns the new batches, in order."""
        view = self.view()
        batches, prev = [], None
        for i in range(len(self.step)):
            plan = self.cursor.plan(view[2], after=prev)
            if plan is None or plan.epoch != self._epoch:
                raise ConfigError(f"re-planning step plan {i} found the epoch already covered")  # plans only shrink
            if i == len(self.step) - 1 and self.last_step:
                plan = StepPlan(plan.epoch, plan.start, self.cursor.dataset_len - plan.start)
            entry, batch = self._build(plan, view)
            self.step[i] = entry
            batches.append(batch)
            prev = plan
        return batches

    def local_share(self) -> tuple[int, int]:
        """(samples counted by this member, samples in the step) for the current step."""
        mine = sum(len(e.indices) for e in self.step if e.counted)
        return mine, sum(e.plan.size for e in self.step if e.plan is not None)

    def commit_step(self) -> list[Fetched]:
        """The current step committed: advance the cursor past its plans; returns them."""
        done, self.step, self.last_step = self.step, [], False
        for e in done:
            assert e.plan is not None
            self.cursor.commit(e.plan)
        return done

    def adopt(self, cursor_state: dict) -> None:
        """Take a donor's cursor (before iteration starts)."""
        self.cursor.load_state_dict(cursor_state)
        self.fetched.clear()
        self.step, self.last_step = [], False
        self._epoch = self.cursor.epoch
