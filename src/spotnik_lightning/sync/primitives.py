"""Synchronisation primitives on a :class:`RingGroup`, for model averaging.

Everything here moves *model state* (parameters, buffers, optimizer state), not gradients (the
gradient all-reduce is :class:`~spotnik_lightning.sync.reducer.GradientReducer`). Tensors are
flattened into one contiguous buffer per dtype, so a model of any shape costs one collective per
dtype. Ring errors (e.g. :class:`MembershipChanged`) propagate to the caller; on an error the
tensors are left untouched.

* :func:`average_all` — ``t ← (1/n) Σ_members t`` (ring all-reduce "avg"; bit-identical everywhere);
* :func:`complete_optimizer_state` — before averaging optimizer state: members lacking a parameter's
  state (that others have) get fresh, zeroed state of the same layout;
* :func:`publish_model` — put a snapshot of the tensors in this member's served cache (local copy);
* :func:`average_with_snapshot` — ``t ← (t + t_peer) / 2`` with the latest snapshot a peer published,
  fetched from the peer's served cache without involving the peer's training thread (one-sided).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import torch

from spotnik_lightning.ring.group import RingGroup

MODEL = "model"  # the snapshot name model averaging publishes under


def _groups(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    by: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() and t.numel():
            by.setdefault(t.dtype, []).append(t)
    return list(by.values())


def _flat(group: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in group])


def _unflat(group: list[torch.Tensor], flat: torch.Tensor) -> None:
    with torch.no_grad():
        off = 0
        for t in group:
            n = t.numel()
            t.copy_(flat[off:off + n].view_as(t))
            off += n


def average_all(ring: RingGroup, tensors: Iterable[torch.Tensor]) -> int:
    """Replace every floating tensor by its mean over the ring's members (non-floating tensors are
    skipped). One all-reduce per dtype, issued in a fixed order (dtypes in first-seen order), so
    every member must pass the same tensors in the same order. Returns the bytes reduced."""
    nbytes = 0
    flats = []
    for group in _groups(tensors):
        flat = _flat(group)
        ring.all_reduce(flat, "avg")
        flats.append((group, flat))
        nbytes += flat.numel() * flat.element_size()
    for group, flat in flats:  # only after every collective succeeded: all or nothing locally
        _unflat(group, flat)
    return nbytes


def complete_optimizer_state(ring: RingGroup, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Give every member optimizer state for the same parameters, so that :func:`average_all` can
    average it: a parameter that has state on some members but none on others (a joiner that has
    not stepped yet, a parameter no local gradient reached in a model-averaging mode) gets *fresh*
    state on the members lacking it — the lowest such holder's layout with every tensor and number
    zeroed (zero momentum, zero Adam moments and step), which the average then mixes in. One
    all-gather of a byte per parameter; only when layouts differ, two more to exchange the
    missing layouts. Every member must call it with the same optimizers (same parameter order).
    Returns the number of parameters that got state here. Ring errors propagate (nothing changed)."""
    states = [(opt.state, p) for opt in optimizers for g in opt.param_groups for p in g["params"]]
    mine = torch.tensor([1 if state.get(p) else 0 for state, p in states], dtype=torch.uint8)
    n = ring.size
    masks = torch.empty(n * len(states), dtype=torch.uint8)
    ring.all_gather(masks, mine)
    rows = masks.view(n, len(states))
    mixed = [i for i in range(len(states)) if 0 < int(rows[:, i].sum()) < n]
    if not mixed:
        return 0
    holder = {i: int(rows[:, i].nonzero()[0]) for i in mixed}  # the lowest rank with state
    layout = {i: _layout(states[i][0][states[i][1]]) for i in mixed if holder[i] == ring.rank}
    blob = torch.frombuffer(bytearray(json.dumps(layout).encode()), dtype=torch.uint8)
    sizes = torch.empty(n, dtype=torch.int64)
    ring.all_gather(sizes, torch.tensor([blob.numel()], dtype=torch.int64))
    width = int(sizes.max())
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[:blob.numel()] = blob
    blobs = torch.empty(n * width, dtype=torch.uint8)
    ring.all_gather(blobs, padded)
    layouts: dict[str, dict] = {}
    for r in range(n):
        layouts.update(json.loads(bytes(blobs[r * width:r * width + int(sizes[r])].tolist()) or b"{}"))
    filled = 0
    for i in mixed:
        if not rows[ring.rank, i]:
            state, p = states[i]
            state[p] = _fresh(layouts[str(i)])
            filled += 1
    return filled


