"""The CPU thread loops of the engine and the host noise (``lit_zodp.zo.parallel``)."""

import threading

import pytest
import torch

from lit_zodp.zo.parallel import map_on_threads


def test_map_on_threads_shares_the_work_between_the_calling_thread_and_the_pool():
    """Every thread takes the next index when free: with work that releases the GIL (a wait, as NumPy's random
    fills do) both threads take half of the indices. Before, the calling thread took index 0 only and one pool
    thread all the others, so a release's noise parts were drawn on one core (here: the barrier never fills).

    Each item waits at a two-thread barrier, so the threads take one index each per round: exactly 6 each, whatever
    the scheduler does. (A 10 ms sleep per item and a 3..9 bound for the caller failed when one thread was held
    back ~40 ms longer than the other on a loaded machine.)"""
    caller = threading.get_ident()
    taken = []
    both = threading.Barrier(2, timeout=60)  # (broken only where one thread takes every index: the old bug)

    def work(i: int) -> int:
        taken.append(threading.get_ident())
        both.wait()
        return i * i

    assert map_on_threads(work, 12, workers=2) == [i * i for i in range(12)]
    assert len(set(taken)) == 2 and taken.count(caller) == 6


def test_map_on_threads_raises_the_first_error_and_runs_serially_when_nested():
    """A loop started inside a worker runs on that worker's thread (before, it queued its parts on the one pool
    thread it was running on and waited for them: a hang), under no_grad like the chunk loops."""
    def failing(i: int) -> None:
        if i == 3:
            raise ValueError("part 3")

    with pytest.raises(ValueError, match="part 3"):
        map_on_threads(failing, 8, workers=2)
    outer = threading.get_ident()
    inner_threads = map_on_threads(lambda i: map_on_threads(lambda j: threading.get_ident(), 4, workers=2), 2,
                                   workers=2)
    assert all(len(set(ids)) == 1 for ids in inner_threads)  # a loop inside a worker stays on its thread
    assert map_on_threads(lambda i: torch.is_grad_enabled(), 3, workers=2) == [False] * 3
    assert map_on_threads(lambda i: i, 0) == [] and threading.get_ident() == outer
