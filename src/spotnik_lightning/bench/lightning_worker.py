"""A Lightning training worker on generated data, reporting JSON lines (tests, example, benchmarks).

The data is a fixed synthetic classification problem (a random "teacher" labels Gaussian inputs;
no download), each sample carrying its index so tests can check that every sample of an epoch was
trained on exactly once. Lines: ``ready``, ``commit`` (one per committed step: step, membership,
indices trained on, attempts, replica hash), ``done`` (final parameter hash and counters),
``error``. Configuration is the cfg dict (see :func:`run`).
"""

from __future__ import annotations

import resource
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from spotnik_lightning.api import SpotnikError
from spotnik_lightning.bench.loop_worker import emit
from spotnik_lightning.lightning.strategy import CommitInfo, SpotnikStrategy
from spotnik_lightning.lightning.verify import replica_hash


class TeacherData(Dataset):
    """``n`` samples ``(x, y, index)``: x ~ N(0, 1)^dim, y = argmax of a fixed random linear map."""

    def __init__(self, n: int = 512, dim: int = 16, classes: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x @ torch.randn(dim, classes, generator=g)).argmax(1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class SyntheticImages(Dataset):
    """``n`` random 3x``side``x``side`` images with random labels (benchmarks: compute, not accuracy)."""

    def __init__(self, n: int, side: int = 32, classes: int = 10, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, side, side, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Bench(pl.LightningModule):
    """A benchmark model (``resnet50`` or ``shaped:<name>``, see :mod:`.models`) trained with SGD."""

    def __init__(self, kind: str, lr: float = 0.01, optimizer: str = "sgd") -> None:
        super().__init__()
        from spotnik_lightning.bench import models

        self.kind, self.lr, self.opt_name = kind, lr, optimizer
        self.net = models.resnet50(10) if kind == "resnet50" else models.Shaped(kind.split(":", 1)[1])
        self.last_indices: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.last_indices = idx.tolist()
        if self.kind == "resnet50":
            return nn.functional.cross_entropy(self.net(x), y)
        return self.net(x)

    def configure_optimizers(self) -> Any:
        if self.opt_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class StepTimer(pl.Callback):
    """Wall time of every training batch (start to end of ``on_train_batch_*``), the process CPU
    time (all threads) spent in it, and the period from one batch start to the next (which also
    covers data loading and everything Lightning does between batches).

    With a SpotnikStrategy, ``votes`` holds each batch's commit-vote time (0.0: no vote), and
    ``interleave=k`` (benchmarks) flips ``strategy.atomic`` every ``k`` steps (atomic first) by the
    global step count, so every member flips at the same step; ``modes`` records each batch's mode
    ("a" atomic, "p" pipelined) for comparing both in one run."""

    def __init__(self, strategy: Any = None, interleave: int = 0) -> None:
        self.strategy, self.interleave = strategy, interleave
        self.modes: list[str] = []
        self.votes: list[float] = []
        self._v = 0
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.periods: list[float] = []
        self.faults: list[int] = []  # minor page faults
        self.sys: list[float] = []  # kernel CPU time
        self._t = self._c = 0.0
        self._f, self._s = 0, 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.interleave:
            self.strategy.atomic = (trainer.global_step // self.interleave) % 2 == 0
            self.modes.append("a" if self.strategy.atomic else "p")
        if self.strategy is not None:
            self._v = self.strategy.counters.votes
        now = time.perf_counter()
        if self._t:
            self.periods.append(now - self._t)
        self._t, self._c = now, time.process_time()
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self._f, self._s = ru.ru_minflt, ru.ru_stime

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t)
        self.cpu.append(time.process_time() - self._c)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.faults.append(ru.ru_minflt - self._f)
        self.sys.append(ru.ru_stime - self._s)
        if self.strategy is not None:
            c = self.strategy.counters
            self.votes.append(c.vote_ms / 1e3 if c.votes > self._v else 0.0)


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class MLP(pl.LightningModule):
    """A small classifier; records the sample indices of its last training batch."""

    def __init__(self, dim: int = 16, hidden: int = 64, classes: int = 4, lr: float = 0.05, optimizer: str = "sgd",
                 pace_s: float = 0.0, scheduler: bool = True, n_data: int = 512) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, classes))
        self.lr, self.opt_name, self.pace_s, self.scheduler, self.n_data = lr, optimizer, pace_s, scheduler, n_data
        self.last_indices: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.last_indices = idx.tolist()
        if self.pace_s:
            time.sleep(self.pace_s)
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=True, prog_bar=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, _ = batch
        acc = (self.net(x).argmax(1) == y).float().mean()
        self.log("val_acc", acc, sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.opt_name == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TwoOptimizers(MLP):
    """Manual optimization with two optimizers (the GAN pattern): the first trains the lower layers,
    the second the upper ones on a fresh forward, each with its own scheduler stepped by hand."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.last_indices = idx.tolist()
        if self.pace_s:
            time.sleep(self.pace_s)
        opt_low, opt_high = self.optimizers()
        for opt in (opt_low, opt_high):
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
        for sched in self.lr_schedulers():
            sched.step()
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> Any:
        low = torch.optim.SGD(self.net[:2].parameters(), lr=self.lr, momentum=0.9)
        high = torch.optim.Adam(self.net[2:].parameters(), lr=self.lr / 10)
        scheds = [torch.optim.lr_scheduler.StepLR(opt, 3, 0.9) for opt in (low, high)]
        return [low, high], scheds


def build(cfg: dict) -> tuple[pl.LightningModule, DataLoader, DataLoader | None]:
    """The model and loaders described by ``cfg`` (shared with the fault-free DDP baseline)."""
    pl.seed_everything(int(cfg.get("seed", 0)), verbose=False)
    kind = cfg.get("model", "mlp")
    if kind != "mlp":
        images = SyntheticImages(int(cfg.get("n_data", 64)), side=int(cfg.get("side", 32)))
        return (Bench(kind, lr=float(cfg.get("lr", 0.01)), optimizer=cfg.get("optimizer", "sgd")),
                DataLoader(images, batch_size=int(cfg.get("batch", 2)), shuffle=False), None)
    data = TeacherData(int(cfg.get("n_data", 512)), seed=int(cfg.get("data_seed", 0)))
    cls = TwoOptimizers if cfg.get("manual") else MLP
    model = cls(lr=float(cfg.get("lr", 0.05)), optimizer=cfg.get("optimizer", "sgd"), hidden=int(cfg.get("hidden", 64)),
                pace_s=float(cfg.get("pace_s", 0.0)), scheduler=bool(cfg.get("scheduler", True)), n_data=len(data))
    train = DataLoader(data, batch_size=int(cfg.get("batch", 8)), shuffle=bool(cfg.get("shuffle", True)))
    val = DataLoader(TeacherData(64, seed=99), batch_size=32) if cfg.get("validate") else None
    return model, train, val


def _dump(model: nn.Module, cfg: dict) -> str | None:
    """Save the flat parameters to ``<cfg["dump"]>/<id>.pt`` (for exact comparisons); returns the path."""
    if not cfg.get("dump"):
        return None
    path = f"{cfg['dump']}/{cfg['id']}.pt"
    torch.save(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), path)
    return path


def run_ddp(cfg: dict) -> int:
    """The same training under Lightning's ``DDPStrategy(process_group_backend="gloo")`` (the
    baseline); cfg adds ``rank``, ``world_size``, ``master_port``."""
    import os

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["master_port"]), WORLD_SIZE=str(cfg["world_size"]),
                      RANK=str(cfg["rank"]), LOCAL_RANK=str(cfg["rank"]), NODE_RANK="0")
    model, train, val = build(cfg)
    trainer = pl.Trainer(
        strategy=pl.strategies.DDPStrategy(process_group_backend="gloo"), accelerator="cpu",
        devices=int(cfg["world_size"]), max_epochs=int(cfg.get("epochs", 1)), max_steps=int(cfg.get("max_steps", -1)),
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer := StepTimer()])
    started = time.time()
    trainer.fit(model, train)
    emit(ev="done", id=cfg["id"], step=trainer.global_step, epoch=trainer.current_epoch, wall_s=time.time() - started,
         step_times=timer.times, step_cpu=timer.cpu, step_periods=timer.periods, step_faults=timer.faults,
         step_sys=timer.sys, rss_mb=_rss_mb(),
         hash=replica_hash(model, trainer.optimizers),
         params=_dump(model, cfg))
    return 0


def run(cfg: dict) -> int:
    """cfg: store, run_id, id, world_size (founders; None = join), epochs, max_steps, batch, n_data,
    optimizer, lr, pace_s, accumulate, clip, validate, verify, hb_ms, hb_timeout_ms, tier, policy,
    global_batch, ckpt_dir, every_n_steps, resume (checkpoint path)."""
    torch.set_num_threads(1)
    if cfg.get("log_level"):
        import logging

        logging.basicConfig(level=cfg["log_level"], format=f"%(asctime)s {cfg['id']} %(name)s %(message)s")
    model, train, val = build(cfg)
    strategy = SpotnikStrategy(
        cfg["store"], run_id=cfg["run_id"], member_id=cfg["id"], world_size=cfg.get("world_size"),
        tier=cfg.get("tier"), heartbeat_ms=cfg.get("hb_ms", 100), heartbeat_timeout_ms=cfg.get("hb_timeout_ms", 1000),
        batch_policy=cfg.get("policy", "per_worker"), global_batch=cfg.get("global_batch"),
        verify_replicas=bool(cfg.get("verify", True)), seed=int(cfg.get("seed", 0)),
        bucket_mb=float(cfg.get("bucket_mb", 25.0)), atomic=bool(cfg.get("atomic", True)),
        lr_scaling=bool(cfg.get("lr_scaling", False)), sync=cfg.get("sync", "ssgd"),
        sma_period=int(cfg.get("sma_k", 4)))
    started = time.time()
    switch_at = {int(s): name for s, name in cfg.get("switch_at", [])}  # committed step -> requested mode

    perturb = cfg.get("perturb_at")  # test hook: this member's parameters drift after that step

    def on_commit(info: CommitInfo) -> None:
        if perturb is not None and info.step == perturb:
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)
        if info.step in switch_at:
            strategy.request_sync(switch_at[info.step])
        if cfg.get("quiet"):
            return
        emit(ev="commit", id=cfg["id"], step=info.step, epoch=info.epoch, rank=info.rank, world=info.world,
             members=info.members, plans=info.plans, indices=info.indices, seen=model.last_indices,
             attempts=info.attempts, hash=info.replica_hash, sync=strategy.sync_mode)

    strategy.commit_listeners.append(on_commit)
    timer = StepTimer(strategy, int(cfg.get("interleave", 0)))
    callbacks: list[pl.Callback] = [timer]
    if cfg.get("adaptive"):
        callbacks.append(_adaptive(cfg["adaptive"]))
    if cfg.get("young_daly"):
        from spotnik_lightning.lightning.checkpointing import YoungDalyCheckpoint

        callbacks.append(YoungDalyCheckpoint(dirpath=cfg["ckpt_dir"], filename="{step}", save_top_k=-1,
                                             **cfg["young_daly"]))
    elif cfg.get("ckpt_dir"):
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=cfg["ckpt_dir"], every_n_train_steps=int(
            cfg.get("every_n_steps", 5)), save_top_k=-1, filename="{step}"))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_epochs=int(cfg.get("epochs", 1)),
        max_steps=int(cfg.get("max_steps", -1)), accumulate_grad_batches=int(cfg.get("accumulate", 1)),
        gradient_clip_val=cfg.get("clip"),
        logger=pl.loggers.CSVLogger(cfg["logger_dir"], name=cfg["id"]) if cfg.get("logger_dir") else False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=int(cfg.get("log_every", 1)),
        enable_checkpointing=bool(cfg.get("ckpt_dir")), callbacks=callbacks, num_sanity_val_steps=0,
        limit_val_batches=1.0 if val is not None else 0)
    emit(ev="ready", id=cfg["id"])
    try:
        trainer.fit(model, train, val, ckpt_path=cfg.get("resume"))
    except SpotnikError as exc:
        emit(ev="error", id=cfg["id"], error=f"{type(exc).__name__}: {exc}")
        return 6
    except SystemExit as exc:  # SIGTERM: the strategy left the ring after a committed step
        emit(ev="left", id=cfg["id"], step=trainer.global_step, leaves=strategy.counters.leaves)
        return 0 if exc.code in (None, 0) else 1
    emit(ev="done", id=cfg["id"], step=trainer.global_step, epoch=trainer.current_epoch,
         hash=replica_hash(model, trainer.optimizers), changes=strategy.counters.changes,
         retried=strategy.counters.retried_steps, joins=strategy.counters.joins, leaves=strategy.counters.leaves,
         resyncs=strategy.counters.resyncs, votes=strategy.counters.votes, vote_ms=strategy.counters.vote_ms_total,
         wall_s=time.time() - started, step_times=timer.times, step_cpu=timer.cpu,
         step_periods=timer.periods, step_faults=timer.faults, step_sys=timer.sys, rss_mb=_rss_mb(),
         step_modes=timer.modes, step_votes=timer.votes, lr=trainer.optimizers[0].param_groups[0]["lr"],
         metrics={k: float(v) for k, v in trainer.progress_bar_metrics.items() if k.startswith("spotnik/")},
         params=_dump(model, cfg), sync=strategy.sync_mode, switches=strategy.sync_switches,
         gossip={"averaged": strategy._adpsgd.averaged, "skipped": strategy._adpsgd.skipped},
         acc=_accuracy(model, train.dataset))
    return 0


def _accuracy(model: pl.LightningModule, data: Dataset) -> float | None:
    """Training-set accuracy of an MLP (None for the benchmark models)."""
    if not isinstance(model, MLP) or not isinstance(data, TeacherData):
        return None
    with torch.no_grad():
        return float((model.net(data.x).argmax(1) == data.y).float().mean())


def _adaptive(spec: dict) -> pl.Callback:
    """An AdaptiveSync callback from cfg: {"policy": "world", "n": 3} or {"policy": "throughput",
    "fraction": 0.4}, optional "low"/"high" mode names."""
    from spotnik_lightning.lightning.adaptive import AdaptiveSync, ThroughputTrigger, WorldSizeThreshold

    low, high = spec.get("low", "adpsgd"), spec.get("high", "ssgd")
    if spec["policy"] == "world":
        return AdaptiveSync(WorldSizeThreshold(int(spec["n"]), low=low, high=high))
    return AdaptiveSync(ThroughputTrigger(float(spec.get("fraction", 0.4)), low=low, high=high,
                                          window=int(spec.get("window", 5))))
