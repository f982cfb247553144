"""The packed form a donor's state travels in: one flat buffer per dtype plus a small skeleton."""

from __future__ import annotations

from collections import OrderedDict, defaultdict

import torch

from spotnik_lightning.lightning import packing


def test_round_trip_keeps_structure_values_and_dtypes_and_receiver_views_share_a_buffer() -> None:
    big = torch.randn(6, 5)
    state = {
        "model": OrderedDict(w=big.t(), b=torch.arange(4, dtype=torch.int64), s=torch.tensor(3.5)),
        "opt": [{"step": torch.tensor(7.0), "exp_avg": torch.ones(2, 3, dtype=torch.float64)}, None, "sgd"],
        "counts": defaultdict(int, a=1),
        "flags": (True, 2, torch.zeros(0)),
        "rng": torch.get_rng_state(),
    }
    parts = packing.pack(state)
    assert parts[0].dtype == torch.uint8 and len(parts) == 1 + 4  # float32, float64, int64, uint8
    head, flats = packing.layout(parts[0])
    assert [(f.dtype, f.numel()) for f in flats] == [(p.dtype, p.numel()) for p in parts[1:]]
    for dst, src in zip(flats, parts[1:], strict=True):  # what ring.recv does
        dst.copy_(src)
    out = packing.unpack(head, flats)
    assert isinstance(out["model"], OrderedDict) and list(out["model"]) == ["w", "b", "s"]
    assert torch.equal(out["model"]["w"], big.t()) and out["model"]["w"].shape == (5, 6)
    assert torch.equal(out["model"]["b"], torch.arange(4)) and out["model"]["s"].item() == 3.5
    assert out["opt"][0]["exp_avg"].dtype == torch.float64 and out["opt"][1:] == [None, "sgd"]
    assert isinstance(out["counts"], defaultdict) and out["counts"]["missing"] == 0
    assert out["flags"][:2] == (True, 2) and out["flags"][2].numel() == 0
    assert torch.equal(out["rng"], torch.get_rng_state())
    f32 = next(f for f in flats if f.dtype == torch.float32)
    assert out["model"]["s"].untyped_storage().data_ptr() == f32.untyped_storage().data_ptr()  # a view, no copy
