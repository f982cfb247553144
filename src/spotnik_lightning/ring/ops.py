"""In-flight collective operations and the zero-copy data path.

An :class:`Op` is one collective (or point-to-point transfer) at one (epoch, seq): the frames this
worker expects from its source peer and the ranges it forwards. The reader thread of the source
connection executes the receive side (``recv_into`` straight into the destination, or into one
chunk-sized staging buffer followed by an in-place reduction); sender threads write the forwards.
The caller's thread only waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from spotnik_lightning.ring import wire
from spotnik_lightning.ring.links import OutLink
from spotnik_lightning.ring.plans import COPY, Frame

REDUCE_OPS = ("sum", "avg", "min", "max", "product")


def combine(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """dst = op(dst, src) in place."""
    if op in ("sum", "avg"):
        if dst.dtype == torch.bool:
            torch.logical_or(dst, src, out=dst)
        else:
            dst.add_(src)
    elif op == "min":
        torch.minimum(dst, src, out=dst)
    elif op == "max":
        torch.maximum(dst, src, out=dst)
    elif op == "product":
        if dst.dtype == torch.bool:
            torch.logical_and(dst, src, out=dst)
        else:
            dst.mul_(src)
    else:  # validated by the caller
        raise ValueError(op)


def finalize_avg(dst: torch.Tensor, n: int) -> None:
    """Divide by the world size (floor division for integer dtypes)."""
    if dst.is_floating_point() or dst.is_complex():
        dst.div_(n)
    elif dst.dtype != torch.bool:
        dst.div_(n, rounding_mode="floor")


class Op:
    """One collective in flight. Completion: every expected frame received and every send written.

    ``fail(exc)`` aborts it; the reader stops before the next frame and the waiting caller gets
    ``exc`` (after the reader left any frame it was writing into the caller's tensor).
    """

    def __init__(self, epoch: int, seq: int, channel: str, src: str | None, dst: str | None,
                 flat: torch.Tensor, frames: list[Frame], reduce_op: str = "sum", world: int = 1) -> None:
        self.epoch, self.seq, self.channel, self.src, self.dst = epoch, seq, channel, src, dst
        self.flat = flat  # 1-D contiguous tensor, dtype of the data
        self.itemsize = flat.element_size()
        self.bytes = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
        self.mv = memoryview(self.bytes.numpy()).cast("B") if flat.numel() else memoryview(b"")
        self.frames = frames
        self.reduce_op = reduce_op
        self.world = world
        self.next = 0          # index of the next frame to receive
        self.send_idx = 0      # index of the next frame to send to dst
        self.sends_pending = 0
        self.busy = False      # the reader is writing into our tensor
        self.error: BaseException | None = None
        self.cv = threading.Condition()

    # -- sending ------------------------------------------------------------------------------
    def send_piece(self, link: OutLink, start: int, stop: int) -> bool:
        """Number bytes [start, stop) as our next frame and queue it on ``link``, atomically (the
        caller's thread and the reader thread both send). False if the link refused it."""
        with self.cv:
            hdr = wire.pack_header(wire.KIND_DATA, self.epoch, self.seq, self.send_idx, stop - start)
            if not link.send(hdr, self.mv[start:stop], self.sent):
                return False
            self.send_idx += 1
            self.sends_pending += 1
            return True

    def sent(self) -> None:
        with self.cv:
            self.sends_pending -= 1
            if self.sends_pending == 0:
                self.cv.notify_all()

    # -- receiving (reader thread) ------------------------------------------------------------
    def begin_frame(self, idx: int, length: int) -> Frame | str:
        """Claim the next frame; returns it, or a reason string when the header does not fit."""
        with self.cv:
            if self.error is not None:
                return "op aborted"
            if self.next >= len(self.frames):
                return f"unexpected extra frame {idx}"
            fr = self.frames[self.next]
            if idx != self.next or length != fr.stop - fr.start:
                return f"frame {idx} of {length} bytes does not match expected frame {self.next} " \
                       f"of {fr.stop - fr.start} bytes"
            self.busy = True
            return fr

    def finish_frame(self, fr: Frame, staging: torch.Tensor | None) -> None:
        """Apply a received REDUCE frame from ``staging`` (reader thread, GIL released in torch)."""
        if fr.mode != COPY and staging is not None:
            a, b = fr.start // self.itemsize, fr.stop // self.itemsize
            dst = self.flat[a:b]
            combine(dst, staging[: fr.stop - fr.start].view(self.flat.dtype), self.reduce_op)
            if fr.final and self.reduce_op == "avg":
                finalize_avg(dst, self.world)

    def end_frame(self) -> None:
        with self.cv:
            self.busy = False
            self.next += 1
            self.cv.notify_all()

    def done(self) -> bool:
        return self.next >= len(self.frames) and self.sends_pending <= 0

    def fail(self, exc: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = exc
            self.cv.notify_all()

    def wait(self, timeout: float, describe: Callable[[], str]) -> None:
        """Block until done, failed (raises the error once the reader let go of our tensor) or
        ``timeout`` seconds without progress (raises TimeoutError naming ``describe()``)."""
        last_progress = (self.next, self.sends_pending)
        deadline = time.monotonic() + timeout
        with self.cv:
            while True:
                if self.error is not None:
                    end = time.monotonic() + 5.0
                    while self.busy and time.monotonic() < end:
                        self.cv.wait(0.05)
                    raise self.error
                if self.done():
                    return
                now = time.monotonic()
                progress = (self.next, self.sends_pending)
                if progress != last_progress:
                    last_progress, deadline = progress, now + timeout
                if now >= deadline:
                    raise TimeoutError(describe())
                self.cv.wait(min(0.5, deadline - now))
