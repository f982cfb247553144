"""Adaptive synchronisation end to end: S-SGD, SMA and AD-PSGD in real Lightning processes on a real
ring, run-time switching, and SIGKILLs under each mode and during a switch.

Checked: every mode reaches a stated training accuracy on the worker's TeacherData (4 classes,
192 samples); SMA replicas are bit-identical right after an averaging step and AD-PSGD replicas
stay within a stated distance of each other; switching back to S-SGD makes replicas bit-identical
(the per-commit replica check passes from then on); survivors of a kill finish with their PIDs.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from spotnik_lightning.api import ConfigError
from spotnik_lightning.lightning.adaptive import ThroughputTrigger, WorldSizeThreshold
from tests.test_lightning_strategy import check_run, cluster, finished, lose_all_after_checkpoint

ACC = 0.75  # training accuracy every mode reaches in 3 epochs (chance: 0.25)


def _params(ends: dict[str, dict]) -> dict[str, torch.Tensor]:
    return {mid: torch.load(e["params"]) for mid, e in ends.items()}


def _spread(params: dict[str, torch.Tensor]) -> float:
    """Largest L2 distance of a replica from the replicas' mean, relative to the mean's norm."""
    stack = torch.stack(list(params.values()))
    mean = stack.mean(0)
    return float(((stack - mean).norm(dim=1) / mean.norm()).max())


@pytest.mark.parametrize("sync", ["ssgd", "sma", "adpsgd"])
def test_each_mode_converges_and_replicas_stay_close(embedded_server, tmp_path: Path, sync: str) -> None:
    ids = [f"w{i}" for i in range(4)]
    with cluster(embedded_server.url, sync=sync, sma_k=3, epochs=3, pace_s=0.0, dump=str(tmp_path),
                 scheduler=False) as c:
        for mid in ids:
            c.spawn(mid, world_size=4)
        ends = finished(c, ids)
        assert all(e["ev"] == "done" and e["sync"] == sync for e in ends.values()), ends
        accs = [e["acc"] for e in ends.values()]
        print(sync, "acc", accs)
        assert min(accs) >= ACC, f"{sync} reached training accuracy {accs}"
        spread = _spread(_params(ends))
        print(sync, "spread", spread)
        commits = c.of("commit")
        if sync == "ssgd":
            assert len({e["hash"] for e in ends.values()}) == 1 and spread == 0.0
            assert all(e["hash"] for e in commits)
        elif sync == "sma":  # 36 steps, k = 3: the last step averaged; the check compares parameters
            assert spread == 0.0
            checked = {e["step"] for e in commits if e["hash"]}
            assert checked == set(range(3, 37, 3))
        else:  # 36 steps: every one after the first averages with a snapshot fetched during the step
            assert 0.0 < spread < 0.05
            assert not any(e["hash"] for e in commits)
            gossip = [e["gossip"] for e in ends.values()]
            print("gossip", gossip)
            assert all(g["averaged"] + g["skipped"] == 35 and g["averaged"] >= 30 for g in gossip), gossip


def _modes(c) -> dict[int, set[str]]:  # noqa: ANN001 - a LocalCluster
    out: dict[int, set[str]] = {}
    for e in c.of("commit"):
        out.setdefault(e["step"], set()).add(e["sync"])
    return out


def test_switching_at_agreed_steps_and_back_to_identical_replicas(embedded_server) -> None:
    ids = [f"w{i}" for i in range(3)]
    # requests at the commit of steps 4, 12, 20: voted in the next step, in effect after it
    with cluster(embedded_server.url, sync="ssgd", sma_k=3, epochs=2, pace_s=0.0,
                 switch_at=[[4, "adpsgd"], [12, "sma"], [20, "ssgd"]]) as c:
        for mid in ids:
            c.spawn(mid, world_size=3)
        by_step = check_run(c, ids, epochs=2)  # every commit's replica check passed or was not due
        modes = _modes(c)
        assert all(len(m) == 1 for m in modes.values()), "members disagree on the mode of a step"
        assert [modes[s].pop() for s in (4, 5, 13, 21, 22)] == ["ssgd", "adpsgd", "sma", "ssgd", "ssgd"]
        hashed = {s for s, evs in by_step.items() if evs[0]["hash"]}
        assert hashed >= set(range(21, max(by_step) + 1)) | set(range(1, 6))  # identical again after the switch
        assert not hashed & set(range(6, 14)), "AD-PSGD replicas are not compared"
        ends = {e["id"]: e for e in c.of("done")}
        assert all([(s["from"], s["to"], s["step"]) for s in e["switches"]] == [
            ("ssgd", "adpsgd", 5), ("adpsgd", "sma", 13), ("sma", "ssgd", 21)] for e in ends.values())


@pytest.mark.parametrize("sync,fault,switch", [
    ("adpsgd", "vote@4", 20),  # a kill before the vote: everybody discards and retries the step
    ("sma", "after_commit@5", 20),  # a kill right before an averaging step's all-reduce (sma_k=3)
    ("adpsgd", "after_commit@4", 4),  # a kill between the switching vote and the switch averaging
    ("adpsgd", "vote@4", 4),  # a kill in the vote that carries the switch request
])
def test_a_kill_under_each_mode_and_during_a_switch(embedded_server, sync: str, fault: str, switch: int) -> None:
    ids = [f"w{i}" for i in range(4)]
    with cluster(embedded_server.url, sync=sync, sma_k=3, epochs=2, switch_at=[[switch, "ssgd"]]) as c:
        for mid in ids:
            c.spawn(mid, world_size=4, env={"SPOTNIK_FAULT": fault} if mid == "w2" else {})
        survivors = ["w0", "w1", "w3"]
        by_step = check_run(c, survivors, epochs=2)  # ends in ssgd: identical replicas, PIDs unchanged
        assert c.exited.get(c.pids["w2"]) == -signal.SIGKILL
        assert by_step[max(by_step)][0]["world"] == 3
        modes = _modes(c)
        assert modes[switch] == {sync} and modes[switch + 2] == {"ssgd"}
        ends = {e["id"]: e for e in c.of("done")}
        assert all(e["changes"] >= 1 and e["sync"] == "ssgd" for e in ends.values())
        if fault == "after_commit@4":  # the switch averaging of step 5 was interrupted: redone after step 6
            assert by_step[5][0]["hash"] is None and by_step[6][0]["hash"]
        if fault == "vote@4" and switch == 4:  # step 5 retried on 3 members, then switched and averaged
            assert {e["attempts"] for e in by_step[5]} == {2} and by_step[5][0]["hash"]


def test_a_joiner_under_adpsgd_learns_the_mode(embedded_server) -> None:
    ids = [f"w{i}" for i in range(3)]
    with cluster(embedded_server.url, sync="adpsgd", epochs=2, pace_s=0.02, switch_at=[[22, "ssgd"]]) as c:
        for mid in ids:
            c.spawn(mid, world_size=3)
        c.wait_for(lambda e: e["ev"] == "commit" and e["step"] == 3, 60, "step 3")
        c.spawn("j0", sync="ssgd")  # told ssgd: the members' agreed mode wins
        check_run(c, [*ids, "j0"], epochs=2)
        joined = [e for e in c.of("commit") if e["id"] == "j0"]
        assert joined and joined[0]["step"] < 22 and joined[0]["sync"] == "adpsgd"
        # it prefetched a member's served model before registering: the donor sent the state without
        # model and optimizer state (parameters 22 KB + momentum 22 KB; the rest — loops, RNG — ~13 KB)
        adopted = next(r for e in c.of("done") if e["id"] == "j0" for r in e["resyncs"] if r["outcome"] == "adopted")
        print("joiner resync", adopted)
        assert adopted["bytes"] < 20_000, adopted


def test_throughput_trigger_and_world_size_threshold_policies() -> None:
    trig = ThroughputTrigger(0.4)
    m = {"world": 1, "sync": "ssgd", "ratio": 1.0}
    assert trig(m) is None
    assert trig({**m, "world": 4, "ratio": 0.41}) is None
    assert trig({**m, "world": 5, "ratio": 0.39}) == "adpsgd"
    assert trig({**m, "world": 6, "sync": "adpsgd", "ratio": 0.9}) is None  # no way back while it grows
    assert trig({**m, "world": 4, "sync": "adpsgd", "ratio": 0.9}) == "ssgd"
    thr = WorldSizeThreshold(4, low="sma")
    assert [thr({"world": n}) for n in (1, 3, 4, 7)] == ["ssgd", "ssgd", "sma", "sma"]
    with pytest.raises(ConfigError):
        ThroughputTrigger(1.5)


def test_adaptive_callback_switches_on_world_size(embedded_server) -> None:
    """3 members in S-SGD; a 4th joins: AD-PSGD (WorldSizeThreshold(4)); one leaves (SIGTERM): S-SGD
    again, replicas identical to the end."""
    ids = [f"w{i}" for i in range(3)]
    with cluster(embedded_server.url, epochs=3, pace_s=0.02, adaptive={"policy": "world", "n": 4},
                 log_level=os.environ.get("WT5_LOG")) as c:
        for mid in ids:
            c.spawn(mid, world_size=3)
        c.wait_for(lambda e: e["ev"] == "commit" and e["step"] == 3, 60, "step 3")
        c.spawn("j0")
        c.wait_for(lambda e: e["ev"] == "commit" and e["sync"] == "adpsgd", 60, "the switch to adpsgd")
        c.signal("w1", signal.SIGTERM)
        by_step = check_run(c, ["w0", "w2", "j0"], epochs=3)
        modes = _modes(c)
        seq = [modes[s].pop() for s in sorted(modes)]
        flips = [(a, b) for a, b in zip(seq, seq[1:], strict=False) if a != b]
        assert flips == [("ssgd", "adpsgd"), ("adpsgd", "ssgd")]
        first = [s for s in sorted(by_step) if by_step[s][0]["sync"] == "adpsgd"]
        assert by_step[first[0]][0]["world"] == 4 and by_step[first[-1] + 1][0]["world"] == 3
        ends = {e["id"]: e for e in c.of("done")}
        assert all(e["metrics"]["spotnik/sync"] == 1.0 and e["sync"] == "ssgd" for e in ends.values())


def test_the_sync_mode_and_sma_period_are_checkpointed_and_resumed(embedded_server, tmp_path: Path) -> None:
    """A job switches to SMA (k = 3) and is lost after its step-4 checkpoint; a new job started with
    sync="ssgd", sma_period=5 resumes in SMA with k = 3 (averaging at steps 6 and 9: the phase is the
    committed step count), then switches back to S-SGD with identical replicas."""
    with cluster(embedded_server.url, sync="ssgd", sma_k=3, ckpt_dir=str(tmp_path), every_n_steps=4, pace_s=0.05,
                 switch_at=[[2, "sma"]]) as c:
        for i in range(3):
            c.spawn(f"a{i}", world_size=3)
        lose_all_after_checkpoint(c, [f"a{i}" for i in range(3)], tmp_path / "step=4.ckpt", 6)
        assert _modes(c)[4] == {"sma"}
    saved = torch.load(tmp_path / "step=4.ckpt", weights_only=False)["spotnik"]
    assert saved["sync"] == "sma" and saved["sma_period"] == 3
    with cluster(embedded_server.url, sync="ssgd", sma_k=5, resume=str(tmp_path / "step=4.ckpt"), pace_s=0.0,
                 switch_at=[[9, "ssgd"]]) as c:
        for i in range(2):
            c.spawn(f"b{i}", world_size=2)
        ends = finished(c, ["b0", "b1"])
        assert {e["ev"] for e in ends.values()} == {"done"} and len({e["hash"] for e in ends.values()}) == 1
        by_step: dict[int, list[dict]] = {}
        for e in c.of("commit"):
            by_step.setdefault(e["step"], []).append(e)
        assert sorted(by_step) == list(range(5, max(by_step) + 1))
        assert all(len({e["hash"] for e in evs}) == 1 for evs in by_step.values())
        modes = _modes(c)  # a commit reports the mode after its step (the switch voted in step 10)
        assert all(modes[s] == {"sma"} for s in range(5, 10)), modes
        assert all(modes[s] == {"ssgd"} for s in range(10, max(modes) + 1)), modes
        hashed = {s for s, evs in by_step.items() if evs[0]["hash"]}
        assert {6, 9} <= hashed and not {5, 7, 8} & hashed, sorted(hashed)  # SMA checks at its averaging steps
        assert set(range(10, max(by_step) + 1)) <= hashed
        ends = {e["id"]: e for e in c.of("done")}
        assert all(e["switches"][0]["reason"] == "checkpoint" and e["switches"][0]["to"] == "sma"
                   for e in ends.values())
