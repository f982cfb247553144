"""The resync decisions of the commit protocol, on real rings (three members in threads of this
process): local commit of a pending step, serving an interrupted collective's result, state
transfer to a joiner, and refusing a member that is behind without a pending step."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from spotnik_lightning.api import RingTimeouts
from spotnik_lightning.lightning import packing
from spotnik_lightning.lightning.commit import ReplicaDivergenceError, StepCommitter
from spotnik_lightning.membership import open_store
from spotnik_lightning.ring import RingGroup

TIMEOUTS = RingTimeouts(heartbeat_interval=timedelta(milliseconds=100), heartbeat_timeout=timedelta(seconds=2))


def _rings(url: str, n: int) -> list[RingGroup]:
    run, out, errs = f"cp-{uuid.uuid4().hex[:6]}", [None] * n, []

    def make(i: int) -> None:
        try:
            out[i] = RingGroup.create(open_store(url, run), world_size=n, member_id=f"m{i}", timeouts=TIMEOUTS)
        except BaseException as exc:  # reported below
            errs.append(exc)

    ts = [threading.Thread(target=make, args=(i,)) for i in range(n)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert not errs and all(out), errs
    return sorted(out, key=lambda r: r.rank)  # type: ignore[arg-type, return-value]


def _each(rings: list[RingGroup], fn: Callable[[int, RingGroup], Any]) -> list[Any]:
    res: list[Any] = [None] * len(rings)

    def run(i: int) -> None:
        try:
            res[i] = fn(i, rings[i])
        except BaseException as exc:  # the test inspects it
            res[i] = exc

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(rings))]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    return res


def test_resync_decisions(embedded_server) -> None:
    rings = _rings(embedded_server.url, 3)
    try:
        # member 2 is one step behind but voted: it applies its pending step itself; member 1
        # missed the last Lightning collective: members 0 and 2 completed it and serve its result
        committed, voted, coll = [7, 7, 6], [False, True, True], [3, 2, 3]
        last = [torch.tensor([1.5, 2.5]).view(torch.uint8), None, torch.tensor([1.5, 2.5]).view(torch.uint8)]
        adopted: list[Any] = []
        res = _each(rings, lambda i, r: StepCommitter(r, committed[i]).resync(
            voted=voted[i], joiner=False, capture=lambda: [], adopt=adopted.append, timeout_s=30,
            coll_done=coll[i], coll_last=lambda i=i: last[i]))
        assert [x.outcome for x in res] == ["retry", "retry", "commit"] and not adopted
        assert res[0].served is None and res[2].served is None
        assert torch.equal(res[1].served.view(torch.float32), torch.tensor([1.5, 2.5]))

        # member 1 is a joiner: the donor (rank 0, up to date) sends its packed state to it only
        state = {"w": torch.arange(6.0).view(2, 3), "step": 7}
        got: list[Any] = []
        res = _each(rings, lambda i, r: StepCommitter(r, 7).resync(
            voted=False, joiner=i == 1, capture=lambda: packing.pack(state), adopt=got.append, timeout_s=30))
        assert [x.outcome for x in res] == ["retry", "adopted", "retry"] and res[1].donor == 0
        assert len(got) == 1 and torch.equal(got[0]["w"], state["w"]) and got[0]["step"] == 7
        assert res[0].nbytes == res[1].nbytes > 0 and res[2].nbytes == 0

        # behind without a pending step: impossible under the vote, so every member refuses
        res = _each(rings, lambda i, r: StepCommitter(r, [5, 5, 4][i]).resync(
            voted=False, joiner=False, capture=lambda: [], adopt=got.append, timeout_s=30))
        assert all(isinstance(x, ReplicaDivergenceError) for x in res), res
    finally:
        _each(rings, lambda i, r: r.close())


def test_vote_reports_leavers_and_refuses_diverging_counts(embedded_server) -> None:
    rings = _rings(embedded_server.url, 3)
    try:
        votes = _each(rings, lambda i, r: StepCommitter(r, 4).vote(leaving=i == 2))
        assert all(v.world == 3 and v.leaving == [rings[2].member_id] for v in votes)
        res = _each(rings, lambda i, r: StepCommitter(r, [4, 4, 5][i]).vote(leaving=False))
        assert all(isinstance(x, ReplicaDivergenceError) for x in res)
    finally:
        _each(rings, lambda i, r: r.close())


@pytest.mark.parametrize("bad", ["vote@", "nowhere@3", "vote@3#x"])
def test_bad_fault_specs_are_clear_errors(bad: str) -> None:
    from spotnik_lightning.api import ConfigError
    from spotnik_lightning.lightning.faults import parse

    with pytest.raises(ConfigError, match="SPOTNIK_FAULT"):
        parse(bad)
    assert parse("vote@3#2, collective@*") == {("vote", 3): 2, ("collective", -1): 1}
