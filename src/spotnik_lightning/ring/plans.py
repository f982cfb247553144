"""Pure scheduling of ring collectives: which byte ranges go where, in which order.

A collective over a flat byte buffer is a sequence of *frames* a worker receives from its ring
predecessor, each with what to do on arrival (reduce into the destination, or copy into it) and
whether to forward the resulting range to the successor. Sender and receiver of a range compute
the same split, so the frame sequence on every link is known in advance; frames are matched by
(epoch, seq, index).
"""

from __future__ import annotations

from dataclasses import dataclass

REDUCE = "reduce"
COPY = "copy"


@dataclass(frozen=True)
class Frame:
    """One frame received from the predecessor: bytes [start, stop) of the flat buffer.

    mode: REDUCE (received into staging, then combined into the range) or COPY (received
    directly into the range). forward: send the range on to the successor afterwards.
    final: the range holds its final reduced value after this frame (AVG divides here).
    """

    start: int
    stop: int
    mode: str
    forward: bool
    final: bool = False


def segments(nbytes: int, itemsize: int, n: int) -> list[tuple[int, int]]:
    """Split ``nbytes`` (a multiple of ``itemsize``) into ``n`` element-aligned byte ranges whose
    lengths differ by at most one element."""
    numel = nbytes // itemsize
    base, extra = divmod(numel, n)
    out, pos = [], 0
    for k in range(n):
        length = (base + (1 if k < extra else 0)) * itemsize
        out.append((pos, pos + length))
        pos += length
    return out


def pieces(seg: tuple[int, int], chunk: int, itemsize: int) -> list[tuple[int, int]]:
    """Split a byte range into pieces of at most ``chunk`` bytes (element-aligned). An empty range
    yields no pieces."""
    chunk = max(itemsize, chunk - chunk % itemsize)
    start, stop = seg
    return [(p, min(p + chunk, stop)) for p in range(start, stop, chunk)]


def allreduce_plan(
    nbytes: int, itemsize: int, n: int, rank: int, chunk: int
) -> tuple[list[tuple[int, int]], list[Frame]]:
    """Ring all-reduce = reduce-scatter then all-gather, each n-1 steps.

    Returns (initial sends, receive frames). Reduce-scatter step s sends segment (r-s) and
    reduces the received segment (r-s-1); after n-1 steps rank r owns segment (r+1) fully
    reduced. All-gather step s sends segment (r+1-s) and copies in segment (r-s).
    """
    segs = segments(nbytes, itemsize, n)
    sends = pieces(segs[rank % n], chunk, itemsize)
    frames: list[Frame] = []
    for s in range(n - 1):
        last = s == n - 2
        for a, b in pieces(segs[(rank - s - 1) % n], chunk, itemsize):
            # every reduced piece moves on: to the next reduce-scatter step, or — after the final
            # step, when this rank owns the segment fully reduced — as all-gather step 0
            frames.append(Frame(a, b, REDUCE, forward=True, final=last))
    for s in range(n - 1):
        for a, b in pieces(segs[(rank - s) % n], chunk, itemsize):
            frames.append(Frame(a, b, COPY, forward=s < n - 2))
    return sends, frames


def broadcast_plan(
    nbytes: int, n: int, rank: int, src: int, chunk: int
) -> tuple[list[tuple[int, int]], list[Frame]]:
    """Pipelined chain from ``src`` along the ring: every rank but src receives each piece and
    forwards it unless its successor is src."""
    whole = pieces((0, nbytes), chunk, 1)
    if rank == src:
        return (whole if n > 1 else []), []
    forward = (rank + 1) % n != src
    return [], [Frame(a, b, COPY, forward=forward) for a, b in whole]


def allgather_plan(
    block: int, n: int, rank: int, chunk: int
) -> tuple[list[tuple[int, int]], list[Frame]]:
    """Ring all-gather over an output of n blocks of ``block`` bytes; rank r's input is block r.
    Step s sends block (r-s) and receives block (r-s-1)."""
    def blk(k: int) -> tuple[int, int]:
        k %= n
        return (k * block, (k + 1) * block)

    sends = pieces(blk(rank), chunk, 1) if n > 1 else []
    frames = [
        Frame(a, b, COPY, forward=s < n - 2)
        for s in range(n - 1)
        for a, b in pieces(blk(rank - s - 1), chunk, 1)
    ]
    return sends, frames
