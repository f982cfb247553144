"""A nested state (dicts/lists of tensors and plain values) as a few buffers, for the ring.

:func:`pack` replaces every tensor with a reference and pickles the rest into a small "skeleton";
the tensors travel as one flat buffer per dtype (one copy on the sender). The receiver allocates
the buffers from the skeleton (:func:`layout`), receives into them, and :func:`unpack` rebuilds the
state with every tensor a view of a received buffer (no copy). A 25 M-parameter model with Adam is
~300 MB in three buffers and a few kB of skeleton.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import torch


def _map_dict(d: dict, fn: Callable[[Any], Any]) -> dict:
    out = copy.copy(d)  # keeps OrderedDict / defaultdict types
    for k, v in d.items():
        out[k] = fn(v)
    return out


class _Ref:
    """Where a tensor went: flat buffer ``key``, element offset, shape (and strides are dense)."""

    def __init__(self, key: str, offset: int, shape: tuple[int, ...]) -> None:
        self.key, self.offset, self.shape = key, offset, shape


def pack(obj: Any) -> list[torch.Tensor]:
    """``[skeleton (uint8), flat buffer per dtype...]`` for ``obj`` (nested dicts/lists/tuples of
    tensors and picklable values). Tensors are copied once into the flat buffers."""
    groups: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            t = v.detach()
            key = str(t.dtype).removeprefix("torch.")
            ref = _Ref(key, sizes.get(key, 0), tuple(t.shape))
            groups.setdefault(key, []).append(t.reshape(-1))
            sizes[key] = ref.offset + t.numel()
            return ref
        if isinstance(v, dict):
            return _map_dict(v, walk)
        if isinstance(v, (list, tuple)) and type(v) in (list, tuple):
            return type(v)(walk(x) for x in v)
        return v

    skeleton = walk(obj)
    keys = sorted(groups)
    flats = [torch.cat(groups[k]) if groups[k] else torch.empty(0) for k in keys]
    head = pickle.dumps({"skeleton": skeleton, "flats": [(k, f.numel()) for k, f in zip(keys, flats, strict=True)]})
    return [torch.frombuffer(bytearray(head), dtype=torch.uint8), *flats]


def layout(skeleton_part: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """From the received skeleton: the decoded header and empty buffers to receive the flats into."""
    head = pickle.loads(skeleton_part.numpy().tobytes())
    return head, [torch.empty(n, dtype=getattr(torch, k)) for k, n in head["flats"]]


def unpack(head: dict[str, Any], flats: list[torch.Tensor]) -> Any:
    """Rebuild the object: every tensor is a view of the received flat buffers (no copy)."""
    by_key = {k: f for (k, _), f in zip(head["flats"], flats, strict=True)}

    def walk(v: Any) -> Any:
        if isinstance(v, _Ref):
            n = 1
            for d in v.shape:
                n *= d
            return by_key[v.key][v.offset:v.offset + n].view(v.shape)
        if isinstance(v, dict):
            return _map_dict(v, walk)
        if isinstance(v, (list, tuple)) and type(v) in (list, tuple):
            return type(v)(walk(x) for x in v)
        return v

    return walk(head["skeleton"])


