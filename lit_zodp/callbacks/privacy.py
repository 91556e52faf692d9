"""The privacy-spend callback: epsilon in the logs and progress bar, a budget stop, the ledger in checkpoints.

Private modules return it from ``configure_callbacks()``, so a user's own Trainer cannot forget the
accounting. It reads the module's ledger (``pl_module.ledger``) and step plan
(``pl_module.step_mechanisms()``); epsilon is always the accountant's upper bound.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lit_zodp.privacy.errors import check_positive, check_positive_int, raise_if_any
from lit_zodp.privacy.ledger import PrivacyLedger


class PrivacySpendCallback(Callback):
    """Tracks the privacy spent by a private LightningModule.

    Args:
        max_epsilon: stop training before a step would make epsilon exceed this; ``None`` uses the
            module's ``max_epsilon`` (and no budget if that is ``None`` too).
        log_every_n_steps: how often epsilon is recomputed and logged. ``None`` (default): every
            step while the accountant costs under 5% of the step time, otherwise as often as that
            budget allows (each logged value is the exact upper bound at its step; the last step is
            always logged).
    """

    CHECKPOINT_KEY = "privacy_ledger"
    ACCOUNTING_TIME_SHARE = 0.05

    def __init__(self, max_epsilon: Optional[float] = None, log_every_n_steps: Optional[int] = None) -> None:
        errors = []
        if log_every_n_steps is not None:
            errors.append(check_positive_int("log_every_n_steps", log_every_n_steps))
        if max_epsilon is not None:
            errors.append(check_positive("max_epsilon", max_epsilon))
        raise_if_any(errors)
        self.max_epsilon = max_epsilon
        self.log_every_n_steps = log_every_n_steps
        self.steps_allowed: Optional[int] = None
        self.epsilon: float = 0.0
        self._accounting_seconds = 0.0
        self._last_logged_step = -1
        self._last_batch_end: Optional[float] = None
        self._step_seconds = 0.0

    @property
    def state_key(self) -> str:
        return "PrivacySpendCallback"

    # ---------------------------------------------------------------- budget
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.steps_allowed = None
        self._planned = False
        pl_module.privacy_budget_exhausted = False

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                             batch: Any, batch_idx: int) -> None:
        if not self._planned:  # the module plans sigma in its own on_train_start, after ours
            self._planned = True
            self._plan_budget(trainer, pl_module)

    def _plan_budget(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        budget = self.max_epsilon if self.max_epsilon is not None else getattr(pl_module, "max_epsilon", None)
        self.epsilon = self._epsilon(pl_module)
        if budget is None or not pl_module.is_private:
            return
        self.steps_allowed = steps_within_budget(pl_module.ledger, pl_module.step_mechanisms(),
                                                 max_epsilon=budget, delta=pl_module.delta,
                                                 limit=pl_module.planned_steps)
        if self.steps_allowed < pl_module.planned_steps:
            rank_zero_info(f"Privacy budget epsilon={budget} allows {self.steps_allowed} more steps "
                           f"of the {pl_module.planned_steps} planned; training will stop there.")
        self._check_budget(trainer, pl_module)

    def _check_budget(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.steps_allowed is not None and self.steps_allowed <= 0:
            pl_module.privacy_budget_exhausted = True
            trainer.should_stop = True

    # --------------------------------------------------------------- logging
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.steps_allowed is not None:
            self.steps_allowed -= 1
            self._check_budget(trainer, pl_module)
        now = time.perf_counter()
        if self._last_batch_end is not None:
            self._step_seconds = 0.9 * self._step_seconds + 0.1 * (now - self._last_batch_end) \
                if self._step_seconds else now - self._last_batch_end
        last = trainer.should_stop or trainer.global_step >= pl_module.planned_steps
        if last or trainer.global_step - self._last_logged_step >= self._cadence():
            self.epsilon = self._epsilon(pl_module)
            self._accounting_seconds = time.perf_counter() - now
            self._last_logged_step = trainer.global_step
            pl_module.log("epsilon", self.epsilon, prog_bar=True, batch_size=1)
        self._last_batch_end = time.perf_counter()

    def _cadence(self) -> int:
        if self.log_every_n_steps is not None:
            return self.log_every_n_steps
        if not self._step_seconds:
            return 1
        return max(1, math.ceil(self._accounting_seconds / (self.ACCOUNTING_TIME_SHARE * self._step_seconds)))

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.epsilon = self._epsilon(pl_module)
        rank_zero_info(f"Privacy spent: epsilon = {self.epsilon:.4g} at delta = {pl_module.delta:.3g} "
                       f"after {trainer.global_step} steps (PRV accountant, upper bound; "
                       f"sigma = {pl_module.noise_multiplier:.4g}, q = {pl_module.sample_rate:.4g}).")

    @staticmethod
    def _epsilon(pl_module: "pl.LightningModule") -> float:
        if not pl_module.is_private:
            return math.inf
        return pl_module.ledger.epsilon(pl_module.delta).upper

    # ----------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict) -> None:
        checkpoint[self.CHECKPOINT_KEY] = pl_module.ledger.state_dict()

    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict) -> None:
        if self.CHECKPOINT_KEY in checkpoint:
            pl_module.ledger.load_state_dict(checkpoint[self.CHECKPOINT_KEY])


def steps_within_budget(ledger: PrivacyLedger, per_step: list, *, max_epsilon: float, delta: float,
                        limit: int) -> int:
    """Largest ``k <= limit`` such that ``k`` more steps keep epsilon's upper bound <= ``max_epsilon``.

    Epsilon grows with ``k``, so bisection over ``k`` is exact (``O(log limit)`` accountant calls).
    """
    def fits(k: int) -> bool:
        extra = [(mechanism, count * k) for mechanism, count in per_step]
        return ledger.epsilon(delta, extra=extra).upper <= max_epsilon

    if fits(limit):
        return limit
    low, high = 0, limit  # fits(low) is assumed (no extra step), fits(high) is False
    if not fits(0):
        return 0
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
