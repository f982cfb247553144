"""Model-averaging primitives (sync/) on a real in-process ring (threads, real sockets)."""

from __future__ import annotations

import torch

from spotnik_lightning.api import FetchError
from spotnik_lightning.sync import (
    ADPSGD,
    SMA,
    average_all,
    average_with_snapshot,
    complete_optimizer_state,
    cycle,
    publish_model,
)
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


def _optimizers(rank: int) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    """Identical models; member ``rank`` steps ``rank`` times with its own gradients (rank 0: never,
    as a joiner that has not stepped yet), except the last layer, which only rank 1 ever steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9), torch.optim.Adam(model[1].parameters())]
    for k in range(rank):
        for p in model.parameters():
            p.grad = torch.full_like(p, float(rank + k))
        if rank != 1:
            model[1].weight.grad = model[1].bias.grad = None  # a layer no local gradient reached
        for opt in opts:
            opt.step()
    return model, opts


def _opt_tensors(opts: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    return [st[k] for opt in opts for g in opt.param_groups for p in g["params"]
            for st in [opt.state.get(p, {})] for k in sorted(st)]


def test_missing_optimizer_state_is_completed_fresh_before_averaging(embedded_server) -> None:
    gen = iter(_ring(embedded_server, 3, CALM, run="optstate"))
    groups = next(gen)
    try:
        made = {g.rank: _optimizers(g.rank) for g in groups}
        before = {r: [t.clone() for t in _opt_tensors(opts)] for r, (_m, opts) in made.items()}
        filled = run_all(groups, lambda g: complete_optimizer_state(g, made[g.rank][1]))
        # rank 0: all four parameters; rank 1: none; rank 2: the last layer's two
        assert dict(zip([g.rank for g in groups], filled, strict=True)) == {0: 4, 1: 0, 2: 2}
        assert [len(_opt_tensors(opts)) for _m, opts in made.values()] == [2 + 6] * 3  # 2 momenta, 2 x 3 Adam
        for r, (_m, opts) in made.items():  # the state a member had is untouched; what it got is zero
            for got in _opt_tensors(opts):
                assert any(got is b or torch.equal(got, b) for b in before[r]) or not got.any()
        state = {g.rank: [p.data for p in made[g.rank][0].parameters()] + _opt_tensors(made[g.rank][1])
                 for g in groups}
        run_all(groups, lambda g: average_all(g, state[g.rank]))
        for r in (1, 2):
            assert all(torch.equal(a, b) for a, b in zip(state[0], state[r], strict=True)), "replicas differ"
        sgd = made[2][1][0]
        w = made[2][0][0].weight
        # momentum of the first layer: (fresh 0 + rank 1's one step + rank 2's two steps) / 3
        b1 = torch.full_like(w, 1.0)
        b2 = 0.9 * torch.full_like(w, 2.0) + torch.full_like(w, 3.0)
        assert torch.allclose(sgd.state[w]["momentum_buffer"], (b1 + b2) / 3)
        assert run_all(groups, lambda g: complete_optimizer_state(g, made[g.rank][1])) == [0, 0, 0]
    finally:
        gen.close()
