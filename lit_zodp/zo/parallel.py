"""Chunk loops of the perturbation engine, spread over CPU threads.

Generating the direction is the engine's main cost on CPU: torch's ``randn`` runs on one core (its
Mersenne Twister is sequential), while the forward passes it sits between use every intra-op thread.
Since every chunk of a direction is drawn from its own seed (:func:`lit_zodp.zo.directions.chunk_seed`),
chunks are independent and any number of threads can generate and apply them, in any order, with
bitwise the same result as one thread.

Threads are used only where it pays and is safe: CPU tensors, at least two chunks' worth of
elements, and chunks no larger than torch's grain size, so that each ``randn``/``add_`` on a chunk
runs single-threaded inside torch (no nested OpenMP teams). Each worker owns one generator and one
scratch buffer of a chunk per term, so the extra memory is a chunk per thread.
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

#: ``at::internal::GRAIN_SIZE``: torch runs element-wise ops on at most this many elements on the
#: calling thread only.
GRAIN_SIZE = 32768

_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0
_pool_lock = threading.Lock()
_in_worker = threading.local()  # a loop started from inside a chunk loop runs on its own thread only


def _reset_pool_after_fork() -> None:  # threads do not survive fork()
    global _pool, _pool_size
    _pool, _pool_size = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pool_after_fork)


def _get_pool(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < size:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="zo-chunks")
            _pool_size = size
        return _pool


def chunk_workers(chunks: Sequence[Tensor]) -> int:
    """How many threads a pass over ``chunks`` uses (1: the calling thread alone)."""
    threads = torch.get_num_threads()
    if threads <= 1 or len(chunks) < 2 or getattr(_in_worker, "active", False):
        return 1
    if any(c.device.type != "cpu" for c in chunks):
        return 1  # GPU kernels are asynchronous already
    if max(c.numel() for c in chunks) > GRAIN_SIZE:
        return 1  # large chunks: torch parallelises each op itself
    if sum(c.numel() for c in chunks) < 2 * GRAIN_SIZE:
        return 1  # too little work to pay for the hand-off
    return min(threads, len(chunks))


class Scratch:
    """One worker's generator and buffers, per device, created on first use."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._generators: dict[torch.device, torch.Generator] = {}
        self._buffers: dict[tuple[torch.device, int], Tensor] = {}
        self._views: dict[tuple[torch.device, int, int], Tensor] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    def buffer(self, device: torch.device, numel: int, slot: int = 0) -> Tensor:
        """The first ``numel`` elements of this worker's float32 buffer ``slot`` (views are cached)."""
        key = (device, slot, numel)
        view = self._views.get(key)
        if view is None:
            if (device, slot) not in self._buffers:
                self._buffers[(device, slot)] = torch.empty(self.size, dtype=torch.float32, device=device)
            view = self._views[key] = self._buffers[(device, slot)][:numel]
        return view


def map_on_threads(work: Callable[[int], object], count: int, workers: Optional[int] = None) -> list:
    """``[work(i) for i in range(count)]`` under ``no_grad`` on up to ``workers`` threads (default: torch's
    intra-op threads), the calling thread among them, each taking the next index when free.

    Only pays where ``work`` releases the GIL (torch ops, NumPy's random fills); results in index order.
    Until 2026-11-28 the calling thread took index 0 only and one pool thread all the others, so a release's
    22 noise parts of a MiniLM gradient were drawn on one core.
    """
    workers = min(count, workers or torch.get_num_threads())
    if workers <= 1 or getattr(_in_worker, "active", False):
        with torch.no_grad():
            return [work(i) for i in range(count)]
    return _on_threads(count, workers, lambda: work)


def for_each_chunk(chunks: Sequence[Tensor], work: Callable[[int, Scratch], object]) -> list:
    """``[work(i, scratch) for i in range(len(chunks))]``, under ``no_grad``, possibly on several threads.

    ``work`` must touch chunk ``i`` only (and its own ``scratch``); results come back in index order.
    """
    count = len(chunks)
    results: list = [None] * count
    if count == 0:
        return results
    size = max(c.numel() for c in chunks)
    workers = chunk_workers(chunks)
    if workers == 1:
        scratch = Scratch(size)
        with torch.no_grad():
            for i in range(count):
                results[i] = work(i, scratch)
        return results
    return _on_threads(count, workers, lambda: _with_scratch(work, Scratch(size)))


def _with_scratch(work: Callable[[int, Scratch], object], scratch: Scratch) -> Callable[[int], object]:
    return lambda i: work(i, scratch)


def _on_threads(count: int, workers: int, per_thread: Callable[[], Callable[[int], object]]) -> list:
    """``results[i] = work(i)`` for every ``i < count``, under ``no_grad`` (grad mode is thread-local), on the calling
    thread and ``workers - 1`` pool threads, each with its own ``work = per_thread()`` taking the next index when
    free; the first error stops the others and is raised."""
    results: list = [None] * count
    counter = itertools.count()
    lock = threading.Lock()
    failed = threading.Event()

    def loop() -> None:
        work = per_thread()
        _in_worker.active = True
        try:
            with torch.no_grad():
                while not failed.is_set():
                    with lock:
                        i = next(counter)
                    if i >= count:
                        return
                    try:
                        results[i] = work(i)
                    except BaseException:
                        failed.set()
                        raise
        finally:
            _in_worker.active = False

    futures = [_get_pool(workers - 1).submit(loop) for _ in range(workers - 1)]
    try:
        loop()
    finally:
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error
    return results
