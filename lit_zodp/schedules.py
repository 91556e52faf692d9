"""Learning-rate schedules whose horizon the fit outruns (review 30, utility).

Every module steps its ``lr_scheduler`` once per training step (manual optimization), where Lightning's automatic
optimization steps it once per epoch by default. A horizon written in epochs (``T_max``, ``total_iters``) then ends
long before the fit: on the quickstart's digits (MeZO, 2000 steps of 20 per epoch) ``PolynomialLR(total_iters=100)``
left the lr at 0 after step 100 and the test accuracy at 0.178 (0.763 with ``total_iters=2000``), and
``CosineAnnealingLR(T_max=100)`` ended at the maximum lr (0.708 against 0.780). :func:`horizon_note` says so in one
line at fit start; schedules without a horizon and warm-ups (``LinearLR`` rising) are not judged, and of a composite
schedule, each schedule that runs to the fit's end: a ``SequentialLR``'s last, every one a ``ChainedScheduler`` chains.
"""

from __future__ import annotations

from typing import Any, Optional

from torch.optim import lr_scheduler as schedulers


def _horizon(scheduler: Any) -> Optional[tuple[str, int, str]]:
    """``(option, horizon, what the lr does after it)`` of a schedule that ends, or ``None``."""
    if isinstance(scheduler, schedulers.CosineAnnealingLR):
        return "T_max", int(scheduler.T_max), f"climbs back to its maximum every {2 * int(scheduler.T_max):,} steps"
    if isinstance(scheduler, schedulers.PolynomialLR):
        return "total_iters", int(scheduler.total_iters), "is 0"
    if isinstance(scheduler, schedulers.LinearLR) and scheduler.end_factor == 0:
        return "total_iters", int(scheduler.total_iters), "is 0"
    return None


def _ends(scheduler: Any) -> list[tuple[str, str, int, int, str, int]]:
    """``(name, option, horizon, step it ends at, what the lr does after it, its position now)`` of each schedule in
    ``scheduler`` that ends, in the composite's own steps: a ``SequentialLR``'s last schedule starts at its last
    milestone (review 33: a warm-up then ``CosineAnnealingLR`` in epochs climbed back unsaid), a ``ChainedScheduler``'s
    schedules all step with it."""
    if isinstance(scheduler, schedulers.SequentialLR) and scheduler._schedulers:
        start = int(scheduler._milestones[-1]) if scheduler._milestones else 0
        return [(f"{type(scheduler).__name__}'s {name}", option, horizon, start + end, after, int(scheduler.last_epoch))
                for name, option, horizon, end, after, _ in _ends(scheduler._schedulers[-1])]
    if isinstance(scheduler, schedulers.ChainedScheduler):
        return [(f"{type(scheduler).__name__}'s {name}", *rest) for inner in scheduler._schedulers
                for name, *rest in _ends(inner)]
    found = _horizon(scheduler)
    if found is None:
        return []
    option, horizon, after = found
    return [(f"{type(scheduler).__name__}({option}={horizon})", option, horizon, horizon, after,
             int(scheduler.last_epoch))]


def horizon_note(scheduler: Any, remaining_steps: float) -> Optional[str]:
    """One line when ``scheduler``'s horizon ends before the fit's last step (its position now plus
    ``remaining_steps``), or ``None``."""
    if not remaining_steps < float("inf"):
        return None
    for name, option, horizon, ends_at, after, position in _ends(scheduler):
        end = int(position + remaining_steps)
        if ends_at >= end:
            continue
        return (f"`lr_scheduler` {name} counts optimizer steps (these modules step it once per training step, not per "
                f"epoch), but this fit runs to step {end:,}: after step {ends_at:,} its lr {after}; set {option}: "
                f"{horizon + end - ends_at}")
    return None


__all__ = ["horizon_note"]
