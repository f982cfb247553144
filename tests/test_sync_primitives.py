"""Model-averaging primitives (sync/) on a real in-process ring (threads, real sockets)."""

from __future__ import annotations

import torch

from spotnik_lightning.api import FetchError
from spotnik_lightning.sync import ADPSGD, SMA, average_all, average_with_snapshot, cycle, publish_model
from tests.test_ring_unit import CALM, _ring, run_all


def test_cycle_is_a_random_order_agreed_by_step_and_epoch() -> None:
    for n in range(1, 9):
        for step in range(20):
            assert sorted(cycle(step, 3, list(range(n)))) == list(range(n))
    seen = {tuple(cycle(s, 1, list(range(6)))) for s in range(30)}
    assert len(seen) > 5, "the order should change from step to step"
    assert cycle(4, 2, [0, 2, 3]) == cycle(4, 2, [3, 0, 2])


def _state(r: int) -> list[torch.Tensor]:
    return [torch.full((3, 2), float(r)), torch.arange(5, dtype=torch.float64) * r,
            torch.tensor([r], dtype=torch.int64)]


def test_average_all_and_one_sided_snapshot_averaging(embedded_server) -> None:
    gen = iter(_ring(embedded_server, 4, CALM, run="avg"))
    groups = next(gen)
    try:
        tensors = {g.rank: _state(g.rank) for g in groups}
        run_all(groups, lambda g: average_all(g, tensors[g.rank]))
        for r, ts in tensors.items():
            assert torch.equal(ts[0], torch.full((3, 2), 1.5))
            assert torch.equal(ts[1], torch.arange(5, dtype=torch.float64) * 1.5)
            assert ts[2].item() == r  # integers are not averaged

        tensors = {g.rank: _state(g.rank) for g in groups}
        for g in groups:
            publish_model(g, tensors[g.rank], 7)
        peers = {g.rank: ADPSGD().peer(g, 7) for g in groups}
        # a random cycle: every member has one peer and is the peer of exactly one member
        assert sorted(peers.values()) == [0, 1, 2, 3] and all(peers[r] != r for r in peers)
        orbit, r = [0], peers[0]
        while r != 0:
            orbit.append(r)
            r = peers[r]
        assert len(orbit) == 4, f"not one cycle: {peers}"
        out = run_all(groups, lambda g: average_with_snapshot(g, tensors[g.rank], peers[g.rank], 7)[0])
        assert out == [7] * 4
        for r, ts in tensors.items():  # one-sided: x_r <- (x_r + x_p) / 2 with p's published x_p
            assert torch.equal(ts[0], torch.full((3, 2), (r + peers[r]) / 2))
            assert torch.equal(ts[1], torch.arange(5, dtype=torch.float64) * (r + peers[r]) / 2)
            assert ts[2].item() == r
        # ADPSGD: each call publishes, averages with what the previous call started fetching, and
        # starts fetching the next step's peer; a snapshot older than step - 2 is not used
        g = groups[0]
        before = [t.clone() for t in tensors[g.rank]]
        ad = ADPSGD()
        assert ad.after_step(g, tensors[g.rank], 19) == (None, None)  # nothing fetched yet
        peer, err = ad.after_step(g, tensors[g.rank], 20)  # the peer's snapshot is version 7
        assert isinstance(err, FetchError) and not err.gone and "stale" in str(err) and peer == err.peer
        assert not ad.dropped and ad.skipped == 1
        assert all(torch.equal(a, b) for a, b in zip(before, tensors[g.rank], strict=True))
        # a leaver is excluded: the three others form a cycle among themselves
        assert ADPSGD().peer(groups[1], 3, exclude=[groups[1].rank]) is None
        assert {ADPSGD().peer(g, 3, exclude=[groups[1].rank]) for g in groups if g is not groups[1]} == {
            g.rank for g in groups if g is not groups[1]}
        assert SMA(2).after_step(groups[0], [], 3) is False
    finally:
        gen.close()


def test_a_gone_peer_is_skipped_and_dropped_at_once(embedded_server) -> None:
    """m1's serving breaks off every fetch (as a peer dying mid-fetch does, but the ring keeps it, so
    the test is deterministic): m0 skips the step, drops m1 at once and averages with m2 next."""
    gen = iter(_ring(embedded_server, 3, CALM, run="gone"))
    groups = next(gen)
    try:
        me, m1 = groups[0], groups[1]
        m1._served.serve = lambda sock, peer: None  # closes each serve connection at once
        ad = ADPSGD()
        step = next(s for s in range(100) if me.membership.ids[ad.peer(me, s + 1)] == "m1")
        for g in groups:
            publish_model(g, _state(g.rank), step)
        x = _state(me.rank)
        assert ad.after_step(me, x, step) == (None, None)  # starts fetching m1's model for step + 1
        peer, err = ad.after_step(me, x, step + 1)
        assert peer == "m1" and isinstance(err, FetchError) and err.gone and err.peer == "m1", err
        assert "epoch 1" in str(err)
        assert ad.dropped == {"m1"} and torch.equal(x[0], torch.full((3, 2), float(me.rank)))  # untouched
        for s in range(step + 2, step + 7):  # never m1 again in this epoch, and not retried
            assert me.membership.ids[ad.peer(me, s)] == "m2"
        publish_model(groups[2], _state(groups[2].rank), step + 2)
        peer, err = ad.after_step(me, x, step + 2)  # averages with m2's snapshot fetched since the last call
        assert (peer, err) == ("m2", None) and ad.averaged == 1 and ad.skipped == 1
        assert torch.equal(x[0], torch.full((3, 2), (me.rank + groups[2].rank) / 2))
        assert [g.epoch for g in groups] == [1, 1, 1]
    finally:
        gen.close()
