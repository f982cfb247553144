"""A hash of a replica's training state, to check that replicas are bit-identical."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def _feed(h: hashlib._Hash, value: object) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous().cpu()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            _feed(h, value[k])
    elif isinstance(value, (list, tuple)):
        for v in value:
            _feed(h, v)
    else:
        h.update(repr(value).encode())


def replica_hash(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> str:
    """SHA-1 (hex) over every parameter and the full state of every optimizer (per-parameter state
    and hyper-parameters). Equal hashes mean bit-identical replicas."""
    h = hashlib.sha1()
    for name, p in module.named_parameters():
        h.update(name.encode())
        _feed(h, p)
    for opt in optimizers:
        _feed(h, opt.state_dict())
    return h.hexdigest()
