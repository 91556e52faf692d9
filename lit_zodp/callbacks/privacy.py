"""The privacy-spend callback: epsilon in the logs and progress bar, and a summary at the end.

Private modules return it from ``configure_callbacks()``, so a user's own Trainer cannot forget it.
It only reads the module's privacy component: the plan, the ledger, the budget stop and the
checkpointed state all live there (``lit_zodp.privacy.PrivacyComponent``).
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lit_zodp.callbacks.ranks import stop_started_ranks
from lit_zodp.errors import check_positive_int, raise_if_any


class PrivacySpendCallback(Callback):
    """Logs the privacy spent by a module with a privacy component.

    Args:
        log_every_n_steps: how often epsilon is recomputed and logged. ``None`` (default): as often
            as keeps the accountant under 0.5% of the training time (each logged value is the exact
            upper bound at its step; the last step is always logged), so accounting costs nothing
            visible next to a step. The step time is the mean step since the last epsilon (the first
            step of a fit, with its checks, is not timed); the accountant's cost starts from the one
            measured at fit start (``PrivacyComponent.accounting_seconds``).

    The metric is ``epsilon`` (logged; the progress bar shows it as ``eps``, rounded up to the digits the bar shows:
    :func:`shown_at_least`). A ``sampling: shuffle`` run logs it as
    ``epsilon_poisson_assumed`` instead: its shuffled batches are accounted as Poisson, so the value is
    no guarantee, and a dashboard, monitor or progress bar reading ``epsilon`` must not show it as one. The
    progress bar shows it as ``epsilon*`` (:data:`ASSUMED_BAR_NAME`: the long name was cut at 80 columns).

    It also stops the ranks this process started when it fails, as :class:`~lit_zodp.callbacks.StopRanksOnError`
    does: a private fit runs one lit_zodp callback, not two (Lightning dispatches every hook of a step to every
    callback, about 6 us per callback on the quickstart). Not a subclass of it: a Trainer's own
    ``StopRanksOnError`` would then be overridden (Lightning matches the callbacks a module adds by subclass).
    """

    ACCOUNTING_TIME_SHARE = 0.005

    def __init__(self, log_every_n_steps: Optional[int] = None) -> None:
        if log_every_n_steps is not None:
            raise_if_any([check_positive_int("log_every_n_steps", log_every_n_steps)])
        self.log_every_n_steps = log_every_n_steps
        self.epsilon: float = 0.0
        self._accounting_seconds = 0.0
        self._last_logged_step = 0  # epsilon is due ``cadence`` steps after this one (set again at train start)
        self._next_due_step = 0  # the first step at which epsilon may be due
        self._window: Optional[tuple[int, float]] = None  # (step, clock) where the timed steps start
        self._quiet_until = 0  # the fit's committed steps (``privacy.fit_steps``) before which no step needs a look
        self._step_seconds = 0.0
        self._budget_announced = False

    @property
    def state_key(self) -> str:
        return "PrivacySpendCallback"

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Count the cadence from the step this fit starts at (0, or a resumed checkpoint's step)."""
        self._last_logged_step = self._next_due_step = trainer.global_step
        self._window, self._budget_announced, self._quiet_until = None, False, 0

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                             batch: Any, batch_idx: int) -> None:
        if self._budget_announced:
            return
        self._budget_announced, privacy = True, pl_module.privacy
        if privacy.steps_allowed is not None:
            remaining = privacy.planned_steps - trainer.global_step
            if privacy.steps_allowed < remaining:
                rank_zero_info(f"Privacy budget {epsilon_metric(privacy)}={privacy.budget:g} allows "
                               f"{privacy.steps_allowed} more steps of the {remaining} requested; training will stop "
                               "there.")

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        privacy = pl_module.privacy
        if privacy.fit_steps < self._quiet_until and not (trainer.should_stop or privacy.budget_exhausted):
            return  # most steps: three comparisons (the Trainer's global_step and max_steps are property chains)
        step = trainer.global_step
        last = trainer.should_stop or privacy.budget_exhausted or step >= trainer.max_steps > 0
        if step < self._next_due_step and not last:  # nothing more (no clock read)
            self._quiet_until = self._committed_at(privacy, step, trainer.max_steps)
            return
        now = time.perf_counter()
        if self._window is not None and step > self._window[0]:  # the mean step since the window started
            self._step_seconds = (now - self._window[1]) / (step - self._window[0])
        if not self._accounting_seconds:
            self._accounting_seconds = getattr(privacy, "accounting_seconds", 0.0)
        cadence = self._cadence()
        if last or step - self._last_logged_step >= cadence:
            self._log_epsilon(pl_module, privacy, now)
            self._last_logged_step = step
            now = time.perf_counter()  # the step time excludes the accountant's
        self._window = (step, now)  # (the first step of a fit, with its checks, ends before the window)
        # the cadence is known once a step was timed: until then, ask again at the next step
        self._next_due_step = self._last_logged_step + cadence if math.isfinite(cadence) else step + 1
        self._quiet_until = self._committed_at(privacy, step, trainer.max_steps)

    def _committed_at(self, privacy, step: int, max_steps: int) -> int:
        """The fit's committed-step count at which the next step that needs a look (epsilon due, or the last step
        by ``max_steps``) ends. Each step commits once, so the count and the global step advance together; a module
        that committed more often is looked at early, never late. ``should_stop`` and the budget are read at
        every step."""
        target = min(self._next_due_step, max_steps) if max_steps > 0 else self._next_due_step
        return privacy.fit_steps + max(int(target) - step, 1)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A fit bounded by ``max_epochs`` alone (or stopped at an epoch's end) ends at a step its batch hook could
        not tell was the last: its epsilon is logged here, unless that step logged it."""
        final = trainer.should_stop or (trainer.max_epochs is not None
                                        and trainer.current_epoch + 1 >= trainer.max_epochs > 0)
        if final and trainer.global_step > self._last_logged_step:
            self._log_epsilon(pl_module, pl_module.privacy, time.perf_counter())
            self._last_logged_step = trainer.global_step

    def _log_epsilon(self, pl_module: "pl.LightningModule", privacy, started: float) -> None:
        computations = privacy.ledger.computations
        self.epsilon = privacy.epsilon()
        if privacy.ledger.computations != computations:  # a memoised value says nothing of the cost
            self._accounting_seconds = time.perf_counter() - started
        name = epsilon_metric(privacy)
        pl_module.log(name, float32_at_least(self.epsilon), batch_size=1)
        # the bar's own entry, rounded up to the digits it shows (review 25: TQDM showed 3.3845 as `epsilon=3.380`);
        # the long assumed name did not fit an 80-column bar ("epsilon_poisson_…")
        bar = BAR_NAME if name == "epsilon" else ASSUMED_BAR_NAME
        pl_module.log(bar, float32_at_least(shown_at_least(self.epsilon)), prog_bar=True, logger=False, batch_size=1)

    def _cadence(self) -> float:
        """Steps between two epsilons: their accountant's time at most ``ACCOUNTING_TIME_SHARE`` of the steps'."""
        if self.log_every_n_steps is not None:
            return self.log_every_n_steps
        if not self._step_seconds:
            return 1 if not self._accounting_seconds else math.inf  # the step time is not known yet
        return max(1, math.ceil(self._accounting_seconds / (self.ACCOUNTING_TIME_SHARE * self._step_seconds)))

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        close_registrations = getattr(pl_module, "_close_registrations", None)
        if close_registrations is not None:  # (a failed fit runs no teardown: its global hooks would stay)
            close_registrations()
        self._close_failed_fit(pl_module)
        stop_started_ranks(trainer, exception)

    def _close_failed_fit(self, pl_module: Optional["pl.LightningModule"]) -> None:
        """A failed fit runs no teardown, so its privacy would stay open: the secret noise source held, the spend
        log open, and no "Privacy spent" line after the steps it did take (review 20). Closed here as a fit's end,
        with the summary of the steps committed."""
        privacy = getattr(pl_module, "privacy", None)
        if privacy is None or not privacy.in_fit:
            return
        privacy.end_fit()
        self.epsilon = privacy.epsilon()
        rank_zero_info(f"Privacy spent before the fit failed: {privacy.summary()}.")

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.epsilon = pl_module.privacy.epsilon()  # the ledger's cached bounds when the last step computed them
        rank_zero_info(f"Privacy spent: {pl_module.privacy.summary()}.")


#: The progress bar's name for epsilon. Not ``epsilon`` itself: Lightning logs one name with one value, and the logged
#: ``epsilon`` keeps the bound's digits, where the bar's value is rounded up to the digits the bar shows.
BAR_NAME = "eps"

#: The progress bar's name for an epsilon that is no guarantee (the logged metric is ``epsilon_poisson_assumed``;
#: the summary and the RESULT line say why): it fits beside the bar at 80 columns.
ASSUMED_BAR_NAME = "epsilon*"


def float32_at_least(value: float) -> torch.Tensor:
    """``value`` as a float32 tensor, rounded up: Lightning logs a float as float32 to nearest, which puts a
    logged epsilon up to half a float32 ulp below the bound (``epsilon_text`` rounds shown bounds up too)."""
    rounded = torch.tensor(value, dtype=torch.float32)
    if not float(rounded) < value:  # (inf and NaN too)
        return rounded
    return torch.nextafter(rounded, torch.tensor(math.inf, dtype=torch.float32))


def shown_at_least(value: float) -> float:
    """``value`` rounded UP to the digits the progress bars show, so that the shown epsilon is at or above the bound:
    TQDM shows 3 significant digits rounded to nearest (``.3g``, padded with zeros: a bound of 3.3845 was shown as
    ``3.380``), Rich 3 decimals (``.3f``). The coarser of the two units, and never below ``value``."""
    if not math.isfinite(value) or value <= 0:
        return value
    unit = max(10.0 ** (math.floor(math.log10(value)) - 2), 1e-3)
    units = math.ceil(value / unit)
    return units * unit if units * unit >= value else (units + 1) * unit


def epsilon_metric(privacy) -> str:
    """The logged name of epsilon: ``epsilon``, or ``epsilon_poisson_assumed`` when it is no guarantee."""
    return "epsilon_poisson_assumed" if getattr(privacy, "poisson_assumed", False) else "epsilon"
