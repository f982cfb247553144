"""One rank of a ``torch.distributed`` job exercising the ``spotnik`` backend (run by tests/test_backend.py).

Usage: ``python backend_worker.py SCENARIO RANK WORLD PORT [JSON_ARGS]``. The default process group is set
up with ``init_method=tcp://127.0.0.1:PORT``. On success the last stdout line is ``RESULT <json>`` and
the exit code is 0; a failed check raises (exit code 1). A watchdog (``JSON_ARGS["limit"]`` seconds,
default 90) dumps every thread's stack and exits, so a hang cannot outlive the test.

Scenarios:

* ``collectives``: gloo default group + ``new_group(backend="spotnik")``; every collective on every
  dtype/size/layout/op in JSON_ARGS, compared with gloo on the same inputs; the spotnik results'
  digests are compared across ranks (bit-identical).
* ``ddp``: 5 SGD steps of the same MLP under DDP on spotnik and on gloo.
* ``default``: spotnik as the *default* group, gloo and spotnik subgroups, object collectives,
  unsupported calls, ``destroy_process_group`` of a subgroup and of everything, clean exit.
* ``fault``: DDP on spotnik, the last rank dies inside step 2's all-reduce; survivors must get a
  normally completed backward, the error recorded on the group, and a working ring afterwards.
* ``external``: the ring's membership store is ``SPOTNIK_STORE`` (set by the test), for the world
  group and a subgroup.
* ``unreachable``: ``SPOTNIK_STORE`` points nowhere; ``init_process_group("spotnik")`` must raise
  BackendConnectionError quickly.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.testing import assert_close

import spotnik_lightning.ring.backend as backend
from spotnik_lightning.api import BackendConnectionError, ConfigError, MembershipChanged

OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
       "product": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.AVG}
CASE = ["setup"]  # the case running now, named in the error output when a check or call fails
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "bfloat16": torch.bfloat16}


def digest(t: torch.Tensor) -> str:
    dense = t.detach().clone(memory_format=torch.contiguous_format).reshape(-1)
    return hashlib.sha256(dense.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def make(dtype: torch.dtype, n: int, seed: int, contiguous: bool) -> torch.Tensor:
    """Deterministic per-(seed) data. Integer-valued for int64/bfloat16 (exact in any order); floats
    in [0.5, 1.5] (no cancellation). Non-contiguous: every other element of a 2n buffer."""
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.int64, torch.bfloat16):
        base = torch.randint(1, 4, (2 * n,), generator=g).to(dtype)
    else:
        base = (torch.rand(2 * n, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    return base[::2] if not contiguous else base[:n].clone()


class Checker:
    """Runs one case on spotnik and gloo and compares; collects digests of rank-independent results."""

    def __init__(self, g: dist.ProcessGroup, rank: int, world: int) -> None:
        self.g, self.rank, self.world = g, rank, world
        self.digests: list[tuple[str, str]] = []
        self.cases = 0

    def same(self, name: str, spot: torch.Tensor, ref: torch.Tensor, identical: bool = True) -> None:
        assert spot.dtype == ref.dtype and spot.shape == ref.shape, (name, spot.dtype, spot.shape, ref.shape)
        try:
            assert_close(spot, ref)
        except AssertionError as exc:
            raise AssertionError(f"{name}: spotnik differs from gloo on rank {self.rank}: {exc}") from None
        if identical:
            self.digests.append((name, digest(spot)))
        self.cases += 1


def scenario_collectives(rank: int, world: int, args: dict) -> dict:
    g = dist.new_group(backend="spotnik")
    assert g.name() == "spotnik" and g.rank() == rank and g.size() == world, (g.name(), g.rank(), g.size())
    assert dist.get_rank(g) == rank and dist.get_world_size(g) == world
    ck = Checker(g, rank, world)
    seed = 0
    for dname in args.get("dtypes", list(DTYPES)):
        dtype = DTYPES[dname]
        for n in args.get("sizes", [1, 1000, (1 << 20) + 3]):
            for contiguous in (True, False):
                seed += 1
                tag = f"{dname}/n={n}/{'contig' if contiguous else 'strided'}"
                big = n > 100_000
                ops = args.get("big_ops", ["sum", "max"]) if big else args.get("ops", list(OPS))
                for opname in ops:
                    CASE[0] = f"all_reduce/{opname}/{tag}"
                    x = make(dtype, n, 1000 * seed + rank, contiguous)
                    ref = x.clone()
                    dist.all_reduce(x, op=OPS[opname], group=g)
                    if opname == "avg" and not dtype.is_floating_point:
                        # gloo cannot AVG integers ("result type Float can't be cast to the desired
                        # output type Long"); spotnik floors the mean: compare with SUM // world
                        dist.all_reduce(ref)
                        ref = torch.div(ref, world, rounding_mode="floor")
                    else:
                        dist.all_reduce(ref, op=OPS[opname])
                    ck.same(f"all_reduce/{opname}/{tag}", x, ref)
                CASE[0] = f"broadcast, all_gather, reduce_scatter, send/recv/{tag}"
                x = make(dtype, n, 1000 * seed + 7 + rank, contiguous)
                ref = x.clone()
                dist.broadcast(x, src=world - 1, group=g)
                dist.broadcast(ref, src=world - 1)
                ck.same(f"broadcast/{tag}", x, ref)
                # all_gather (list) and all_gather_into_tensor
                x = make(dtype, n, 1000 * seed + 11 + rank, contiguous)
                outs = [torch.empty(n, dtype=dtype) for _ in range(world)]
                refs = [torch.empty(n, dtype=dtype) for _ in range(world)]
                dist.all_gather(outs, x, group=g)
                dist.all_gather(refs, x)
                ck.same(f"all_gather/{tag}", torch.stack(outs), torch.stack(refs))
                out, refo = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
                dist.all_gather_into_tensor(out, x.contiguous(), group=g)
                dist.all_gather_into_tensor(refo, x.contiguous())
                ck.same(f"all_gather_into_tensor/{tag}", out, refo)
                # reduce_scatter (list) and reduce_scatter_tensor: per-rank results, no identity check
                rs_ops = ["sum"] if big else ["sum", "max", "min", "product"]
                for opname in rs_ops:
                    ins = [make(dtype, n, 1000 * seed + 13 + 31 * j + rank, contiguous) for j in range(world)]
                    o, r = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                    dist.reduce_scatter(o, ins, op=OPS[opname], group=g)
                    dist.reduce_scatter(r, [t.contiguous() for t in ins], op=OPS[opname])
                    ck.same(f"reduce_scatter/{opname}/{tag}", o, r, identical=False)
                    flat = torch.cat([t.contiguous() for t in ins])
                    o2, r2 = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                    dist.reduce_scatter_tensor(o2, flat, op=OPS[opname], group=g)
                    dist.reduce_scatter_tensor(r2, flat, op=OPS[opname])
                    ck.same(f"reduce_scatter_tensor/{opname}/{tag}", o2, r2, identical=False)
                # send / recv between pairs (even -> odd, then back)
                if world % 2 == 0:
                    peer = rank + 1 if rank % 2 == 0 else rank - 1
                    mine = make(dtype, n, 1000 * seed + 17 + rank, contiguous)
                    theirs = make(dtype, n, 1000 * seed + 17 + peer, contiguous).clone()
                    got = torch.empty(n, dtype=dtype)
                    if rank % 2 == 0:
                        dist.send(mine, peer, group=g)
                        dist.recv(got, peer, group=g)
                    else:
                        dist.recv(got, peer, group=g)
                        dist.send(mine, peer, group=g)
                    ck.same(f"send_recv/{tag}", got, theirs, identical=False)
    CASE[0] = "reduce, gather, scatter, all_to_all_single, object collectives"
    dist.barrier(group=g)
    # the rest of the API on small tensors: reduce, gather, scatter, all_to_all_single, objects
    x = torch.arange(6, dtype=torch.float64) + rank
    red = x.clone()
    dist.reduce(red, dst=0, group=g)
    if rank == 0:
        ck.same("reduce", red, sum(torch.arange(6, dtype=torch.float64) + r for r in range(world)), False)
    else:
        assert torch.equal(red, x), "reduce modified a non-root tensor"
    gl = [torch.empty(6, dtype=torch.float64) for _ in range(world)] if rank == 0 else None
    dist.gather(x, gl, dst=0, group=g)
    if rank == 0:
        expect = torch.stack([torch.arange(6, dtype=torch.float64) + r for r in range(world)])
        ck.same("gather", torch.stack(gl), expect, False)
    sc = torch.empty(3)
    dist.scatter(sc, [torch.full((3,), float(r)) for r in range(world)] if rank == 1 % world else None,
                 src=1 % world, group=g)
    ck.same("scatter", sc, torch.full((3,), float(rank)), False)
    a2a_in = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
    a2a_out = torch.empty(world * 2)
    dist.all_to_all_single(a2a_out, a2a_in, group=g)
    expect = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * r for r in range(world)])
    ck.same("all_to_all_single", a2a_out, expect, False)
    objs: list = [None] * world
    dist.all_gather_object(objs, {"rank": rank}, group=g)
    assert objs == [{"rank": r} for r in range(world)], objs
    bo = [{"from": rank}]
    dist.broadcast_object_list(bo, src=0, group=g)
    assert bo == [{"from": 0}], bo
    assert g.take_error() is None and g.failed_epochs == [] and g.last_error is None
    # bit-identical across ranks: gather every rank's digests through gloo
    all_digests: list = [None] * world
    dist.all_gather_object(all_digests, ck.digests)
    for r, theirs in enumerate(all_digests):
        for (name, d0), (name_r, dr) in zip(all_digests[0], theirs, strict=True):
            assert name == name_r and d0 == dr, f"{name}: rank {r} result differs from rank 0 (bits)"
    dist.destroy_process_group()
    return {"cases": ck.cases, "identical_checked": len(ck.digests)}


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                       torch.nn.Tanh(), torch.nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def flat_params(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def train(pg: dist.ProcessGroup | None, rank: int, steps: int, init: dict) -> torch.Tensor:
    m = MLP()
    m.load_state_dict(init)
    # tiny buckets: several all-reduces per backward
    ddp = torch.nn.parallel.DistributedDataParallel(m, process_group=pg, bucket_cap_mb=0.005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return flat_params(m)


def scenario_ddp(rank: int, world: int, args: dict) -> dict:
    g = dist.new_group(backend="spotnik")
    torch.manual_seed(0)
    init = MLP().state_dict()
    spot = train(g, rank, 5, init)
    ref = train(None, rank, 5, init)
    assert not torch.equal(spot, flat_params(_init_model(init))), "training did not change the parameters"
    assert_close(spot, ref, rtol=1e-5, atol=1e-6)
    assert g.take_error() is None and g.failed_epochs == []
    gathered = [torch.empty_like(spot) for _ in range(world)]
    dist.all_gather(gathered, spot)  # through gloo
    for r, t in enumerate(gathered):
        assert torch.equal(t, gathered[0]), f"DDP-on-spotnik replica of rank {r} differs from rank 0 (bits)"
    dist.destroy_process_group()
    return {"params": spot.numel(), "max_abs_diff_vs_gloo": float((spot - ref).abs().max())}


def _init_model(init: dict) -> MLP:
    m = MLP()
    m.load_state_dict(init)
    return m


def scenario_default(rank: int, world: int, args: dict, port: int) -> dict:
    os.environ["SPOTNIK_RUN_ID"] = f"defaulttest{port}"  # only a label in c10d mode
    dist.init_process_group("spotnik", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    assert dist.get_backend() == "spotnik", dist.get_backend()
    assert dist.get_rank() == rank and dist.get_world_size() == world
    default = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    x = torch.arange(10, dtype=torch.float32) * (rank + 1)
    ref = x.clone()
    dist.all_reduce(x)
    dist.all_reduce(ref, group=gloo)
    assert_close(x, ref)
    # object collectives on the default group (Lightning's strategy.broadcast uses these)
    bo = [f"hello from {rank}"]
    dist.broadcast_object_list(bo, src=0)
    assert bo == ["hello from 0"], bo
    objs: list = [None] * world
    dist.all_gather_object(objs, rank * 10)
    assert objs == [r * 10 for r in range(world)], objs
    # a spotnik subgroup of ranks 0 and 1 (the others get NON_GROUP_MEMBER)
    sub = dist.new_group([0, 1], backend="spotnik")
    if rank in (0, 1):
        assert dist.get_world_size(sub) == 2 and dist.get_rank(sub) == rank
        y = torch.ones(3) * (rank + 1)
        dist.all_reduce(y, group=sub)
        assert torch.equal(y, torch.full((3,), 3.0)), y
        dist.barrier(group=sub)
    dist.destroy_process_group(sub)
    # unsupported things fail clearly, on the default group
    errors = {}
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist.ReduceOp.BAND)
    except ConfigError as exc:
        errors["band"] = str(exc)
    try:
        dist.recv(torch.empty(2))  # no src: recv from any source
    except NotImplementedError as exc:
        errors["recv_anysource"] = str(exc)
    assert set(errors) == {"band", "recv_anysource"}, errors
    # a quick DDP step on the default group
    torch.manual_seed(0)
    init = MLP().state_dict()
    p = train(None, rank, 2, init)
    gathered = [torch.empty_like(p) for _ in range(world)]
    dist.all_gather(gathered, p, group=gloo)
    assert all(torch.equal(t, gathered[0]) for t in gathered), "DDP on the default spotnik group diverged"
    assert isinstance(default, backend.ProcessGroupSpotnik)
    dist.barrier()
    dist.destroy_process_group()
    assert not dist.is_initialized()
    left = [t.name for t in threading.enumerate() if t.name.startswith("spotnik")]
    deadline = time.monotonic() + 5
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [t.name for t in threading.enumerate() if t.name.startswith("spotnik")]
    assert not left, f"spotnik threads still running after destroy_process_group: {left}"
    return {"errors": errors}


def scenario_fault(rank: int, world: int, args: dict) -> dict:
    """The last rank dies inside step 2's first all-reduce (after the survivors entered theirs)."""
    g = dist.new_group(backend="spotnik")
    marks = args["marks"]
    victim = world - 1
    real = g.ring.all_reduce
    calls = {"n": 0}
    step = {"i": 0}

    def patched(t: torch.Tensor, op: str = "sum") -> None:
        calls["n"] += 1
        if step["i"] == 1 and calls["n"] == 1:
            if rank == victim:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not all(
                        os.path.exists(os.path.join(marks, f"in{r}")) for r in range(world - 1)):
                    time.sleep(0.01)
                time.sleep(0.3)
                os._exit(0)  # dies without closing anything, mid-collective for the others
            with open(os.path.join(marks, f"in{rank}"), "w"):
                pass
        real(t, op)

    g.ring.all_reduce = patched
    torch.manual_seed(0)
    m = MLP()
    ddp = torch.nn.parallel.DistributedDataParallel(m, process_group=g, bucket_cap_mb=0.005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    report: dict = {}
    for i in range(3):
        step["i"], calls["n"] = i, 0
        x, y = batch(i, rank)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # must return normally even when the ring failed underneath
        err = g.take_error()
        report[f"step{i}"] = None if err is None else type(err).__name__
        if err is None:
            opt.step()
    assert report["step0"] is None and report["step2"] is None, report
    assert report["step1"] == "MembershipChanged", report
    assert isinstance(g.last_error, MembershipChanged) and g.failed_epochs == [1], (g.last_error, g.failed_epochs)
    assert g.size() == world - 1 and dist.get_world_size(g) == world - 1, g.size()
    z = torch.ones(4) * (rank + 1)
    dist.all_reduce(z, group=g)  # a plain collective on the repaired ring
    assert torch.equal(z, torch.full((4,), float(sum(range(1, world))))), z
    return {"report": report, "params_digest": digest(flat_params(m)), "epoch": g.ring.epoch}


def scenario_external(rank: int, world: int, args: dict) -> dict:
    """SPOTNIK_STORE / SPOTNIK_RUN_ID come from the test: the world group and a subgroup of ranks 0, 1."""
    g = dist.new_group(backend="spotnik")
    x = torch.ones(5) * (rank + 1)
    dist.all_reduce(x, group=g)
    assert torch.equal(x, torch.full((5,), float(sum(range(1, world + 1))))), x
    sub = dist.new_group([0, 1], backend="spotnik")
    run_ids = [g.ring.run_id]
    if rank in (0, 1):
        y = torch.ones(2) * (rank + 1)
        dist.all_reduce(y, group=sub)
        assert torch.equal(y, torch.full((2,), 3.0)), y
        run_ids.append(sub.ring.run_id)
    dist.destroy_process_group(sub)
    return {"run_ids": run_ids, "members": list(g.ring.membership.ids)}


def scenario_unreachable(rank: int, world: int, args: dict, port: int) -> dict:
    os.environ["SPOTNIK_STORE"] = f"embedded://127.0.0.1:{args['dead_port']}"
    os.environ["SPOTNIK_RUN_ID"] = "unreachable"
    t0 = time.monotonic()
    try:
        dist.init_process_group("spotnik", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    except BackendConnectionError as exc:
        return {"error": str(exc), "seconds": round(time.monotonic() - t0, 2)}
    raise AssertionError("init_process_group succeeded without a reachable SPOTNIK_STORE")


def main() -> int:
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    args = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    faulthandler.dump_traceback_later(float(args.get("limit", 90)), exit=True)
    torch.set_num_threads(1)
    backend.register()
    backend.register()  # idempotent
    t0 = time.monotonic()
    if scenario in ("default", "unreachable"):
        fn = {"default": scenario_default, "unreachable": scenario_unreachable}[scenario]
        result = fn(rank, world, args, port)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        fn = {"collectives": scenario_collectives, "ddp": scenario_ddp, "fault": scenario_fault,
              "external": scenario_external}[scenario]
        try:
            result = fn(rank, world, args)
        except BaseException:
            print(f"rank {rank} failed in case {CASE[0]}", file=sys.stderr, flush=True)
            raise
        if dist.is_initialized():
            dist.destroy_process_group()
    result["seconds"] = round(time.monotonic() - t0, 2)
    print("RESULT " + json.dumps(result), flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
