"""Bucketed gradient all-reduce on the ring, overlapped with backward (S-SGD's primitive).

:class:`GradientReducer` does what DDP's reducer does for CPU training, on a :class:`RingGroup`:
parameters are grouped into buckets (reverse registration order, about ``bucket_mb`` MiB each,
DDP's default layout); a post-accumulate-grad hook copies a parameter's gradient into its bucket
and, once a bucket is full, hands it to one communication thread that all-reduces the buckets
strictly in bucket order (so every member issues the same collectives in the same order, whatever
order autograd fires the hooks in). :meth:`finish` reduces what backward did not reach (unused
parameters count as zero), waits for the thread and writes the reduced gradients back.

Each member's contribution is scaled by ``weight`` (its share of the step's samples) before the
sum, so uneven splits still give the exact global mean of per-sample-mean losses.

Failure contract: the first ring error (e.g. :class:`MembershipChanged`) of a step stops the
thread from issuing any further collective of that step; :meth:`finish` returns the error. The
gradients are then undefined. Nothing is raised inside autograd.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch

from spotnik_lightning.api import ConfigError, SpotnikError
from spotnik_lightning.ring.group import RingGroup


class _Bucket:
    def __init__(self, index: int, params: list[torch.nn.Parameter]) -> None:
        self.index = index
        self.params = params
        self.offsets: list[int] = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.flat = torch.zeros(n, dtype=params[0].dtype)
        self.ready: set[int] = set()

    def full(self) -> bool:
        return len(self.ready) == len(self.params)

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


class GradientReducer:
    """Sum-all-reduce the gradients of ``params`` over ``ring`` during backward.

    Use: :meth:`arm` before the backward whose gradients should be reduced, :meth:`finish` after
    it. Outside ``arm``/``finish`` the hooks do nothing (gradient accumulation without sync).
    ``on_launch(i)`` / ``on_bucket(i)`` (optional) are called when bucket ``i`` is handed to the
    communication thread (inside backward) / after it was reduced (used for fault injection).
    """

    def __init__(self, ring: RingGroup, params: Iterable[torch.nn.Parameter], bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, on_bucket: Callable[[int], None] | None = None,
                 on_launch: Callable[[int], None] | None = None) -> None:
        self.ring = ring
        plist = [p for p in params if p.requires_grad]
        if not plist:
            raise ConfigError("no parameter requires grad: nothing to synchronise")
        if bucket_mb <= 0 or first_bucket_mb <= 0:
            raise ConfigError(f"bucket sizes must be positive, got {bucket_mb} and {first_bucket_mb}")
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, slot)
        cap = first_bucket_mb * 2**20
        group: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(plist):
            if group and (size + p.numel() * p.element_size() > cap or p.dtype != group[0].dtype):
                self._add_bucket(group)
                group, size, cap = [], 0, bucket_mb * 2**20
            group.append(p)
            size += p.numel() * p.element_size()
        self._add_bucket(group)
        self._on_bucket, self._on_launch = on_bucket, on_launch
        self._armed = False
        self._spent: list[torch.Tensor] = []  # see release()
        self._weight = 1.0
        self._next = 0
        self._lock = threading.Lock()
        self._q: queue.Queue[_Bucket | None] = queue.Queue()
        self._done = threading.Semaphore(0)
        self._error: SpotnikError | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in plist]
        self._thread = threading.Thread(target=self._comm_loop, name="spotnik-reducer", daemon=True)
        self._thread.start()

    def _add_bucket(self, group: list[torch.nn.Parameter]) -> None:
        b = _Bucket(len(self.buckets), group)
        for slot, p in enumerate(group):
            self._where[id(p)] = (b.index, slot)
        self.buckets.append(b)

    @property
    def numel(self) -> int:
        return sum(b.flat.numel() for b in self.buckets)

    # ------------------------------------------------------------------ backward side
    def arm(self, weight: float) -> None:
        """Reduce the gradients of the next backward, each scaled by ``weight`` before the sum."""
        with self._lock:
            self._armed, self._weight, self._next, self._error = True, float(weight), 0, None
            for b in self.buckets:
                b.ready.clear()

    @contextmanager
    def disarmed(self):  # noqa: ANN201 - a context manager
        """Backward passes inside this block accumulate locally (no sync)."""
        armed, self._armed = self._armed, False
        try:
            yield
        finally:
            self._armed = armed

    def _hook(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        bi, slot = self._where[id(p)]
        b = self.buckets[bi]
        self._fill(b.view(slot), p.grad)
        with self._lock:
            b.ready.add(slot)
            self._launch_ready_locked()

    def _fill(self, view: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Write ``weight * grad`` into the bucket slot in one pass (as DDP fuses its division by
        the world size into the copy): the scaling costs no extra scan of the gradients."""
        w = self._weight
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():  # autograd accumulated into the view itself
            if w != 1.0:
                view.mul_(w)
        elif w != 1.0:
            torch.mul(grad, w, out=view)
        else:
            view.copy_(grad)

    def _launch_ready_locked(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].full():
            self._q.put(self.buckets[self._next])
            if self._on_launch is not None:
                self._on_launch(self._next)
            self._next += 1

    def finish(self) -> SpotnikError | None:
        """Reduce the buckets backward did not complete (missing gradients count as zero), wait
        for every bucket (bounded by the ring's collective timeout per bucket) and write the
        reduced gradients into ``.grad``. Returns the step's ring error, or None on success."""
        with self._lock:
            if not self._armed:
                raise ConfigError("finish() without arm()")
            for b in self.buckets[self._next:]:
                for slot, p in enumerate(b.params):
                    if slot not in b.ready:
                        self._fill(b.view(slot), p.grad)
                        b.ready.add(slot)
            self._launch_ready_locked()
            launched = self._next
            self._armed = False
        for _ in range(launched):
            self._done.acquire()
        if self._error is not None:
            return self._error
        spent: list[torch.Tensor] = []
        for b in self.buckets:
            for slot, p in enumerate(b.params):
                # Hand the reduced bucket memory to .grad instead of copying it back (one memcpy of
                # all gradients less per step). The view stays valid until the next step's hooks
                # write the bucket, by which time Lightning has reset .grad (or, with
                # zero_grad(set_to_none=False), autograd accumulated into the view itself).
                v = b.view(slot)
                if p.grad is not None or bool(v.any()):  # unused here and everywhere: stays None
                    if p.grad is not None and p.grad.data_ptr() != v.data_ptr():
                        spent.append(p.grad)
                    p.grad = v
        self._spent = spent
        return None

    def release(self) -> None:
        """Free the gradient tensors autograd produced in the last reduced backward (kept since
        :meth:`finish`). Call it where DDP frees its gradients: after the next forward, before the
        next backward (the strategy's ``backward``). Freeing them while little else is allocated
        (right after ``finish``) lets the allocator hand that memory back to the kernel, and the
        next backward then page-faults all of it in again: ~100 MB of faults per ResNet-50 step."""
        self._spent = []

    # ------------------------------------------------------------------ communication thread
    def _comm_loop(self) -> None:
        while True:
            b = self._q.get()
            if b is None:
                return
            try:
                if self._error is None:  # (the weight was applied when the slots were filled)
                    self.ring.all_reduce(b.flat, "sum")
                    if self._on_bucket is not None:
                        self._on_bucket(b.index)
            except SpotnikError as exc:
                self._error = exc  # later buckets of this step are skipped: no further collective
            finally:
                self._done.release()

    def close(self) -> None:
        """Remove the hooks and stop the communication thread (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout=5.0)
