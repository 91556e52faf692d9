"""Learning-rate schedules whose horizon the fit outruns (review 30, utility).

Every module steps its ``lr_scheduler`` once per training step (manual optimization), where Lightning's automatic
optimization steps it once per epoch by default. A horizon written in epochs (``T_max``, ``total_iters``) then ends
long before the fit: on the quickstart's digits (MeZO, 2000 steps of 20 per epoch) ``PolynomialLR(total_iters=100)``
left the lr at 0 after step 100 and the test accuracy at 0.178 (0.763 with ``total_iters=2000``), and
``CosineAnnealingLR(T_max=100)`` ended at the maximum lr (0.708 against 0.780). :func:`horizon_note` says so in one
line at fit start; schedules without a horizon, warm-ups (``LinearLR`` rising) and composite schedules are not judged.
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


def horizon_note(scheduler: Any, remaining_steps: float) -> Optional[str]:
    """One line when ``scheduler``'s horizon ends before the fit's last step (its position now plus
    ``remaining_steps``), or ``None``."""
    found = _horizon(scheduler)
    if found is None or not remaining_steps < float("inf"):
        return None
    option, horizon, after = found
    end = int(scheduler.last_epoch + remaining_steps)
    if horizon >= end:
        return None
    return (f"`lr_scheduler` {type(scheduler).__name__}({option}={horizon}) counts optimizer steps (these modules step "
            f"it once per training step, not per epoch), but this fit runs to step {end:,}: after step {horizon:,} its "
            f"lr {after}; set {option}: {end}")


__all__ = ["horizon_note"]
