"""SpotnikStrategy end to end: real Lightning Trainers in real processes on a real ring.

Every fault test checks invariants, not just exit codes: replicas bit-identical after every commit
(``verify_replicas`` all-gathers a hash; the reported hashes are compared here too), committed step
numbers contiguous and equal everywhere, every sample of every epoch in exactly one committed plan
and trained on by exactly one member, survivors' PIDs unchanged, the run finishing.
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from spotnik_lightning.bench.cluster import LocalCluster
from tests.helpers import free_port

WORKER = "spotnik_lightning.bench.lightning_worker"
PRELOAD = ("lightning.pytorch", WORKER)
N_DATA = 192


def cluster(url: str, **defaults: object) -> LocalCluster:
    cfg = dict(entry=f"{WORKER}:run", epochs=1, n_data=N_DATA, batch=4, pace_s=0.01, hb_ms=100, hb_timeout_ms=1000)
    cfg.update(defaults)
    return LocalCluster(url, f"lt-{uuid.uuid4().hex[:8]}", preload=PRELOAD, **cfg)


def finished(c: LocalCluster, ids: list[str], timeout: float = 120) -> dict[str, dict]:
    return c.wait_all(ids, lambda e: e["ev"] in ("done", "error", "left"), timeout, "the end of training")


def lose_all_after_checkpoint(c: LocalCluster, ids: list[str], ckpt: Path, step: int, timeout: float = 60) -> None:
    """Wait (bounded) until step ``step`` is committed and ``ckpt`` is written, then SIGKILL every
    worker in ``ids`` at once: every VM revoked."""
    c.wait_for(lambda e: e["ev"] == "commit" and e["step"] == step, timeout, f"step {step}")
    deadline = time.monotonic() + timeout
    while not ckpt.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint {ckpt} not written within {timeout:.0f} s after step {step}")
        time.sleep(0.05)
    for mid in ids:
        c.signal(mid, signal.SIGKILL)


def check_run(c: LocalCluster, survivors: list[str], n_data: int = N_DATA, epochs: int = 1,
              complete: bool = True, optimizer_steps: int = 1) -> dict[int, list[dict]]:
    """Assert the invariants over the whole run; returns the commit events by step."""
    ends = finished(c, survivors)
    for mid, ev in ends.items():
        assert ev["ev"] == "done", f"{mid} did not finish: {ev}"
        assert ev["pid"] == c.pids[mid], f"{mid} was restarted"
    assert len({e["hash"] for e in ends.values()}) == 1, "replicas differ at the end"
    assert len({e["step"] for e in ends.values()}) == 1
    by_step: dict[int, list[dict]] = defaultdict(list)
    for e in c.of("commit"):
        by_step[e["step"]].append(e)
    steps = sorted(by_step)
    assert steps == list(range(1, len(steps) + 1)), "committed step numbers are not contiguous"
    assert steps[-1] * optimizer_steps == next(iter(ends.values()))["step"], "Lightning's step counter is off"
    per_epoch: dict[int, list[tuple[int, int]]] = defaultdict(list)
    trained: dict[int, list[int]] = defaultdict(list)
    for s in steps:
        evs = by_step[s]
        assert len({e["hash"] for e in evs}) == 1, f"replicas differ after step {s}"
        assert len({str(e["plans"]) for e in evs}) == 1 and len({e["epoch"] for e in evs}) == 1
        world = evs[0]["world"]
        assert len(evs) <= world and len({e["rank"] for e in evs}) == len(evs)
        for e in evs:
            # the model's last micro-batch is the tail of the member's counted samples of the step
            assert not e["indices"] or e["indices"][-len(e["seen"]):] == e["seen"], "trained on unplanned samples"
        mine = [i for e in evs for i in e["indices"]]
        assert len(mine) == len(set(mine)), f"a sample was trained on twice in step {s}"
        size = sum(p[2] for p in evs[0]["plans"])
        if len(evs) == world:  # everybody reported: the members' slices are exactly the plan
            assert len(mine) == size
        else:  # a member died right after this commit: its share is in the update but unreported
            assert len(mine) < size
        for ep, start, n in evs[0]["plans"]:
            per_epoch[ep].append((start, n))
            trained[ep].extend(mine if len(evs[0]["plans"]) == 1 else [])
    for ep in range(epochs if complete else 0):
        ranges = sorted(per_epoch[ep])
        pos = 0
        for start, n in ranges:
            assert start == pos, f"epoch {ep}: plans leave a gap or overlap at {pos}"
            pos += n
        assert pos == n_data, f"epoch {ep}: plans cover {pos} of {n_data} samples"
        assert len(trained[ep]) == len(set(trained[ep])), "a sample was trained on twice in an epoch"
    return by_step


@pytest.mark.parametrize("point,workers,kills", [
    ("backward", 4, 1), ("between_buckets", 5, 2), ("vote", 4, 1), ("after_commit", 6, 3)])
def test_kill_at_a_chosen_point_of_a_step(embedded_server, point: str, workers: int, kills: int) -> None:
    ids = [f"w{i}" for i in range(workers)]
    victims = ids[1:1 + kills]
    with cluster(embedded_server.url, bucket_mb=0.005) as c:
        for mid in ids:
            c.spawn(mid, world_size=workers, env={"SPOTNIK_FAULT": f"{point}@4"} if mid in victims else {})
        survivors = [i for i in ids if i not in victims]
        by_step = check_run(c, survivors)
        for mid in victims:
            assert c.exited.get(c.pids[mid]) == -signal.SIGKILL
        # "<point>@4": the victims die in step 5 (4 steps committed)
        assert by_step[4][0]["world"] == workers
        assert by_step[5][0]["world"] == (workers if point == "after_commit" else workers - kills)
        assert by_step[6][0]["world"] == workers - kills
        ends = {e["id"]: e for e in c.of("done")}
        if point != "after_commit":  # the step the victims died in was discarded and recomputed
            assert all(e["retried"] >= 1 for e in ends.values())
            assert {e["attempts"] for e in by_step[5]} == {2}


def test_random_kills_and_a_stopped_member(embedded_server) -> None:
    ids = [f"w{i}" for i in range(6)]
    rng = random.Random(7)
    with cluster(embedded_server.url, pace_s=0.03, epochs=2) as c:
        for mid in ids:
            c.spawn(mid, world_size=6)
        c.wait_for(lambda e: e["ev"] == "commit" and e["step"] == 2, 60, "step 2")
        time.sleep(rng.uniform(0.0, 0.3))  # a random point of a step
        c.signal("w2", signal.SIGKILL)
        c.wait_for(lambda e: e["ev"] == "commit" and e["world"] == 5, 60, "a step on 5 members")
        time.sleep(rng.uniform(0.0, 0.3))
        c.signal("w4", signal.SIGKILL)
        c.signal("w5", signal.SIGSTOP)  # silent: found by the heartbeat deadline
        c.wait_for(lambda e: e["ev"] == "commit" and e["world"] == 3, 60, "a step on 3 members")
        c.signal("w5", signal.SIGCONT)
        fenced = c.wait_for(lambda e: e.get("id") == "w5" and e["ev"] in ("error", "done"), 60, "w5 after SIGCONT")
        assert fenced["ev"] == "error" and "fenced" in fenced["error"].lower()
        check_run(c, ["w0", "w1", "w3"], epochs=2)


def test_sigterm_leave_loses_nothing_and_a_joiner_catches_up(embedded_server) -> None:
    ids = [f"w{i}" for i in range(4)]
    with cluster(embedded_server.url, pace_s=0.03, epochs=2, optimizer="adam") as c:
        for mid in ids:
            c.spawn(mid, world_size=4)
        c.wait_for(lambda e: e["ev"] == "commit" and e["step"] == 3, 60, "step 3")
        c.signal("w1", signal.SIGTERM)
        left = c.wait_for(lambda e: e.get("id") == "w1" and e["ev"] in ("left", "error", "done"), 60, "w1 leaving")
        assert left["ev"] == "left" and left["leaves"] == 1
        c.wait_for(lambda e: e.get("pid") == c.pids["w1"] and e["ev"] == "exit", 30, "w1 exit")
        assert c.exited[c.pids["w1"]] == 0
        c.spawn("j0")
        by_step = check_run(c, ["w0", "w2", "w3", "j0"], epochs=2)
        ends = {e["id"]: e for e in c.of("done")}
        assert all(e["retried"] == 0 for e in ends.values()), "a noticed leave or a join made someone retry"
        assert [e["outcome"] for e in ends["j0"]["resyncs"]][:1] == ["adopted"]
        assert any(len(evs) == 4 and "j0" in evs[0]["members"] for evs in by_step.values())
        assert ends["w0"]["joins"] == 1 and ends["w0"]["leaves"] == 1


def test_a_kill_inside_lightnings_own_collectives(embedded_server, tmp_path: Path) -> None:
    # ModelCheckpoint every 4 steps broadcasts its path and passes barriers: v1 dies entering the
    # first of those after step 8; the others are inside it, retry it on 2 members and go on.
    with cluster(embedded_server.url, validate=True, epochs=2, ckpt_dir=str(tmp_path), every_n_steps=4) as c:
        for i in range(3):
            c.spawn(f"v{i}", world_size=3, env={"SPOTNIK_FAULT": "collective@8"} if i == 1 else {})
        by_step = check_run(c, ["v0", "v2"], epochs=2)
        assert c.exited.get(c.pids["v1"]) == -signal.SIGKILL
        assert by_step[8][0]["world"] == 3 and by_step[9][0]["world"] == 2
    assert (tmp_path / "step=12.ckpt").exists()


@pytest.mark.parametrize("nth", [1, 2])
def test_a_kill_right_after_a_lightning_collective_completed(embedded_server, tmp_path: Path, nth: int) -> None:
    # ModelCheckpoint's save at step 8 runs two collectives here; v1 dies right after its nth one
    # completed, so the others meet the change in that one or in the next, in Lightning's code or
    # in the next training step — and must still agree on everything after.
    with cluster(embedded_server.url, epochs=2, ckpt_dir=str(tmp_path), every_n_steps=8) as c:
        for i in range(4):
            c.spawn(f"v{i}", world_size=4, env={"SPOTNIK_FAULT": f"collective_done@8#{nth}"} if i == 1 else {})
        check_run(c, ["v0", "v2", "v3"], epochs=2)
        assert c.exited.get(c.pids["v1"]) == -signal.SIGKILL
    assert (tmp_path / "step=16.ckpt").exists()


def test_verify_replicas_fails_loudly_on_divergence(embedded_server) -> None:
    with cluster(embedded_server.url) as c:
        for i in range(3):  # d1's parameters drift after step 3: every member must stop at step 4
            c.spawn(f"d{i}", world_size=3, **({"perturb_at": 3} if i == 1 else {}))
        ends = finished(c, ["d0", "d1", "d2"])
    assert {e["ev"] for e in ends.values()} == {"error"}
    assert all("ReplicaDivergenceError" in e["error"] and "after step 4" in e["error"] for e in ends.values())


def test_young_daly_checkpoint_interval_is_agreed_and_applied(embedded_server, tmp_path: Path) -> None:
    from spotnik_lightning.lightning.checkpointing import young_daly_steps

    assert young_daly_steps(cost_s=2.0, mttf_s=3600.0, step_s=0.5) == 240  # sqrt(2 * 2 * 3600) / 0.5
    assert young_daly_steps(cost_s=2.0, mttf_s=3600.0, step_s=0.5, hi=100) == 100
    # initially every 4 steps; from step 8 on the agreed interval (clamped to 3 here) applies
    yd = dict(initial_every=4, update_every=8, min_every=3, max_every=3)
    with cluster(embedded_server.url, ckpt_dir=str(tmp_path), young_daly=yd) as c:
        for i in range(3):
            c.spawn(f"y{i}", world_size=3)
        check_run(c, ["y0", "y1", "y2"])
    saved = sorted(int(p.stem.split("=")[1]) for p in tmp_path.glob("step=*.ckpt"))
    assert saved[:4] == [4, 9, 12, 15], saved  # 8 is not a multiple of the new interval


def test_the_donor_dies_while_sending_state_to_a_joiner(embedded_server) -> None:
    ids = [f"w{i}" for i in range(3)]
    with cluster(embedded_server.url, pace_s=0.03, epochs=2) as c:
        for mid in ids:  # w0 is the reliable-tier member: the preferred donor, and it dies while sending
            extra = dict(tier="reliable", env={"SPOTNIK_FAULT": "state_send@*"}) if mid == "w0" else {}
            c.spawn(mid, world_size=3, **extra)
        c.wait_for(lambda e: e["ev"] == "commit" and e["step"] == 3, 60, "step 3")
        c.spawn("j0")
        c.wait_for(lambda e: e.get("pid") == c.pids["w0"] and e["ev"] == "exit", 60, "the donor's death")
        by_step = check_run(c, ["w1", "w2", "j0"], epochs=2)
        ends = {e["id"]: e for e in c.of("done")}
        assert [r["outcome"] for r in ends["j0"]["resyncs"]][-1] == "adopted"
        assert any(evs[0]["world"] == 3 and "j0" in evs[0]["members"] for evs in by_step.values())


def test_pipelined_commit_interleaved_with_atomic(embedded_server) -> None:
    """The benchmark's comparison run: every member flips ``atomic`` every other step. Pipelined
    steps skip the vote (none is counted or timed) and still leave identical replicas fault-free."""
    ids = [f"w{i}" for i in range(3)]
    with cluster(embedded_server.url, interleave=2, pace_s=0.0) as c:
        for mid in ids:
            c.spawn(mid, world_size=3)
        check_run(c, ids)
        ends = {e["id"]: e for e in c.of("done")}
    for e in ends.values():
        modes = "".join(e["step_modes"])
        assert modes == ("aapp" * len(modes))[:len(modes)] and len(modes) == e["step"] == N_DATA // (3 * 4)
        assert [m for m, v in zip(modes, e["step_votes"], strict=True) if v > 0] == ["a"] * modes.count("a")
        assert e["votes"] == modes.count("a") and e["vote_ms"] > 0


def test_accumulation_clipping_validation_and_metrics(embedded_server, tmp_path: Path) -> None:
    ids = [f"w{i}" for i in range(3)]
    with cluster(embedded_server.url, accumulate=2, clip=0.5, validate=True, epochs=2,
                 logger_dir=str(tmp_path)) as c:
        for mid in ids:
            c.spawn(mid, world_size=3, env={"SPOTNIK_FAULT": "vote@5"} if mid == "w2" else {})
        by_step = check_run(c, ["w0", "w1"], epochs=2)
        for evs in by_step.values():  # two micro-batches per step, except a window cut by the epoch's end
            plans = evs[0]["plans"]
            assert len(plans) == 2 or plans[-1][1] + plans[-1][2] == N_DATA, plans
        ends = {e["id"]: e for e in c.of("done")}
        assert ends["w0"]["metrics"]["spotnik/world"] == 2.0 and ends["w0"]["metrics"]["spotnik/epoch"] >= 2
        # w2 died before its vote: nobody completed that vote, so every committed step had one completed vote
        assert ends["w0"]["votes"] == ends["w0"]["step"] and ends["w0"]["vote_ms"] > 0
    logged = "".join(p.read_text() for p in tmp_path.rglob("metrics.csv"))
    assert "spotnik/retried_steps" in logged and "spotnik/recovery_ms" in logged and "val_acc" in logged
    assert "spotnik/vote_ms" in logged


def test_global_batch_policy_and_linear_lr_scaling(embedded_server) -> None:
    with cluster(embedded_server.url, policy="global", global_batch=12) as c:
        for i in range(4):
            c.spawn(f"g{i}", world_size=4, env={"SPOTNIK_FAULT": "vote@3"} if i == 1 else {})
        by_step = check_run(c, ["g0", "g2", "g3"])
        assert {evs[0]["world"] for evs in by_step.values()} == {3, 4}
        assert all(evs[0]["plans"][0][2] == 12 for evs in by_step.values()), "the global batch changed"
    with cluster(embedded_server.url, lr_scaling=True, scheduler=False, lr=0.04) as c:
        for i in range(4):
            c.spawn(f"s{i}", world_size=4, env={"SPOTNIK_FAULT": "vote@3"} if i == 1 else {})
        check_run(c, ["s0", "s2", "s3"])
        assert {e["lr"] for e in c.of("done")} == {0.04 * 3 / 4}


def test_a_kill_with_the_etcd_store(etcd_server) -> None:
    with cluster(etcd_server.url) as c:
        for i in range(4):
            c.spawn(f"e{i}", world_size=4, env={"SPOTNIK_FAULT": "between_buckets@3"} if i == 2 else {})
        by_step = check_run(c, ["e0", "e1", "e3"])
        assert by_step[4][0]["world"] == 3 and {e["attempts"] for e in by_step[4]} == {2}


def test_manual_optimization_with_two_optimizers_rolls_back_a_half_done_step(embedded_server) -> None:
    ids = [f"w{i}" for i in range(4)]
    with cluster(embedded_server.url, manual=True, epochs=1) as c:
        for mid in ids:  # w1 dies in the vote of the second opt.step() of step 5: the first one applied
            c.spawn(mid, world_size=4, env={"SPOTNIK_FAULT": "vote@4#2"} if mid == "w1" else {})
        by_step = check_run(c, ["w0", "w2", "w3"], optimizer_steps=2)
        assert {e["attempts"] for e in by_step[5]} == {2} and by_step[5][0]["world"] == 3
        ends = {e["id"]: e for e in c.of("done")}
        assert all(e["retried"] == 1 for e in ends.values())


def test_fault_free_matches_lightning_ddp_gloo(embedded_server, tmp_path: Path) -> None:
    import torch

    world, common = 4, dict(epochs=1, n_data=128, batch=4, pace_s=0.0, dump=str(tmp_path))
    with cluster(embedded_server.url, **common) as c:
        for i in range(world):
            c.spawn(f"w{i}", world_size=world)
        ends = finished(c, [f"w{i}" for i in range(world)])
    assert len({e["hash"] for e in ends.values()}) == 1
    port = free_port()
    with cluster(embedded_server.url, **{**common, "entry": f"{WORKER}:run_ddp"}) as c:
        for i in range(world):
            c.spawn(f"d{i}", rank=i, world_size=world, master_port=port)
        ddp = finished(c, [f"d{i}" for i in range(world)])
    ours, theirs = torch.load(ends["w0"]["params"]), torch.load(ddp["d0"]["params"])
    assert ends["w0"]["step"] == ddp["d0"]["step"] == 128 // (4 * world)
    assert ours.shape == theirs.shape and not torch.equal(ours, torch.zeros_like(ours))
    worst = float((ours - theirs).abs().max())
    assert worst < 1e-5, f"spotnik and DDP-gloo parameters differ by {worst}"


def test_whole_cluster_loss_resumes_from_a_checkpoint_in_a_new_job(embedded_server, tmp_path: Path) -> None:
    with cluster(embedded_server.url, ckpt_dir=str(tmp_path), every_n_steps=4, pace_s=0.05) as c:
        for i in range(3):
            c.spawn(f"a{i}", world_size=3)
        lose_all_after_checkpoint(c, [f"a{i}" for i in range(3)], tmp_path / "step=4.ckpt", 7)
        first = {e["step"]: e for e in c.of("commit")}
    ckpt = tmp_path / "step=4.ckpt"
    with cluster(embedded_server.url, resume=str(ckpt), pace_s=0.0) as c:  # a new run id: fresh epochs
        for i in range(2):
            c.spawn(f"b{i}", world_size=2)
        ends = finished(c, ["b0", "b1"])
        assert {e["ev"] for e in ends.values()} == {"done"} and len({e["hash"] for e in ends.values()}) == 1
        second = sorted(c.of("commit"), key=lambda e: e["step"])
    assert second[0]["step"] == 5, "the new job must continue after the checkpointed step"
    assert second[0]["epoch"] == 1, "the new job starts a fresh membership epoch sequence"
    covered = sorted([(first[s]["plans"][0][1], first[s]["plans"][0][2]) for s in range(1, 5)]
                     + list({(e["plans"][0][1], e["plans"][0][2]) for e in second}))
    pos = 0
    for start, n in covered:
        assert start == pos
        pos += n
    assert pos == N_DATA


def test_clear_errors_for_bad_use(embedded_server, tmp_path: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from spotnik_lightning.api import BackendConnectionError, ConfigError
    from spotnik_lightning.bench.lightning_worker import MLP, TeacherData
    from spotnik_lightning.lightning.faults import parse as parse_faults
    from spotnik_lightning.lightning.strategy import SpotnikStrategy

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SPOTNIK_") or k in (
        "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    try:
        def fit(strategy: SpotnikStrategy, model: pl.LightningModule | None = None, data: object = None) -> None:
            trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_steps=1, logger=False,
                                 enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path)
            trainer.fit(model or MLP(), data if data is not None else DataLoader(TeacherData(16), batch_size=4))

        with pytest.raises(ConfigError, match="distributed launch"):
            fit(SpotnikStrategy())
        with pytest.raises(BackendConnectionError):
            fit(SpotnikStrategy(f"127.0.0.1:{free_port()}", run_id="x", world_size=1))
        with pytest.raises(ConfigError, match="batch_policy"):
            SpotnikStrategy(batch_policy="half")

        with pytest.raises(ConfigError, match="SPOTNIK_FAULT"):
            parse_faults("vote@x")
        from lightning.pytorch.accelerators import CUDAAccelerator

        gpu = SpotnikStrategy(embedded_server.url, run_id="gpu", world_size=1)
        gpu.accelerator = CUDAAccelerator()
        with pytest.raises(ConfigError, match="CPU only"):
            gpu.setup_environment()

        class Stream(IterableDataset):
            def __iter__(self):  # noqa: ANN204
                yield torch.zeros(16), torch.tensor(0), 0

        with pytest.raises(ConfigError, match="map-style"):
            fit(SpotnikStrategy(embedded_server.url, run_id=f"s-{uuid.uuid4().hex[:6]}", world_size=1),
                data=DataLoader(Stream(), batch_size=2))
    finally:
        os.environ.update(saved)
