"""The spotnik backend's torch ProcessGroup: :class:`ProcessGroupSpotnik` (collectives on a RingGroup).

The fault contract it implements is described in :mod:`spotnik_lightning.ring.backend`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from spotnik_lightning.api import ConfigError, MembershipChanged, SpotnikError
from spotnik_lightning.ring.backend.lifecycle import _close_ring
from spotnik_lightning.ring.backend.settings import BACKEND_NAME
from spotnik_lightning.ring.backend.work import (
    SpotnikWork,
    _all_gather,
    _all_reduce,
    _as_list,
    _broadcast,
    _check_rank,
    _cpu,
    _gather_flat,
    _opt,
    _recv,
    _reduce_op,
    _reduce_scatter_one,
    _send,
)
from spotnik_lightning.ring.group import RingGroup

log = logging.getLogger("spotnik.backend")


class ProcessGroupSpotnik(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on a :class:`RingGroup` (CPU tensors only).

    Built by the backend creator (:func:`register`); owns its ring and closes it in
    :meth:`shutdown`. Collectives are synchronous and must be called SPMD from one thread.
    Supported: allreduce (SUM/AVG/MIN/MAX/PRODUCT), broadcast, allgather, all_gather_single
    (all_gather_into_tensor), reduce_scatter (+ _single / tensor forms), reduce, gather, scatter,
    barrier, monitored_barrier, send/recv (tags ignored; matched in order per peer pair; a send
    returns once the receiver has taken the data, so pairwise exchanges must order send/recv),
    all_to_all_single / alltoall with equal splits, and the ``*_coalesced`` forms (one collective
    per tensor). Others raise NotImplementedError.

    Failure bookkeeping (see the fault contract in :mod:`spotnik_lightning.ring.backend`):
    :attr:`last_error` (most recent ring error, kept), :attr:`failed_epochs` (epochs in which a
    collective failed, ascending, no duplicates), :meth:`take_error` (the first failure not yet
    observed through Work.wait, cleared).
    """

    def __init__(self, ring: RingGroup, torch_rank: int, torch_size: int) -> None:
        # The (store, rank, size) constructor is not alias-aware in torch 2.13 ("pybind11::init():
        # construction failed: returned holder-wrapped instance is not an alias instance").
        super().__init__(torch_rank, torch_size)
        self.ring = ring
        self._rank, self._size = ring.rank, ring.size
        self._group_name = ""
        self._group_desc = ""
        self._err_lock = threading.Lock()
        self.last_error: SpotnikError | None = None
        self.failed_epochs: list[int] = []
        self._pending: SpotnikError | None = None
        self._shut = False

    # ---- identity (virtual in C++: the PyProcessGroup trampoline dispatches here)
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def getRank(self) -> int:  # noqa: N802 - torch's name
        """The ring's current rank of this worker (last known once the ring is closed/fenced)."""
        try:
            self._rank = self.ring.rank
        except KeyError:
            pass
        return self._rank

    def getSize(self) -> int:  # noqa: N802 - torch's name
        """The ring's current size (last known once the ring is closed/fenced)."""
        if not self._shut and self.ring.size:
            self._size = self.ring.size
        return self._size

    def rank(self) -> int:
        return self.getRank()

    def size(self) -> int:
        return self.getSize()

    # The shortcut torch takes for a ProcessGroup returned by a creator registers no per-device
    # backend, and the base class keeps the group name/desc in that backend ("ProcessGroup name not
    # set" on destroy_process_group). Keep them here instead.
    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
        self._group_desc = desc

    # ---- failure bookkeeping
    def take_error(self) -> SpotnikError | None:
        """Return the first ring failure not yet observed through ``Work.wait()`` and forget it
        (None when every collective since the last call succeeded or was waited on)."""
        with self._err_lock:
            err, self._pending = self._pending, None
            return err

    def _observed(self, err: SpotnikError) -> None:
        with self._err_lock:
            if self._pending is err:
                self._pending = None

    def _fail(self, name: str, epoch: int, err: SpotnikError) -> None:
        log.warning("spotnik %s failed at epoch %d (%s): %s", name, epoch, self.ring.member_id, err)
        with self._err_lock:
            self.last_error = err
            if epoch not in self.failed_epochs:
                self.failed_epochs.append(epoch)
                self.failed_epochs.sort()
            if self._pending is None:
                self._pending = err

    def _run(self, name: str, result: list[torch.Tensor], body: Callable[[], None],
             single: bool = False) -> SpotnikWork:
        """Run ``body`` on the ring; record a ring failure instead of raising it (the fault
        contract). ConfigError (bad arguments) and non-spotnik exceptions propagate.

        Unless ``body`` is one ring operation (``single``), an epoch change while it ran counts as
        a failure too: its parts ran on different memberships, or it sliced by a stale rank.
        """
        if self._shut:
            raise ConfigError(f"{name} on a spotnik process group that was shut down")
        epoch = self.ring.epoch
        try:
            body()
        except ConfigError:
            raise
        except SpotnikError as exc:
            self._fail(name, epoch, exc)
            return SpotnikWork(self, name, result, exc)
        if not single and self.ring.epoch != epoch:
            err = MembershipChanged(epoch, self.ring.epoch, f"membership changed during {name}")
            self._fail(name, epoch, err)
            return SpotnikWork(self, name, result, err)
        return SpotnikWork(self, name, result)

    # ---- collectives
    def allreduce(self, tensors: torch.Tensor | list[torch.Tensor], opts: object = None) -> SpotnikWork:
        """In-place all-reduce of each tensor (``opts.reduceOp``, default SUM)."""
        tensors = _as_list(tensors)
        _cpu(tensors, "allreduce")
        op = _reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM))

        def body() -> None:
            for t in tensors:
                _all_reduce(self.ring, t, op)

        return self._run("allreduce", tensors, body, single=len(tensors) == 1)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> SpotnikWork:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: torch.Tensor | list[torch.Tensor], opts: object = None) -> SpotnikWork:
        """Overwrite each tensor with rank ``opts.rootRank``'s."""
        tensors = _as_list(tensors)
        _cpu(tensors, "broadcast")
        root = int(_opt(opts, "rootRank", 0))  # type: ignore[arg-type]
        _check_rank(self.ring, root, "broadcast")

        def body() -> None:
            for t in tensors:
                _broadcast(self.ring, t, root)

        return self._run("broadcast", tensors, body, single=len(tensors) == 1)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: object = None) -> SpotnikWork:
        """``output_lists[i][r]`` receives rank r's ``inputs[i]``."""
        inputs = _as_list(inputs)
        _cpu(inputs, "allgather")
        n = self.ring.size
        for outs, inp in zip(output_lists, inputs, strict=True):
            _cpu(outs, "allgather")
            if len(outs) != n or any(o.numel() != inp.numel() or o.dtype != inp.dtype for o in outs):
                raise ConfigError(f"allgather: need {n} output tensors of {inp.numel()} {inp.dtype} elements, "
                                  f"got {[(o.numel(), o.dtype) for o in outs]}")

        def body() -> None:
            for outs, inp in zip(output_lists, inputs, strict=True):
                flat = _gather_flat(self.ring, inp)
                for r, o in enumerate(outs):
                    o.copy_(flat[r * inp.numel():(r + 1) * inp.numel()].view(o.shape))

        return self._run("allgather", [o for outs in output_lists for o in outs], body)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: object = None) -> SpotnikWork:
        """``output_lists[r][j]`` receives rank r's ``inputs[j]``."""
        per_input = [[output_lists[r][j] for r in range(len(output_lists))] for j in range(len(inputs))]
        return self.allgather(per_input, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: object = None) -> SpotnikWork:
        """``output`` (size x ``inp.numel()`` elements) receives every rank's ``inp`` in rank order."""
        _cpu([output, inp], "all_gather_into_tensor")
        return self._run("all_gather_into_tensor", [output], lambda: _all_gather(self.ring, output, inp), single=True)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: object = None) -> SpotnikWork:
        _cpu(list(outputs) + list(inputs), "all_gather_into_tensor_coalesced")

        def body() -> None:
            for o, i in zip(outputs, inputs, strict=True):
                _all_gather(self.ring, o, i)

        return self._run("all_gather_into_tensor_coalesced", list(outputs), body)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: object = None) -> SpotnikWork:
        """``outputs[i]`` receives the reduction over ranks of ``input_lists[i][my rank]``
        (an all-reduce of the concatenated inputs, then this rank's slice)."""
        outputs = _as_list(outputs)
        _cpu(outputs + [t for lst in input_lists for t in lst], "reduce_scatter")
        op = _reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM))

        def body() -> None:
            for out, lst in zip(outputs, input_lists, strict=True):
                if len(lst) != self.ring.size:
                    raise ConfigError(f"reduce_scatter: need {self.ring.size} input tensors, got {len(lst)}")
                _reduce_scatter_one(self.ring, out, torch.cat([t.reshape(-1) for t in lst]), op)

        return self._run("reduce_scatter", outputs, body)

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts: object = None) -> SpotnikWork:
        """``output`` receives this rank's slice of the reduction of ``inp`` (size x output elements)."""
        _cpu([output, inp], "reduce_scatter_tensor")
        op = _reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        return self._run("reduce_scatter_tensor", [output],
                         lambda: _reduce_scatter_one(self.ring, output, inp.reshape(-1).clone(), op))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: object = None) -> SpotnikWork:
        _cpu(list(outputs) + list(inputs), "reduce_scatter_tensor_coalesced")
        op = _reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM))

        def body() -> None:
            for o, i in zip(outputs, inputs, strict=True):
                _reduce_scatter_one(self.ring, o, i.reshape(-1).clone(), op)

        return self._run("reduce_scatter_tensor_coalesced", list(outputs), body)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors: list[torch.Tensor], opts: object = None) -> SpotnikWork:
        """Rank ``opts.rootRank`` receives the reduction; the other ranks' tensors are unchanged."""
        tensors = _as_list(tensors)
        _cpu(tensors, "reduce")
        op = _reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM))
        root = int(_opt(opts, "rootRank", 0))  # type: ignore[arg-type]
        _check_rank(self.ring, root, "reduce")

        def body() -> None:
            for t in tensors:
                _all_reduce(self.ring, t if self.ring.rank == root else t.clone(), op)

        return self._run("reduce", tensors, body)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: object = None) -> SpotnikWork:
        """On rank ``opts.rootRank``, ``output_lists[0][r]`` receives rank r's ``inputs[0]``."""
        inputs = _as_list(inputs)
        _cpu(inputs, "gather")
        root = int(_opt(opts, "rootRank", 0))  # type: ignore[arg-type]
        _check_rank(self.ring, root, "gather")

        def body() -> None:
            for j, inp in enumerate(inputs):
                flat = _gather_flat(self.ring, inp)
                if self.ring.rank == root:
                    for r, o in enumerate(output_lists[j]):
                        o.copy_(flat[r * inp.numel():(r + 1) * inp.numel()].view(o.shape))

        return self._run("gather", [o for outs in output_lists for o in outs], body)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                opts: object = None) -> SpotnikWork:
        """``outputs[0]`` receives ``input_lists[0][my rank]`` of rank ``opts.rootRank`` (a broadcast
        of the concatenated inputs, then this rank's slice)."""
        outputs = _as_list(outputs)
        _cpu(outputs, "scatter")
        root = int(_opt(opts, "rootRank", 0))  # type: ignore[arg-type]
        _check_rank(self.ring, root, "scatter")

        def body() -> None:
            for j, out in enumerate(outputs):
                n, rank, k = self.ring.size, self.ring.rank, out.numel()
                if rank == root:
                    buf = torch.cat([t.reshape(-1) for t in input_lists[j]])
                else:
                    buf = torch.empty(n * k, dtype=out.dtype)
                _broadcast(self.ring, buf, root)
                out.copy_(buf[rank * k:(rank + 1) * k].view(out.shape))

        return self._run("scatter", outputs, body)

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: object = None) -> SpotnikWork:
        """Equal splits only: chunk r of ``inp`` goes to rank r; ``output`` chunk r comes from rank r
        (through an all-gather of the inputs, i.e. size x the traffic of a true all-to-all)."""
        _cpu([output, inp], "all_to_all_single")
        n = self.ring.size
        for splits in (output_split_sizes, input_split_sizes):
            if splits and len(set(splits)) != 1:
                raise NotImplementedError("the spotnik backend supports all_to_all_single with equal splits only")
        if inp.numel() != output.numel() or inp.numel() % n:
            raise ConfigError(f"all_to_all_single: input and output must hold the same multiple of {n} elements")

        def body() -> None:
            k = inp.numel() // n
            flat = _gather_flat(self.ring, inp).view(n, n, k)  # [source rank, destination rank, k]
            output.copy_(flat[:, self.ring.rank, :].reshape(output.shape))

        return self._run("all_to_all_single", [output], body)

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: object = None) -> SpotnikWork:
        """``outputs[r]`` receives rank r's ``inputs[my rank]`` (equal sizes only)."""
        _cpu(list(outputs) + list(inputs), "alltoall")
        n = self.ring.size
        if len(inputs) != n or len(outputs) != n or len({t.numel() for t in list(inputs) + list(outputs)}) != 1:
            raise NotImplementedError("the spotnik backend supports alltoall of equally sized tensors only")

        def body() -> None:
            k = inputs[0].numel()
            flat = _gather_flat(self.ring, torch.cat([t.reshape(-1) for t in inputs])).view(n, n, k)
            for r, o in enumerate(outputs):
                o.copy_(flat[r, self.ring.rank].view(o.shape))

        return self._run("alltoall", list(outputs), body)

    def barrier(self, opts: object = None) -> SpotnikWork:
        """Complete once every member entered the barrier."""
        return self._run("barrier", [], self.ring.barrier, single=True)

    def monitored_barrier(self, opts: object = None, wait_all_ranks: bool = False) -> None:
        """A plain barrier that raises the ring error (if any) at once."""
        self.barrier(opts).wait()

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> SpotnikWork:
        """Deliver each tensor to rank ``dst`` (tags are ignored: messages match in order)."""
        tensors = _as_list(tensors)
        _cpu(tensors, "send")
        _check_rank(self.ring, dst, "send")

        def body() -> None:
            for t in tensors:
                _send(self.ring, t, dst)

        return self._run("send", tensors, body, single=len(tensors) == 1)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> SpotnikWork:
        """Fill each tensor with what rank ``src`` sends."""
        tensors = _as_list(tensors)
        _cpu(tensors, "recv")
        _check_rank(self.ring, src, "recv")

        def body() -> None:
            for t in tensors:
                _recv(self.ring, t, src)

        return self._run("recv", tensors, body, single=len(tensors) == 1)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> SpotnikWork:
        raise NotImplementedError("the spotnik backend does not support recv from any source")

    # ---- teardown
    def shutdown(self) -> None:
        """Close the ring and stop its threads (idempotent). Called by destroy_process_group."""
        if self._shut:
            return
        self._rank, self._size = self.getRank(), self.getSize()
        self._shut = True
        _close_ring(self.ring)

    def abort(self) -> None:
        """Same as :meth:`shutdown`."""
        self.shutdown()
