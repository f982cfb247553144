"""Manual optimization for :class:`~spotnik_lightning.lightning.strategy.SpotnikStrategy` (a mixin).

A manual ``training_step`` may call ``opt.step()`` several times (several optimizers), and a step
already applied cannot be discarded. So the whole ``training_step`` is the atomic unit: it runs on a
snapshot of model, optimizer and scheduler states and Lightning's optimizer-step counter; when any
``opt.step()`` in it fails, every member restores the snapshot and the step reruns on the new
membership. The snapshot is one extra copy of those states — the price of undoing an applied step.
"""

from __future__ import annotations

import copy
from typing import Any

from spotnik_lightning.lightning.commit import StepDiscarded, Vote


class ManualSteps:
    """Mixin: needs the strategy's ``_manual``, ``_reducer``, ``_loader``, ``_recover``,
    ``_after_commit``, ``_rebuild_step``, ``counters`` and Lightning's strategy attributes."""

    _manual: bool
    _reducer: Any
    _loader: Any
    _left: bool
    _attempts: int
    _vote: Any
    _rebuilt: Any
    counters: Any
    lightning_module: Any
    optimizers: Any
    lr_scheduler_configs: Any
    world_size: int

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Manual optimization: the whole ``training_step`` is the atomic unit. It runs on a
        snapshot of model, optimizer and scheduler states; if any ``opt.step()`` in it fails, the
        snapshot is restored on every member and the step reruns on the new membership."""
        if not self._manual or self._reducer is None or self._loader is None or self._left:
            return super().training_step(*args, **kwargs)
        self._attempts = 0
        while True:
            snap = self._snapshot()
            self._vote = None
            try:
                out = super().training_step(*args, **kwargs)
            except StepDiscarded as d:
                self._attempts += 1
                self._restore(snap)
                res = self._recover(d)
                if res.outcome == "adopted":  # a peer finished this step: its state (and count) is ours now
                    self._after_commit(Vote(self.world_size), advance=False, post=False)
                    return None
                self.counters.retried_steps += 1
                self._rebuild_step(None, None)
                args = (self._rebuilt, *args[1:])
                continue
            self._after_commit(self._vote or Vote(self.world_size))
            return out

    def _snapshot(self) -> dict[str, Any]:
        model = self.lightning_module
        progress = model.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "progress": copy.deepcopy(progress.state_dict()),
                "opt": [copy.deepcopy(o.state_dict()) for o in self.optimizers],
                "sched": [copy.deepcopy(c.scheduler.state_dict()) for c in self.lr_scheduler_configs]}

    def _restore(self, snap: dict[str, Any]) -> None:
        self.lightning_module.load_state_dict(snap["model"])
        trainer = self.lightning_module.trainer
        trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress.load_state_dict(snap["progress"])
        for o, sd in zip(self.optimizers, snap["opt"], strict=True):
            o.load_state_dict(sd)
            o.zero_grad(set_to_none=True)
        for c, sd in zip(self.lr_scheduler_configs, snap["sched"], strict=True):
            c.scheduler.load_state_dict(sd)
