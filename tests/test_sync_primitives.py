"""Model-averaging primitives (sync/) on a real in-process ring (threads, real sockets)."""

from __future__ import annotations

import torch

from spotnik_lightning.sync import ADPSGD, SMA, average_all, average_pair, pairing
from tests.test_ring_unit import CALM, _ring, run_all


def test_pairing_is_a_symmetric_matching_agreed_by_step_and_epoch() -> None:
    for n in range(1, 9):
        for step in range(20):
            p = pairing(step, 3, list(range(n)))
            assert sorted(p) == list(range(n))
            assert all(q is None or p[q] == r for r, q in p.items())
            assert sum(q is None for q in p.values()) == n % 2
    seen = {tuple(sorted(pairing(s, 1, list(range(6))).items())) for s in range(30)}
    assert len(seen) > 5, "the matching should change from step to step"
    assert pairing(4, 2, [0, 2, 3]) == pairing(4, 2, [3, 0, 2])


def test_average_all_and_pairwise_average(embedded_server) -> None:
    gen = iter(_ring(embedded_server, 4, CALM, run="avg"))
    groups = next(gen)
    try:
        def state(r: int) -> list[torch.Tensor]:
            return [torch.full((3, 2), float(r)), torch.arange(5, dtype=torch.float64) * r,
                    torch.tensor([r], dtype=torch.int64)]

        tensors = {g.rank: state(g.rank) for g in groups}
        run_all(groups, lambda g: average_all(g, tensors[g.rank]))
        for r, ts in tensors.items():
            assert torch.equal(ts[0], torch.full((3, 2), 1.5))
            assert torch.equal(ts[1], torch.arange(5, dtype=torch.float64) * 1.5)
            assert ts[2].item() == r  # integers are not averaged
        tensors = {g.rank: state(g.rank) for g in groups}
        peers = {g.rank: ADPSGD().peer(g, 7) for g in groups}
        assert all(peers[peers[r]] == r for r in peers)
        run_all(groups, lambda g: average_pair(g, tensors[g.rank], peers[g.rank]))
        for r, ts in tensors.items():
            assert torch.equal(ts[0], torch.full((3, 2), (r + peers[r]) / 2))
        # a leaver is excluded: the three others pair among themselves, one skips
        out = run_all(groups, lambda g: ADPSGD().after_step(g, state(g.rank), 3, exclude=[1]))
        assert out[[g.rank for g in groups].index(1)] == (None, None)
        assert sorted(p is None for p, _ in out) == [False, False, True, True]
        assert SMA(2).after_step(groups[0], [], 3) is False
    finally:
        gen.close()
