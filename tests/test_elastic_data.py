"""The elastic data cursor: every sample exactly once per epoch across any sequence of world-size
changes and discarded (retried) steps."""

from __future__ import annotations

import random

import pytest

from spotnik_lightning.api import ConfigError
from spotnik_lightning.lightning import ElasticCursor
from spotnik_lightning.lightning.data import linear_lr_scale


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", ["per_worker", "global"])
def test_every_sample_exactly_once_across_changes_and_retries(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    n = rng.randint(50, 3000)
    cursor = ElasticCursor(n, per_worker_batch=rng.randint(1, 40), seed=seed, policy=policy,
                           global_batch=rng.randint(1, 200) if policy == "global" else None)
    world, seen, epochs, discarded = rng.randint(1, 8), [], [], 0
    while len(epochs) < 2:
        if rng.random() < 0.25:  # a revocation or a join between (or during) steps
            world = max(1, min(16, world + rng.choice([-3, -2, -1, 1, 2])))
        slices = [cursor.indices(r, world) for r in range(world)]
        assert sum(map(len, slices)) == cursor.step_size(world)
        if rng.random() < 0.2:  # a peer died mid-step: discarded, the cursor must not move
            discarded += 1
            continue
        for s in slices:
            seen.extend(s)
        if cursor.commit(world):
            epochs.append(seen)
            seen = []
    for got in epochs:
        assert sorted(got) == list(range(n)), "a sample was lost or processed twice"
    assert discarded > 0


def test_retry_rereads_the_same_samples_and_epochs_reshuffle() -> None:
    c = ElasticCursor(100, per_worker_batch=10, seed=3)
    first = [c.indices(r, 4) for r in range(4)]
    assert [c.indices(r, 4) for r in range(4)] == first  # discarded step: same samples again
    three = [c.indices(r, 3) for r in range(3)]  # retried on 3 members: a prefix of the same order
    assert sum(three, []) == sum(first, [])[:30]
    order0 = c.permutation().tolist()
    while not c.commit(4):
        pass
    assert c.epoch == 1 and c.position == 0 and c.permutation().tolist() != order0


def test_global_policy_keeps_the_global_batch() -> None:
    c = ElasticCursor(1000, per_worker_batch=1, policy="global", global_batch=64)
    for world in (1, 3, 7, 64, 100):
        sizes = [len(c.indices(r, world)) for r in range(world)]
        assert sum(sizes) == 64 and max(sizes) - min(sizes) <= 1


def test_state_transfer_to_a_joiner() -> None:
    donor = ElasticCursor(500, per_worker_batch=8, seed=11)
    for world in (4, 4, 3, 5):
        donor.commit(world)
    joiner = ElasticCursor(500, per_worker_batch=8, seed=11)
    joiner.load_state_dict(donor.state_dict())
    assert [joiner.indices(r, 6) for r in range(6)] == [donor.indices(r, 6) for r in range(6)]
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
        ElasticCursor(10, per_worker_batch=1).indices(4, 4)
    assert linear_lr_scale(6, 4) == 1.5
    with pytest.raises(ConfigError):
        linear_lr_scale(0, 4)