def _layout(state: dict) -> dict:
    out = {}
    for key, v in state.items():
        if isinstance(v, torch.Tensor):
            out[key] = ["tensor", list(v.shape), str(v.dtype).removeprefix("torch.")]
        elif isinstance(v, bool | int | float):
            out[key] = ["number", type(v).__name__]
        else:  # e.g. a flag or a name some optimizer keeps: copied as is (None if not JSON)
            try:
                out[key] = ["value", json.loads(json.dumps(v))]
            except (TypeError, ValueError):
                out[key] = ["value", None]
    return out


def _fresh(layout: dict) -> dict:
    out: dict = {}
    for key, (kind, *rest) in layout.items():
        if kind == "tensor":
            out[key] = torch.zeros(rest[0], dtype=getattr(torch, rest[1]))
        elif kind == "number":
            out[key] = {"bool": False, "int": 0, "float": 0.0}[rest[0]]
        else:
            out[key] = rest[0]
    return out


def _snapshot_order(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The floating, non-empty tensors in the byte layout of a model snapshot: by element size,
    largest first (stable), so every tensor starts at an offset aligned to its element size."""
    floats = [t for t in tensors if t.is_floating_point() and t.numel()]
    return sorted(floats, key=lambda t: -t.element_size())


def publish_model(ring: RingGroup, tensors: Iterable[torch.Tensor], version: int, name: str = MODEL) -> int:
    """Publish the floating tensors as this member's snapshot ``name`` (one copy into the ring's
    served cache, no communication). Returns the snapshot's size in bytes."""
    return ring.publish(name, _snapshot_order(tensors), version)


def snapshot_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The size of :func:`publish_model`'s snapshot of ``tensors``."""
    return sum(t.numel() * t.element_size() for t in _snapshot_order(tensors))


def load_snapshot(tensors: Iterable[torch.Tensor], buf: torch.Tensor) -> None:
    """Overwrite the floating tensors with a snapshot of the same layout (see :func:`publish_model`)."""
    with torch.no_grad():
        off = 0
        for t in _snapshot_order(tensors):
            n = t.numel() * t.element_size()
            t.copy_(buf[off:off + n].view(t.dtype).view(t.shape))
            off += n


def average_snapshot(tensors: Sequence[torch.Tensor], buf: torch.Tensor) -> None:
    """``t ← (t + t_snap) / 2`` for every floating tensor, with a snapshot of the same layout (see
    :func:`publish_model`) in ``buf``."""
    with torch.no_grad():
        off = 0
        for t in _snapshot_order(tensors):
            n = t.numel() * t.element_size()
            t.add_(buf[off:off + n].view(t.dtype).view(t.shape)).div_(2)
            off += n


def average_with_snapshot(ring: RingGroup, tensors: Sequence[torch.Tensor], peer: int | str, min_version: int,
                          scratch: torch.Tensor | None = None, name: str = MODEL) -> tuple[int, torch.Tensor]:
    """``t ← (t + t_peer) / 2`` for every floating tensor, where ``t_peer`` is the latest snapshot
    member ``peer`` published with :func:`publish_model` (same layout), of version at least
    ``min_version``. One-sided: only this member's tensors change, and the peer's training thread
    takes no part (its ring I/O threads serve the snapshot). Returns ``(version, buffer)``; pass the
    buffer back as ``scratch`` to reuse it. Raises FetchError (the tensors are then untouched)."""
    nbytes = snapshot_bytes(tensors)
    buf = scratch if scratch is not None and scratch.numel() == nbytes else torch.empty(nbytes, dtype=torch.uint8)
    version = ring.fetch(peer, name, buf, min_version=min_version)
    average_snapshot(tensors, buf)
    return version, buf
