"""The data path of :class:`~spotnik_lightning.ring.group.RingGroup` (a mixin): entering a
collective on the current membership, queueing its sends, waiting for it, and the reader threads'
side of every data frame (match it to the collective in flight, receive it straight into the
destination or reduce it from a staging buffer, forward it). See :mod:`spotnik_lightning.ring.ops`.

Contract of every operation here: the caller's thread only waits; a membership change surfaces as
:class:`MembershipChanged` once the repair installed the new membership, no progress for the
collective timeout as :class:`MembershipTimeoutError` naming member, epoch, seq and peers.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from spotnik_lightning.api import (
    ConfigError,
    EpochFencedError,
    MembershipChanged,
    MembershipTimeoutError,
    ProtocolError,
    RingBrokenError,
)
from spotnik_lightning.membership.types import Membership
from spotnik_lightning.ring import plans, wire
from spotnik_lightning.ring.ops import Op
from spotnik_lightning.ring.state import CLOSED, FENCED, REPAIRING, RUNNING, STARTING
from spotnik_lightning.ring.state import Interrupted as _Interrupted


class DataPathMixin:
    """Collective machinery of :class:`~spotnik_lightning.ring.group.RingGroup`; uses its lock
    (``_cv``), state, membership, ops table, links, staging buffers and timeouts, and calls its
    ``_neighbours``, ``_out_link`` (connections) and ``_suspect`` (repair)."""

    _cv: Any
    _state: str
    _membership: Membership
    _ops: dict
    _out: dict
    _staging: dict
    _seq: int
    _p2p_seq: dict
    _observed: int
    me: Any
    timeouts: Any
    chunk_bytes: int

    def _contiguous(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself when its memory is one dense run, else a dense copy (the caller
        copies results back). A size-1 dimension may be 'contiguous' with any stride, so the
        flat view is checked too."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise ConfigError("spotnik collectives take CPU tensors")
        if tensor.is_contiguous() and (tensor.numel() <= 1 and tensor.dim() == 0 or tensor.view(-1).stride(0) == 1):
            return tensor
        return torch.empty_like(tensor, memory_format=torch.contiguous_format).copy_(tensor)

    def _check_rank(self, r: int) -> None:
        if not 0 <= r < self.size:
            raise ConfigError(f"rank {r} out of range for world size {self.size} (epoch {self.epoch})")

    def _enter_op(self) -> tuple[int, Membership]:
        """Wait out a repair in progress; raise MembershipChanged if the membership changed since
        this caller last observed it. Call with the lock held.

        Contract: every member observes each membership change (other than an admission it took
        part in through :meth:`admit`) as exactly one MembershipChanged, raised by its first
        collective at or after the change — also when its previous collective completed just
        before the change while a peer's did not. So all survivors can resynchronise in step.
        """
        if self._state in (REPAIRING, STARTING):
            self._wait_not_repairing_locked(self._membership.epoch, "collective")
        if self._state != RUNNING:
            raise self._error or RingBrokenError(f"ring is {self._state} (member {self.me.id})")
        if self._membership.epoch != self._observed:
            old, self._observed = self._observed, self._membership.epoch
            raise MembershipChanged(old, self._observed, "membership changed since the last collective")
        return self._membership.epoch, self._membership

    def _wait_not_repairing_locked(self, old_epoch: int, what: str) -> None:
        deadline = time.monotonic() + self.timeouts.repair.total_seconds()
        while self._state in (REPAIRING, STARTING):
            left = deadline - time.monotonic()
            if left <= 0:
                raise MembershipTimeoutError(
                    f"{what}: repair of epoch {old_epoch} did not finish within "
                    f"{self.timeouts.repair.total_seconds():.0f} s at {self.me.id} (dead: {sorted(self._dead)})")
            self._cv.wait(min(left, 0.5))
        if self._state != RUNNING:
            raise self._error or RingBrokenError(f"ring is {self._state} (member {self.me.id})")

    def _ring_op(self, name: str, flat: torch.Tensor, plan: Callable[[int, int], tuple[list, list]],
                 reduce_op: str = "sum") -> None:
        with self._cv:
            epoch, m = self._enter_op()
            succ = self._neighbours(list(m.ids))[1]
        if succ is not None and self._out.get((succ, "ring")) is None:
            # connect before the op is visible, so the reader can forward at once
            self._out_link(succ, "ring", self.timeouts.connect.total_seconds())
        with self._cv:
            epoch, m = self._enter_op()
            ids = list(m.ids)
            n, rank = len(ids), ids.index(self.me.id)
            pred, succ = self._neighbours(ids)
            sends, frames = plan(n, rank)
            seq = self._seq
            self._seq += 1
            op = Op(epoch, seq, "ring", pred, succ, flat, frames, reduce_op, n)
        if n > 1 and (sends or any(f.forward for f in frames)):
            # Queue the initial sends before the reader can see the op: its forwards must take
            # frame indices after them, or the receiver would match pieces to the wrong ranges.
            self._start_sends("ring", op, sends)
        with self._cv:
            if op.error is None and (self._state != RUNNING or self._membership.epoch != epoch):
                op.fail(_Interrupted("membership changed while the collective started"))
            self._ops["ring"] = op
            self._cv.notify_all()
        self._drive(name, op)

    def _p2p(self, peer_rank: int, send: torch.Tensor | None = None, recv: torch.Tensor | None = None) -> None:
        for t in (send, recv):
            if t is not None:
                self._contiguous(t)
        with self._cv:
            epoch, m = self._enter_op()
            self._check_rank(peer_rank)
            peer = m.members[peer_rank].id
            if peer == self.me.id:
                if send is not None and recv is not None:
                    recv.copy_(send)
                return
            s_flat = self._contiguous(send).view(-1) if send is not None else None
            r_work = recv if recv is None else self._contiguous(recv)
            r_flat = r_work.view(-1) if r_work is not None else None
            out_seq = self._p2p_seq.get((peer, "out"), 0)
            in_seq = self._p2p_seq.get((peer, "in"), 0)
            if s_flat is not None:
                self._p2p_seq[(peer, "out")] = out_seq + 1
            if r_flat is not None:
                self._p2p_seq[(peer, "in")] = in_seq + 1
            recv_op = None
            if r_flat is not None:
                nb = r_flat.numel() * r_flat.element_size()
                frames = [plans.Frame(a, b, plans.COPY, False) for a, b in plans.pieces((0, nb), self.chunk_bytes, 1)]
                recv_op = Op(epoch, in_seq, "p2p", peer, None, r_flat, frames)
                self._ops["p2p"] = recv_op
                self._cv.notify_all()
            send_op = None
            if s_flat is not None:
                send_op = Op(epoch, out_seq, "p2p-out", None, peer, s_flat, [])
                self._ops["p2p-out"] = send_op
        if send_op is not None:
            nb = s_flat.numel() * s_flat.element_size()
            self._start_sends("p2p", send_op, plans.pieces((0, nb), self.chunk_bytes, 1))
        try:
            if send_op is not None:
                self._drive("send", send_op)
            if recv_op is not None:
                self._drive("recv", recv_op)
        finally:
            with self._cv:
                for key, op in (("p2p", recv_op), ("p2p-out", send_op)):
                    if op is not None and self._ops.get(key) is op:
                        del self._ops[key]
        if r_work is not None and r_work is not recv:
            recv.copy_(r_work)

    def _start_sends(self, channel: str, op: Op, sends: list[tuple[int, int]]) -> None:
        link = self._out_link(op.dst, "ring" if channel == "ring" else "p2p",
                              self.timeouts.connect.total_seconds())
        if link is None:
            self._suspect(op.dst, f"cannot connect to {op.dst} for {channel} data")
            op.fail(_Interrupted(f"no link to {op.dst}"))
            return
        for a, b in sends:
            if not op.send_piece(link, a, b):
                op.fail(_Interrupted(f"link to {op.dst} failed"))
                return

    def _drive(self, name: str, op: Op) -> None:
        """Wait for ``op`` (its sends are queued); translate an interruption into MembershipChanged."""
        try:
            op.wait(self.timeouts.collective.total_seconds(),
                    lambda: f"{name} at {self.me.id}: epoch {op.epoch} seq {op.seq} made no progress for "
                            f"{self.timeouts.collective.total_seconds():.0f} s (receiving from {op.src}, "
                            f"frame {op.next}/{len(op.frames)}; sending to {op.dst}, "
                            f"{op.sends_pending} pending)")
        except TimeoutError as exc:
            self._fail_op(op)
            raise MembershipTimeoutError(str(exc)) from None
        except _Interrupted as exc:
            with self._cv:
                self._wait_not_repairing_locked(op.epoch, name)
                self._observed = self._membership.epoch
                raise MembershipChanged(op.epoch, self._observed, str(exc)) from None
        except (EpochFencedError, RingBrokenError):
            raise
        finally:
            with self._cv:
                if self._ops.get(op.channel) is op:
                    del self._ops[op.channel]

    def _fail_op(self, op: Op) -> None:
        op.fail(_Interrupted("timed out"))
        with self._cv:
            if self._ops.get(op.channel) is op:
                del self._ops[op.channel]

    # ------------------------------------------------------------------ data path (reader threads)
    def _on_data(self, peer: str, channel: str, sock: socket.socket, epoch: int, seq: int, idx: int,
                 length: int, scratch: bytearray) -> None:
        """Route one data frame: into the matching op, or drain it when it is stale."""
        op_key = "ring" if channel == "ring" else "p2p"
        deadline = time.monotonic() + self.timeouts.collective.total_seconds()
        op = None
        with self._cv:
            while True:
                cur = self._ops.get(op_key)
                if self._state in (CLOSED, FENCED):
                    break
                if epoch < self._membership.epoch or (epoch == self._membership.epoch and self._state != RUNNING):
                    break  # an aborted collective of an older epoch: drain it
                if cur is not None and cur.src == peer and cur.epoch == epoch:
                    if cur.seq == seq:
                        op = cur
                        break
                    if seq < cur.seq:
                        break
                elif epoch == self._membership.epoch and op_key == "ring" and seq < self._seq - 1:
                    break
                if time.monotonic() > deadline:
                    raise ProtocolError(f"data frame epoch {epoch} seq {seq} from {peer} never matched a collective")
                self._cv.wait(0.05)
        if op is None:
            self._drain(sock, length, scratch)
            return
        fr = op.begin_frame(idx, length)
        if isinstance(fr, str):
            if op.error is not None:
                self._drain(sock, length, scratch)
                return
            raise ProtocolError(f"from {peer}: {fr}")
        try:
            if fr.mode == plans.COPY:
                wire.recv_into_exact(sock, op.mv[fr.start:fr.stop])
            else:
                staging = self._staging[op_key]
                wire.recv_into_exact(sock, memoryview(staging.numpy())[: fr.stop - fr.start])
                op.finish_frame(fr, staging)
        except BaseException:
            with op.cv:
                op.busy = False
                op.cv.notify_all()
            raise
        op.end_frame()
        if fr.forward and op.error is None:
            link = self._out.get((op.dst, "ring")) or self._out_link(
                op.dst, "ring", self.timeouts.connect.total_seconds())
            if link is None or not op.send_piece(link, fr.start, fr.stop):
                op.fail(_Interrupted(f"link to {op.dst} failed"))

    @staticmethod
    def _drain(sock: socket.socket, length: int, scratch: bytearray) -> None:
        view = memoryview(scratch)
        while length:
            k = sock.recv_into(view[: min(length, len(scratch))])
            if k == 0:
                raise ConnectionError("closed while draining a stale frame")
            length -= k
