"""The elastic data cursor: every sample exactly once per epoch across any sequence of world-size
changes, prefetched plans and discarded (retried) steps."""

from __future__ import annotations

import random

import pytest

from spotnik_lightning.api import ConfigError
from spotnik_lightning.lightning import ElasticCursor, StepPlan
from spotnik_lightning.lightning.data import linear_lr_scale
from spotnik_lightning.lightning.loader import ElasticLoader


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", ["per_worker", "global"])
def test_every_sample_exactly_once_across_changes_and_retries(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    n = rng.randint(50, 3000)
    cursor = ElasticCursor(n, per_worker_batch=rng.randint(1, 40), seed=seed, policy=policy,
                           global_batch=rng.randint(1, 200) if policy == "global" else None)
    world, seen, epochs, discarded, stand_ins = rng.randint(1, 8), [], [], 0, 0
    ahead = cursor.plan(world)  # Lightning fetches one plan ahead
    while len(epochs) < 2:
        plan, ahead = ahead, None
        assert plan is not None
        ahead = cursor.plan(world, after=plan)
        while True:
            if rng.random() < 0.25:  # a revocation or a join before or during the step
                world = max(1, min(16, world + rng.choice([-3, -2, -1, 1, 2])))
            slices = [cursor.split(plan, r, world) for r in range(world)]
            counted = [i for s, ok in slices if ok for i in s]
            stand_ins += sum(1 for _, ok in slices if not ok)
            assert sorted(counted) == sorted(cursor.permutation(plan.epoch)[plan.start:plan.stop].tolist())
            assert max(len(s) for s, _ in slices) - min(len(s) for s, _ in slices) <= 1
            if rng.random() < 0.2:  # a peer died mid-step: discarded, recomputed on the new world
                discarded += 1
                continue
            break
        seen.extend(counted)
        if cursor.commit(plan):
            epochs.append(seen)
            seen = []
            ahead = cursor.plan(world)
    for got in epochs:
        assert sorted(got) == list(range(n)), "a sample was lost or processed twice"
    assert discarded > 0


def test_plans_are_fixed_and_the_tail_joins_the_last_plan() -> None:
    c = ElasticCursor(100, per_worker_batch=10, seed=3)
    first = c.plan(4)
    assert first == StepPlan(0, 0, 40) and c.plan(4) == first  # nothing moves before a commit
    assert c.plan(4, after=first) == StepPlan(0, 40, 40)
    assert c.plan(3, after=StepPlan(0, 40, 40)) == StepPlan(0, 80, 20)  # 20 left: one plan of 20
    assert c.plan(4, after=StepPlan(0, 58, 40)) == StepPlan(0, 98, 2)
    assert c.plan(8, after=StepPlan(0, 0, 15)) == StepPlan(0, 15, 85)  # 5 would be left < 8 members: merged
    assert c.plan(4, after=StepPlan(0, 60, 40)) is None
    with pytest.raises(ConfigError, match="out of order"):
        c.commit(StepPlan(0, 40, 40))
    order0 = c.permutation().tolist()
    plan = c.plan(4)
    while plan is not None:
        c.commit(plan)
        plan = c.plan(4) if c.epoch == 0 else None
    assert c.epoch == 1 and c.position == 0 and c.permutation().tolist() != order0


def test_a_member_without_samples_gets_a_stand_in_of_weight_zero() -> None:
    c = ElasticCursor(10, per_worker_batch=1, shuffle=False)
    plan = StepPlan(0, 0, 2)
    assert [c.split(plan, r, 3) for r in range(3)] == [([0], True), ([1], True), ([0], False)]


def test_global_policy_keeps_the_global_batch() -> None:
    c = ElasticCursor(1000, per_worker_batch=1, policy="global", global_batch=64)
    for world in (1, 3, 7, 64):
        plan = c.plan(world)
        assert plan is not None and plan.size == 64
        sizes = [len(c.split(plan, r, world)[0]) for r in range(world)]
        assert sum(sizes) == 64 and max(sizes) - min(sizes) <= 1


def test_state_transfer_to_a_joiner() -> None:
    donor = ElasticCursor(500, per_worker_batch=8, seed=11)
    for world in (4, 4, 3, 5):
        donor.commit(donor.plan(world))
    joiner = ElasticCursor(500, per_worker_batch=8, seed=11)
    joiner.load_state_dict(donor.state_dict())
    plan = donor.plan(6)
    assert joiner.plan(6) == plan
    assert [joiner.split(plan, r, 6) for r in range(6)] == [donor.split(plan, r, 6) for r in range(6)]
    with pytest.raises(ConfigError, match="seed"):
        ElasticCursor(500, per_worker_batch=8, seed=12).load_state_dict(donor.state_dict())


def test_bad_configuration_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="dataset_len"):
        ElasticCursor(0, per_worker_batch=1)
    with pytest.raises(ConfigError, match="policy"):
        ElasticCursor(10, per_worker_batch=1, policy="half")
    with pytest.raises(ConfigError, match="global_batch"):
        ElasticCursor(10, per_worker_batch=1, policy="global")
    with pytest.raises(ConfigError, match="rank 4 out of range"):
        ElasticCursor(10, per_worker_batch=1).split(StepPlan(0, 0, 4), 4, 4)
    assert linear_lr_scale(6, 4) == 1.5
    with pytest.raises(ConfigError):
        linear_lr_scale(0, 4)


def _loader(n: int, batch: int, view: list) -> ElasticLoader:
    data = [(i,) for i in range(n)]
    return ElasticLoader(data, lambda items: [i for (i,) in items], ElasticCursor(n, batch, shuffle=False),
                         lambda: tuple(view))


def test_loader_agrees_on_plans_at_step_start_whatever_was_prefetched() -> None:
    view = [1, 0, 4]  # (membership epoch, rank, world)
    ld = _loader(40, 2, view)
    it = iter(ld)
    first = next(it)
    assert first == [0, 1] and ld.fetched[0].plan == StepPlan(0, 0, 8)
    batch, status = ld.take(first)
    assert (batch, status) is not None and status == "ok" and batch is first  # the guess was right
    prefetched = next(it)  # guessed on 4 members...
    ld.commit_step()
    view[:] = [2, 0, 3]    # ...but the step runs on 3
    batch, status = ld.take(prefetched)
    assert batch == [8, 9] and ld.step[0].plan == StepPlan(0, 8, 6) and ld.local_share() == (2, 6)
    view[:] = [3, 1, 2]  # discarded: retried on 2 members, re-planned from the committed cursor
    assert ld.replan() == [[10, 11]] and ld.step[0].plan == StepPlan(0, 8, 4)


def test_loader_ends_the_epoch_on_the_agreed_plan_and_skips_a_surplus_batch() -> None:
    view = [1, 0, 3]
    ld = _loader(10, 3, view)
    it = iter(ld)
    _, status = ld.take(next(it))
    assert status == "last" and ld.step[0].plan == StepPlan(0, 0, 10)  # 9 + a tail of 1 < 3 members
    surplus = next(it)  # Lightning fetches ahead: a stand-in past the guessed end
    assert ld.fetched[-1].plan is None
    view[:] = [2, 0, 1]  # the last step is retried on one member: it still takes the whole rest
    assert ld.replan() == [list(range(10))]
    ld.commit_step()
    assert ld.cursor.epoch == 1 and ld.take(surplus)[1] == "skip"
    assert list(it) == []  # and the epoch's iterator is over
