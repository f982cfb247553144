"""What a donor sends a joining (or lagging) member, and how the receiver applies it.

The payload is Lightning's own checkpoint dict (model, optimizers, LR schedulers, loop progress,
callback states — ``dump_checkpoint``), plus a ``"spotnik"`` entry: committed step count, data
cursor and the plans already made but not committed, and the RNG states. The donor is taken at a
step boundary so the receiver starts exactly where the donor is.
It travels in the packed form of :mod:`.packing` (one flat buffer per dtype, no pickling of
tensor data).
"""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import torch

from spotnik_lightning.lightning.packing import pack

try:  # numpy is optional for Lightning; keep its RNG in step when it is there
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
    np = None  # type: ignore[assignment]


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])


def capture(trainer: pl.Trainer, extra: dict[str, Any], light: bool = False) -> list[torch.Tensor]:
    """The trainer's full training state plus ``extra`` (the strategy's own state), packed.
    ``light``: without the model weights and the optimizers' per-parameter state (the receiver
    holds a model snapshot of its own and starts with fresh optimizer state; param groups, i.e.
    learning rates, are kept)."""
    ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    if light:
        ckpt["state_dict"] = {}
        ckpt["optimizer_states"] = [{"state": {}, "param_groups": o["param_groups"]} for o in ckpt["optimizer_states"]]
    ckpt["spotnik"] = {**extra, "rng": rng_state(), "light": light}
    return pack(ckpt)


def apply_training_state(trainer: pl.Trainer, ckpt: dict[str, Any], *, loops: bool) -> None:
    """Load model, optimizer and scheduler states (and, with ``loops``, loop progress and callback
    states) from a donor's payload into this member's trainer; then adopt the donor's RNG. A light
    payload (see :func:`capture`) leaves the model alone and empties the optimizers' state.

    Loop progress is loaded as settled counters (ready = completed), so the receiver's next batch is
    the donor's next batch, not a restart of a half-done one.
    """
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = ckpt
    try:
        if not ckpt["spotnik"].get("light"):  # a light payload has no model: the receiver keeps its own
            connector.restore_model()
        if loops:
            connector.restore_callbacks()
        connector.restore_optimizers_and_schedulers()
    finally:
        connector._loaded_checkpoint = {}
    if loops:
        fit_loop = trainer.fit_loop
        fit_loop.load_state_dict(ckpt["loops"]["fit_loop"])
        fit_loop.restarting = False
        epoch_loop = fit_loop.epoch_loop
        for progress in (fit_loop.epoch_progress, epoch_loop.batch_progress, epoch_loop.scheduler_progress,
                         epoch_loop.automatic_optimization.optim_progress, epoch_loop.val_loop.batch_progress):
            progress.reset_on_restart()
    set_rng_state(ckpt["spotnik"]["rng"])
