"""The privacy component: everything a private algorithm needs, owned in one place (DESIGN.md).

Used by composition: a module holds a :class:`PrivacyComponent` (or its non-private twin
:class:`NonPrivate`, same API) and calls

* ``plan(...)`` at every fit start: reads the sampling description from the real batch sampler,
  fixes delta and sigma (calibrated to ``target_epsilon`` over the planned steps from the
  algorithm's step plan), binds the budget, draws a fresh secret noise source from the OS;
* ``release(clipped_sum, name)`` per release: all-reduce across ranks, add the noise once,
  divide by the EXPECTED batch size;
* nothing for accounting: ``attach(optimizer)`` hooks ``commit_step`` on the optimizer's step, so
  the ledger records exactly the optimizer steps and no algorithm can forget it.

``state_dict()`` holds the ledger and the plan (sigma, delta, budget, sampling), never the noise
or sampling state; it travels in every checkpoint, and on load the budget stays binding.
"""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lit_zodp.errors import (
    AccountingError,
    LitZodpWarning,
    PrivacyConfigError,
    check_choice,
    check_delta,
    check_non_negative,
    check_positive,
    raise_if_any,
)
from lit_zodp.privacy.calibration import calibrated_multiplier, steps_cost, steps_within_budget
from lit_zodp.privacy.clipping import check_clip
from lit_zodp.privacy.ledger import PrivacyLedger
from lit_zodp.privacy.mechanisms import Gaussian, SinglePassGaussian, SubsampledGaussian
from lit_zodp.privacy.noise import NoiseSource, SecretGaussianVector, secret_seed
from lit_zodp.privacy.plan import StepPlan, composed_multiplier
from lit_zodp.privacy.sampling import SamplingDescription, ShuffledSampling, SinglePassSampling
from lit_zodp.privacy.spend_log import (MARKS, Branch, Counts, SpendLog, decode_counts, encode_counts, new_id,
                                        summed)
from lit_zodp.privacy.tree import TreeAggregator

#: The default delta's ceiling: the papers' 1e-5 (DPZero, DP-GRAPE), below ``1 / (10 n)`` for larger ``n``.
DEFAULT_DELTA = 1e-5

#: Epsilon above this is refused: the PRV accountant cannot certify it, and it promises nothing.
MAX_EPSILON = 100.0

ReduceSum = Callable[[Tensor], Tensor]


def _identity(tensor: Tensor) -> Tensor:
    return tensor


@dataclass(frozen=True)
class StepConstants:
    """What every step of a fit reads, made once by its plan (the step plan, sampling, sigma, clip and neighbours
    are fixed until the fit ends): a step does no arithmetic.

    ``stds``: each release's noise std (``noise * sigma * C``, 0 at sigma = 0); ``divisor``: the expected batch
    size ``B``; ``names``: the plan's release names, sorted; ``cost``: one step's ``(mechanism, count)`` records
    (empty at sigma = 0, which records nothing).
    """

    stds: dict
    divisor: float
    names: list
    cost: list


@dataclass
class DirectionRelease:
    """A released vector ``(S u + xi) / B`` applied lazily: ``coefficient * u - noise_coefficient * xi``."""

    coefficient: Tensor
    noise: Optional[SecretGaussianVector]
    noise_coefficient: float


def epsilon_text(epsilon: float, spec: str = ".4g") -> str:
    """``format(epsilon, spec)`` (``".3f"``, ``".4g"``) rounded UP: a shown bound is never below the bound."""
    text = format(epsilon, spec)
    if not math.isfinite(epsilon) or float(text) >= epsilon:
        return text
    shown = float(text)  # rounded down by at most half a unit of the last digit: one unit up
    places = int(spec[1:-1])
    unit = 10.0 ** -places if spec.endswith("f") else 10.0 ** (math.floor(math.log10(abs(shown))) - places + 1)
    return format(shown + unit, spec)


class _FixedWithinAFit:
    """A setting that a fit's releases, ledger, budget and spend log are all made for at its plan: set freely
    before a fit (and by the plan itself), refused within one. (Audit 12 F1: a sigma lowered mid-fit was
    released and recorded at its new value, but the budget's step count and the spend log's per-step cost kept
    the planned one, so ``max_epsilon`` stopped late and a rollback counted the other branch at the old cost.)"""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, component: Any, owner: Optional[type] = None) -> Any:
        if component is None:
            return self
        try:
            return component.__dict__[self.name]  # (the plain attribute's key: old pickles load unchanged)
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, component: Any, value: Any) -> None:
        state = component.__dict__
        if state.get("_in_fit") and value != state.get(self.name):
            raise PrivacyConfigError(
                f"`{self.name}` cannot change within a fit: this fit's noise, ledger, budget and spend log are made "
                f"for {self.name}={state.get(self.name)!r} (its plan); set {value!r} before trainer.fit, or resume "
                "from a checkpoint in a new fit")
        state[self.name] = value


class PrivacyComponent:
    """Privacy configuration, plan, secret noise, release, ledger, epsilon and budget of one module.

    Args (keyword-only):
        clip: per-example clipping threshold ``C``.
        target_epsilon: calibrate sigma at the first fit start so the planned run spends at most
            this (PRV upper bound); also a budget. Exclusive with ``noise_multiplier``.
        noise_multiplier: a fixed sigma; ``0`` is a noiseless ablation (epsilon = inf).
        delta: target delta; ``None`` means ``min(1e-5, 1 / (10 n_private))`` (the papers' 1e-5, and
            well below ``1 / n``: a mechanism that publishes one whole random record is
            ``(0, 1/n)``-DP). A ``delta >= 1 / n`` is refused.
        max_epsilon: a budget: training stops before a step would exceed it.
        noise_seed: TEST ONLY (warns): makes the noise reproducible, so the run is not private.
        eps_error: accountant precision (epsilon upper bound minus estimate).
        neighbours: ``"add_remove"`` (default: one example added or removed, a clipped sum moves by
            ``C``) or ``"replace_one"`` (one example replaced: it moves by ``2C``, so the noise std
            doubles to ``2 sigma C`` and the same sigma is accounted; the DPZero reference's
            ``std = 2 sigma C / B``). Under Poisson subsampling, replacing x by x' is the subsampled
            Gaussian of sensitivity ``2C``, so its epsilon is the add/remove epsilon at multiplier sigma.
        accountant: ``"prv"`` (default, tight) or ``"rdp"`` (Opacus's RDP accountant and noise
            calibration: what the papers' reference code uses; for reproducing their runs).
    """

    private = True
    _step_constants: Optional[StepConstants] = None  # (a class default: components pickled before stop 34 lack it)
    fit_steps = 0  # (likewise, before stop 36)
    _in_fit = False  # between a plan and its end_fit: the settings below are fixed (likewise, before stop 37)
    _seeded_before = False  # (likewise, before review 31)
    _logged_ahead = 0  # (likewise, before review 33)
    clip = _FixedWithinAFit()
    noise_multiplier = _FixedWithinAFit()
    sensitivity_factor = _FixedWithinAFit()
    neighbours = _FixedWithinAFit()

    def __init__(self, *, clip: float = 1.0, target_epsilon: Optional[float] = None,
                 noise_multiplier: Optional[float] = None, delta: Optional[float] = None,
                 max_epsilon: Optional[float] = None, noise_seed: Optional[int] = None,
                 eps_error: float = 0.05, neighbours: str = "add_remove", accountant: str = "prv") -> None:
        raise_if_any(config_errors(clip, target_epsilon, noise_multiplier, delta, max_epsilon, eps_error)
                     + [check_choice("neighbours", neighbours, NEIGHBOURS),
                        check_choice("accountant", accountant, ACCOUNTANTS)])
        self.clip = float(clip)
        self.neighbours = neighbours
        self.sensitivity_factor = NEIGHBOURS[neighbours]
        self.target_epsilon = target_epsilon
        self.configured_noise_multiplier = noise_multiplier
        self.noise_multiplier: Optional[float] = noise_multiplier
        self.delta = delta
        self.max_epsilon = max_epsilon
        self.noise_seed = noise_seed
        self.ledger = PrivacyLedger(eps_error=eps_error, accountant=accountant)
        self.noise: Optional[NoiseSource] = None
        self.sampling: Optional[SamplingDescription] = None
        self.step_plan: StepPlan = ()
        self.planned_steps: Optional[int] = None
        self.budget: Optional[float] = None
        self.steps_allowed: Optional[int] = None
        self.noiseless_steps = 0  # steps taken at sigma = 0: counted here, never in the ledger
        self.split: Optional[str] = None  # which rows are not private (datamodules.base.split_id)
        self.single_pass: Optional[list] = None  # the assignment (n, steps, seed) of the run's single pass
        self._shuffled_before = False  # steps of this run before this fit were shuffled
        self._seeded_before = False  # steps of this run before this fit had noise a `noise_seed` reproduces
        self._restored_plan: Optional[dict] = None
        self._reduce_sum: ReduceSum = _identity
        self._released: list[str] = []
        self._logged_ahead = 0  # pending steps a checkpoint logged in the spend log before their commit
        self.fit_steps = 0  # steps committed in this fit (a counter the privacy callback reads instead of the Trainer's)
        self.lineage: Optional[str] = None  # the run's id across resumes (spend log); public
        self.other_branch_steps = 0  # steps of other branches of the lineage counted in the ledger
        self.branches: Optional[dict[str, int]] = {}  # each branch's steps in this ledger (None: an old checkpoint)
        self.branch: Optional[str] = None  # this fit's branch id
        self._spend_log: Optional[SpendLog] = None
        self._attached: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()

    # ------------------------------------------------------------------------------ plan
    def plan(self, *, step_plan: StepPlan, sampling: SamplingDescription, planned_steps: int,
             reduce_sum: Optional[ReduceSum] = _identity, broadcast: Callable[[Any], Any] = _identity,
             spend_log: Optional[SpendLog] = None, split: Optional[str] = None) -> None:
        """Fix sigma, delta and the budget for this fit, and draw a fresh secret noise source.

        ``reduce_sum``: the all-reduce SUM across DDP ranks (``None``: one process). ``broadcast`` shares
        rank 0's value (DDP); the secret noise seed is shared this way once
        per fit start, so every rank adds the same draw after the all-reduce. ``spend_log`` (rank 0's;
        ``None`` elsewhere): the other branches' releases join the ledger, and this fit's are recorded.
        ``split``: which rows are not private (``datamodules.base.split_id``, of public facts only; ``None``: unknown,
        a loader of the user's); a resume on another split than the checkpoint's is refused.
        """
        if self._in_fit:  # a fit that never reached its end_fit: its pending release is counted first
            self.end_fit()
        if self.sampling is not None and self.sampling.name == ShuffledSampling.name and self.ledger.total_count:
            self._shuffled_before = True  # an earlier fit of this run, in this process, took shuffled steps
        restored = self._run_plan()
        self.step_plan, self.sampling, self.planned_steps = tuple(step_plan), sampling, planned_steps
        self._reduce_sum = reduce_sum or _identity
        self._released, self.fit_steps, self._logged_ahead = [], 0, 0
        raise_if_any([_split_change_error(self.split, split)])  # (a resume, or a 2nd fit here)
        if split is not None:
            self.split = split
        self.delta = self._resolve_delta(restored.get("delta"))
        self.noise_multiplier = self._resolve_sigma(restored.get("noise_multiplier"))
        self.budget = _smallest(self.max_epsilon, self.target_epsilon, restored.get("budget"))
        _warn_if_any(_budget_kept_note(_smallest(self.max_epsilon, self.target_epsilon), restored.get("budget")))
        raise_if_any([self._noiseless_budget_error()])
        self._step_constants = self._make_constants()
        self._count_other_branches(spend_log, broadcast)
        raise_if_any([self._noiseless_past_error()])  # (here, in its checkpoint, or in another branch: review 31)
        self._open_branch(spend_log, broadcast)
        self._check_single_pass()
        self._check_accountable()
        self.steps_allowed = self._steps_allowed()
        raise_if_any([self._no_step_allowed_error()])
        self.noise = None
        if self.is_private:
            self.noise = (NoiseSource(self.noise_seed, stream=self.steps) if self.noise_seed is not None
                          else NoiseSource.from_secret(broadcast(secret_seed())))
        self._restored_plan = None  # (taken: a later fit continues this one's plan, unless a checkpoint is loaded)
        self._in_fit = True  # sigma, C and the neighbours are this fit's until end_fit

    def _run_plan(self) -> dict:
        """The plan the run's steps so far were taken under: a checkpoint's loaded since the last fit, else this
        object's last fit's where it took steps (a second ``trainer.fit``). Its sigma is the run's, as on a resume: a second fit with
        ``target_epsilon`` recalibrated sigma for its own steps alone, the budget stopped it, and the summary showed a
        sigma no step ran at (review 31: 30 steps at 1.528 for epsilon 2, then a second fit of 40 planned steps showed
        1.114, and took none)."""
        if self._restored_plan is not None:  # a checkpoint loaded since the last fit's plan: its run is continued
            return self._restored_plan
        if self.sampling is not None and self.ledger.total_count:
            return {"noise_multiplier": self.noise_multiplier, "delta": self.delta, "budget": self.budget}
        return {}

    def sampling_change(self, sampling: SamplingDescription) -> Optional[str]:
        """A line when this fit samples its private examples otherwise than the run's last fit (here, or in its
        checkpoint): allowed, each step is accounted at its own rate, but a resume that changed the data or the
        batch size said nothing (acceptance test, 2026-11-28)."""
        before = (tuple((self._restored_plan or {}).get(key) for key in ("sampling", "sample_rate", "n"))
                  if self._restored_plan is not None or self.sampling is None else
                  (self.sampling.name, self.sampling.sample_rate, self.sampling.n))
        now = (sampling.name, sampling.sample_rate, sampling.n)
        if before[0] is None or (before[0], before[2]) == (now[0], now[2]) and math.isclose(before[1], now[1]):
            return None
        return (f"This fit samples {now[0]} with q = {now[1]:.4g} of n = {now[2]} private examples; the run's steps so "
                f"far sampled {before[0]} with q = {before[1]:.4g} of n = {before[2]}: each step is accounted at its "
                "own rate")

    def _noiseless_past_error(self) -> Optional[str]:
        """Steps of this run taken at sigma = 0 (a noiseless ablation's checkpoint, resumed with noise; audit,
        2026-11-28): their releases were the clipped sums themselves, so no epsilon covers the weights they made,
        and the epsilon shown used to count only the noised steps."""
        if not self.noiseless_steps or not self.is_private:
            return None
        return (f"This run already took {self.noiseless_steps} steps with `noise_multiplier`=0 (no noise; in this "
                "branch or another branch of the run): their releases were the private clipped sums themselves, so no "
                "epsilon covers a continuation; start a private run from weights that never saw the private data "
                "without noise")

    def _noiseless_budget_error(self) -> Optional[str]:
        """A budget with sigma = 0 (audit 6): a resume that sets ``target_epsilon`` takes the checkpoint's
        sigma, and a noiseless run's checkpoint has 0; its steps would release the clipped sums as they are."""
        if self.budget is None or self.is_private:
            return None
        source = ("configured" if self.configured_noise_multiplier is not None
                  else "the checkpoint's: its run was a noiseless ablation")
        return (f"A privacy budget (epsilon {self.budget:g}: `target_epsilon`/`max_epsilon`) with `noise_multiplier`=0 "
                f"({source}) would train without noise, and no budget binds an infinite epsilon: start a private "
                "run from weights that never saw the private data without noise, or drop the budget for an ablation")

    def _count_other_branches(self, spend_log: Optional[SpendLog], broadcast: Callable[[Any], Any]) -> None:
        """Count in the ledger every release of this run's other branches (a rollback or a fork:
        :mod:`~lit_zodp.privacy.spend_log`), and take their marks: a noiseless branch's steps count as steps without
        noise, a shuffled or test-seeded one's make this epsilon no guarantee (review 31: a fork resumed at sigma 0, with
        shuffled batches or with a `noise_seed` left the other branch's epsilon a plain, finite number)."""
        self.lineage = self.lineage or broadcast(new_id())
        logged = spend_log.branches(self.lineage) if spend_log else {}
        missing, noiseless, marks = self._unseen(logged)
        missing, noiseless, marks, logged_steps = broadcast((encode_counts(missing), noiseless, sorted(marks),
                                                             {branch: record.steps for branch, record in logged.items()}))
        missing = decode_counts(missing)
        if missing or noiseless:
            others, before = sum(missing.values()) + noiseless, self.steps
            for mechanism, count in missing.items():
                self.ledger.record(mechanism, count)
            self.noiseless_steps += noiseless
            self.other_branch_steps += others
            warnings.warn(
                f"This checkpoint's ledger counts {before} steps, but its run (lineage {self.lineage[:8]}) released "
                f"{before + others} in all branches: a rollback or a second continuation of one checkpoint. The "
                f"{others} other steps now count in epsilon and the budget{_marks_text(marks)} (spend log "
                f"{getattr(spend_log, 'directory', 'of rank 0')}).", LitZodpWarning, stacklevel=4)
        self._shuffled_before = self._shuffled_before or "poisson_assumed" in marks
        self._seeded_before = self._seeded_before or "test_seeded" in marks
        known = self.branches or {}  # the ledger now holds every logged step of every branch
        self.branches = {b: max(known.get(b, 0), logged_steps.get(b, 0)) for b in {*known, *logged_steps}}

    def _open_branch(self, spend_log: Optional[SpendLog], broadcast: Callable[[Any], Any]) -> None:
        """Start this fit's branch record, with its marks; a noiseless fit's too (it records no mechanism)."""
        self._spend_log = spend_log
        self.branch = broadcast(new_id())
        self.branches[self.branch] = 0
        if spend_log is not None:
            spend_log.open_branch(self.lineage, self.branch, dict(self._constants().cost), self._own_marks())

    def _own_marks(self) -> list[str]:
        """This fit's :data:`~lit_zodp.privacy.spend_log.MARKS`: what makes its steps no guarantee."""
        own = {"noiseless": not self.is_private, "poisson_assumed": self.sampling.name == ShuffledSampling.name,
               "test_seeded": self.noise_seed is not None}
        return [mark for mark in MARKS if own[mark]]

    def _unseen(self, logged: dict[str, Branch]) -> tuple[Counts, int, set]:
        """The logged releases this ledger lacks, the logged noiseless steps it lacks, and the marks of the branches
        they come from: per branch, the steps beyond those the ledger holds.

        Per branch, not per mechanism: steps the ledger holds from branches this machine never
        logged (another machine, another spend directory) must not hide a local fork. A checkpoint
        from before branch maps (``branches is None``) is compared per mechanism, and takes every branch's marks.
        """
        if self.branches is None:
            counted, total = self.ledger.counts, summed(logged)
            noiseless = sum(record.steps for record in logged.values() if "noiseless" in record.marks)
            return ({m: c - counted.get(m, 0) for m, c in total.items() if c > counted.get(m, 0)},
                    max(0, noiseless - self.noiseless_steps),
                    {mark for record in logged.values() if record.steps for mark in record.marks})
        missing: Counts = {}
        noiseless, marks = 0, set()
        for branch, record in logged.items():
            extra = record.steps - self.branches.get(branch, 0)
            if extra <= 0:
                continue
            for mechanism, count in record.per_step.items():
                missing[mechanism] = missing.get(mechanism, 0) + count * extra
            noiseless += extra if "noiseless" in record.marks else 0
            marks.update(record.marks)
        return missing, noiseless, marks

    @property
    def in_fit(self) -> bool:
        """Between this fit's plan and its :meth:`end_fit`."""
        return self._in_fit

    def end_fit(self) -> None:
        """Close this fit's branch record (it keeps its last count) and forget the secret noise source:
        a module pickled or copied after the fit must not carry the key of the noise it released.

        Releases that no optimizer step committed (a fit that failed between a step's release and its optimizer
        step's end) are recorded first, as the steps that cover them: they may be in the weights already (review 25:
        an update failing part-way left 5 releases, 4 in the ledger and in `OnExceptionCheckpoint`'s file)."""
        self._commit_pending()
        if self.fit_steps and self.noise_seed is not None:  # (review 35: a next fit here without the seed showed a
            self._seeded_before = True  # plain epsilon over these steps, as a resume did before review 31)
        self.noise, self._in_fit = None, False
        if self._spend_log is not None:
            self._spend_log.close()

    def _commit_pending(self) -> None:
        """Record the releases no optimizer step committed, as the steps that cover them (they may be in the weights)."""
        if self._released and self._in_fit:
            try:
                self.commit_step()
            except AccountingError:
                pass  # (released otherwise than planned: recorded as the steps covering them, as a step would)

    def __getstate__(self) -> dict:
        """Copies and pickles never hold the secret noise source (a copy made during a fit cannot release). A pending
        release is logged first (review 35): the copy's weights may carry it, its own commit cannot log it (a copy's
        spend log writes nothing), and a rollback after the original's process ended missed it."""
        self._log_pending()
        return {**self.__dict__, "noise": None, "_attached": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._attached = weakref.WeakSet()

    def _resolve_delta(self, restored: Optional[float]) -> float:
        delta = self.delta if self.delta is not None else restored
        if restored is not None and delta != restored:
            raise PrivacyConfigError(
                f"`delta`={delta} differs from the checkpoint's delta={restored}: a run's budget is stated "
                "at one delta. Resume with the same delta.")
        delta = delta if delta is not None else min(DEFAULT_DELTA, 0.1 / self.sampling.n)
        raise_if_any([check_delta(delta)])
        noised = self.target_epsilon is not None or bool(self.configured_noise_multiplier)  # sigma: not yet resolved
        if noised and delta >= 1.0 / self.sampling.n:  # audit 5: a calibrated run skipped the warning (sigma 0.028)
            raise PrivacyConfigError(
                f"`delta`={delta:g} >= 1/n = {1.0 / self.sampling.n:g} (n = the private examples): a mechanism "
                "that publishes one whole random record meets this delta; choose delta well below 1/n (e.g. 1e-5)")
        return delta

    def _resolve_sigma(self, restored: Optional[float]) -> float:
        if self.configured_noise_multiplier is not None:
            return float(self.configured_noise_multiplier)
        if restored is not None:
            return float(restored)  # the first fit's calibration; the budget stops an extended run
        return self._calibrate()

    def _calibrate(self) -> float:
        """Smallest sigma whose epsilon (PRV upper bound) over the planned steps is <= target.

        With ``accountant="rdp"``, Opacus's ``get_noise_multiplier`` (RDP, tolerance 0.01), exactly as
        the DPZero reference code calibrates, divided by the step plan's composition factor. A
        ``max_epsilon`` below the target is refused here (:func:`budget_order_error`).
        """
        raise_if_any([budget_order_error(self.target_epsilon, self.max_epsilon)])
        if self.ledger.accountant == "rdp":
            from opacus.accountants.utils import get_noise_multiplier

            # one pass composes in parallel: the ledger counts one unsubsampled Gaussian (audit 3 F3)
            parallel = getattr(self.sampling.mechanism(1.0), "composes_in_parallel", False)
            try:
                multiplier = get_noise_multiplier(target_epsilon=self.target_epsilon, target_delta=self.delta,
                                                  sample_rate=1.0 if parallel else self.sampling.sample_rate,
                                                  steps=1 if parallel else self.planned_steps, accountant="rdp")
            except ValueError as err:  # Opacus: "The privacy budget is too low." (its orders stop at 63)
                raise PrivacyConfigError(
                    f"`target_epsilon`={self.target_epsilon:g} at delta={self.delta:g} over {self.planned_steps} steps "
                    f"cannot be certified by accountant='rdp' (Opacus's RDP orders) whatever the noise ({err}): use "
                    "accountant='prv' (the default, tighter), or a larger target_epsilon or delta") from None
            return multiplier / composed_multiplier(self.step_plan, 1.0)
        return calibrated_multiplier(self.sampling, tuple(self.step_plan), self.planned_steps,
                                     target_epsilon=self.target_epsilon, delta=self.delta,
                                     eps_error=self.ledger.eps_error)

    def _steps_cost(self, steps: int, sigma: float) -> list:
        return steps_cost(self.sampling, self.step_plan, steps, sigma)

    def _constants(self) -> StepConstants:
        """This fit's :class:`StepConstants`, made by its plan (sigma, C and the neighbours are fixed until its end)."""
        constants = self._step_constants
        if constants is None:
            raise AccountingError("A step outside a fit: the module plans its releases at fit start")
        return constants

    def _make_constants(self) -> StepConstants:
        return StepConstants(
            stds={release.name: self._noise_std(release) if self.is_private else 0.0 for release in self.step_plan},
            divisor=self.expected_batch_size, names=sorted(release.name for release in self.step_plan),
            cost=self._steps_cost(1, self.noise_multiplier) if self.is_private else [])

    def _check_single_pass(self) -> None:
        """A single pass is accounted once (parallel composition), so it must BE one pass, by one example.

        * Its examples go to steps by position (a public assignment), so removing an example moves
          the others: the parallel-composition argument holds for replace-one neighbours only.
        * The sampler must continue the ledger's pass: a pass restarted (a second fit, a reloaded
          loader, a fresh DataModule after ``load_from_checkpoint``) would reuse examples the ledger
          counts once.
        * And continue it with the same assignment (the run's so far): resumed with another
          ``batch_size`` (another number of steps), data or seed, the pass was drawn anew and continued from the
          old position, so examples used before the checkpoint were used again, counted once (red-team review 17:
          19 of 43 at n = 150, batch size 10 then 5).
        """
        if not self.is_private or getattr(self.sampling, "name", None) != "single_pass":
            return
        if self.neighbours != "replace_one":
            raise PrivacyConfigError(
                "sampling='single_pass' assigns examples to steps by position, so removing one example moves "
                "others to other steps: its guarantee holds for replace-one neighbours only. Set "
                "neighbours='replace_one', or use Poisson sampling.")
        recorded = sum(count for mechanism, count in self.ledger.counts.items()
                       if getattr(mechanism, "composes_in_parallel", False))
        if self.planned_steps is not None and self.planned_steps > self.sampling.steps:
            raise PrivacyConfigError(
                f"The fit plans {self.planned_steps} steps, but the single pass has {self.sampling.steps}: "
                "set max_steps <= the pass length (or max_epochs=1); a second pass would reuse examples accounted "
                "as used once (before audit 7 the fit waited forever at the pass's end).")
        if recorded != self.sampling.start:
            raise PrivacyConfigError(
                f"The ledger holds {recorded} single-pass steps but the sampler starts its pass at step "
                f"{self.sampling.start}: a restarted pass would reuse examples accounted as used once. Resume "
                "the run from its checkpoint (ckpt_path), which continues the pass.")
        now, passed = self.sampling.assignment, _padded_pass(self.single_pass)
        if recorded and passed is not None and any(a is not None and a != b for a, b in zip(passed, now)):
            raise PrivacyConfigError(
                f"This run's single pass assigned n = {passed[0]} examples to {passed[1]} steps{_anchors(passed)}; "
                f"this fit assigns n = {now[0]} to {now[1]} steps{_anchors(now)} (another `batch_size`, "
                f"`anchor_batch_size`, `anchor_period`, data or `data_seed`), so examples its first {recorded} steps "
                "used would be used again, accounted once: resume with the run's batch sizes and data settings")
        self.single_pass = now

    def _check_accountable(self) -> None:
        """Refuse, before the first step, a sigma the accountant cannot certify for the planned run."""
        if not self.is_private:
            return
        try:
            self.ledger.epsilon(self.delta, extra=self._steps_cost(self.planned_steps, self.noise_multiplier))
            # what one epsilon of this fit costs: the accountant built for the horizon serves every later step, so
            # its build (2-3x a query) is not counted: counted, the quickstart logged no epsilon before its end
            self.accounting_seconds = self.ledger.query_seconds
        except AccountingError as err:
            raise AccountingError(
                f"`noise_multiplier`={self.noise_multiplier:.4g} over {self.planned_steps} steps cannot be "
                f"accounted ({err}). Use more noise (or a smaller target_epsilon) or fewer steps.") from None

    def _no_step_allowed_error(self) -> Optional[str]:
        """A new run whose budget allows no step at its sigma would end at once with rc 0 and epsilon 0, as if it had
        trained (acceptance test, 2026-11-28). A resumed run that spent its budget ends so, saying why."""
        if self.steps_allowed != 0 or self.ledger.total_count or not self.planned_steps:
            return None
        one_step = self.ledger.epsilon(self.delta, extra=self._steps_cost(1, self.noise_multiplier)).upper
        return (f"The privacy budget (epsilon {self.budget:g}: `max_epsilon`/`target_epsilon`) allows no step at "
                f"`noise_multiplier`={self.noise_multiplier:.4g}: one step spends epsilon {epsilon_text(one_step)}. "
                "Raise noise_multiplier or the budget")

    def _steps_allowed(self) -> Optional[int]:
        if self.budget is None or not self.is_private:
            return None
        return steps_within_budget(self.ledger, self._steps_cost(1, self.noise_multiplier),
                                   max_epsilon=self.budget, delta=self.delta, limit=self.planned_steps)

    # --------------------------------------------------------------------------- release
    @property
    def is_private(self) -> bool:
        """False for a noiseless ablation (sigma = 0): its epsilon is infinite."""
        return bool(self.noise_multiplier)

    @property
    def expected_batch_size(self) -> float:
        return self.sampling.expected_batch_size

    def release(self, clipped_sum: Tensor, name: str, *, batch_size: Optional[int] = None,
                dtype: Optional[torch.dtype] = None) -> Tensor:
        """``(sum over ranks of the clipped sum + N(0, (noise sigma C)^2 I)) / B``, B the EXPECTED size.

        ``batch_size`` (the realized size) is ignored: dividing by it would leak it. Every rank
        adds the same draw after the all-reduce (shared secret), so all ranks hold the same value.
        ``dtype``: of the noised value (default the sum's): a float64 sum of float32 scalars is rounded once,
        after the noise. A noiseless release (sigma = 0, not private) is the sum's dtype, unrounded.
        """
        std, divisor = self._declared(name)
        total = clipped_sum if self._reduce_sum is _identity else self._reduce_sum(clipped_sum)  # (one process: no call)
        if std:
            return self.noise.noised(total, std, divisor=divisor, dtype=dtype)
        return total / divisor

    def _noise_std(self, release) -> float:
        """``noise * sigma * C``, doubled for replace-one neighbours (sensitivity 2C)."""
        return release.noise * self.sensitivity_factor * self.noise_multiplier * self.clip

    def release_along(self, clipped_sum: Tensor, name: str, *, batch_size: Optional[int] = None) -> DirectionRelease:
        """A vector release ``(S u + xi) / B`` with ``xi ~ N(0, (noise sigma C)^2 I_d)`` (DPGD-0th).

        ``S`` is the clipped sum of the scalars along ``u``; ``xi`` is generated lazily by the
        perturbation engine from a fresh 128-bit secret key, chunk by chunk.
        """
        std, B = self._declared(name)
        coefficient = self._reduce_sum(clipped_sum) / B
        if not std:
            return DirectionRelease(coefficient, None, 0.0)
        return DirectionRelease(coefficient, self.noise.vector_key(), std / B)

    def release_prefix(self, increment: Tensor, name: str, tree: TreeAggregator, *,
                       batch_size: Optional[int] = None) -> Tensor:
        """The tree mechanism's release (Kornowski et al., Alg. 1): ``(sum over ranks of the increment) / B_t`` joins
        the period's running sum in ``tree``, which returns that sum plus ``TREE(p)``, each node's noise of std
        ``noise sigma C / B``. ``B`` is a regular step's expected size and ``B_t`` this step's (an anchored single
        pass's anchor: ``anchor_weight B``, read from the sampling description at the pass position, never from the
        caller). The plan declares the release with the sensitivity of one leaf's
        :func:`~lit_zodp.privacy.tree.releases_per_leaf` nodes; float64."""
        std, divisor = self._declared(name)
        total = self._reduce_sum(increment)
        weight = self.step_weight()
        return tree.push(total.to(torch.float64) / (divisor * weight), std / divisor, self.noise if std else None)

    def step_weight(self) -> float:
        """This step's expected size over a regular step's: an anchored single pass's
        :meth:`~lit_zodp.privacy.sampling.SinglePassSampling.weight` at its position, else 1."""
        weight = getattr(self.sampling, "weight", None)
        return weight(self.sampling.start + self.fit_steps) if weight is not None else 1.0

    def _declared(self, name: str) -> tuple[float, float]:
        """The noise std of the plan's release ``name`` and the divisor ``B``; the release is recorded for
        :meth:`commit_step`."""
        if self.sampling is None or (self.noise is None and self.is_private):
            raise AccountingError("release() outside a fit: the module plans (and draws its secret noise) at fit start")
        constants = self._constants()
        std = constants.stds.get(name)
        if std is None:
            raise AccountingError(f"Release {name!r} is not in the step plan {[r.name for r in self.step_plan]}")
        self._released.append(name)
        return std, constants.divisor

    # ------------------------------------------------------------------------ accounting
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Commit the step plan to the ledger after every ``optimizer.step()``."""
        optimizer.register_step_post_hook(lambda *_: self.commit_step())
        self._attached.add(optimizer)

    def require_attached(self, optimizers) -> None:
        """Refuse a fit whose optimizer does not commit to the ledger (e.g. LightningCLI's ``optimizer:``
        replacing ``configure_optimizers``): its steps would release without being counted."""
        for optimizer in optimizers:
            if optimizer not in self._attached:
                raise PrivacyConfigError(
                    f"The optimizer {type(optimizer).__name__} was not built by the private module's "
                    "configure_optimizers, so its steps would not be counted in epsilon: remove the `optimizer:` "
                    "/ `lr_scheduler:` override (set the module's `lr`), or attach it with attach_privacy().")

    def commit_step(self) -> None:
        """Record one step: the releases made must be exactly the step plan's.

        A step that released more than its plan is recorded as the steps that cover its releases
        before this raises: those releases are in the weights already.
        """
        released, self._released = self._released, []
        released.sort()
        constants = self._constants()
        planned = constants.names
        steps = 1 if released == planned else _steps_covering(released, planned)  # (the usual step: no call)
        self.fit_steps += steps
        if constants.cost:  # private
            for mechanism, count in constants.cost:
                self.ledger.record(mechanism, count * steps)
        else:
            self.noiseless_steps += steps
        ahead = self._logged_ahead  # (pending steps a checkpoint logged already)
        if self._spend_log is not None:
            self._spend_log.count_step(steps - ahead)
        self.branches[self.branch] += steps
        if ahead:
            self._logged_ahead = 0
        if self.steps_allowed is not None:
            self.steps_allowed -= steps
        if released != planned:
            raise AccountingError(f"This step released {released}, but the step plan declares {planned}")

    @property
    def budget_exhausted(self) -> bool:
        """True when one more step would spend past the budget."""
        return self.steps_allowed is not None and self.steps_allowed <= 0

    @property
    def steps(self) -> int:
        """Steps taken: the ledger's, plus those taken at sigma = 0 (which release nothing to account)."""
        return self.ledger.total_count + self.noiseless_steps

    @property
    def poisson_assumed(self) -> bool:
        """True for ``sampling: shuffle``: its shuffled batches are accounted as Poisson, so its epsilon
        is no guarantee (:data:`~lit_zodp.privacy.sampling.SHUFFLE_WARNING`); every shown epsilon says so."""
        return self._shuffled_before or (self.sampling is not None and self.sampling.name == ShuffledSampling.name)

    @property
    def test_seeded(self) -> bool:
        """True when ``noise_seed`` (test only) keys the noise, now or at any step of the run: anyone with the config
        can subtract it (review 31: a run resumed without the seed showed a plain epsilon over the seeded steps)."""
        return self.noise_seed is not None or self._seeded_before

    def epsilon(self) -> float:
        """Epsilon spent so far (PRV upper bound); 0 before any step, inf without noise (now or at any step)."""
        if self.noiseless_steps:
            return math.inf
        if self.ledger.total_count == 0:
            return 0.0 if self.noise_multiplier != 0 else math.inf
        if not self.is_private:
            return math.inf
        return self.ledger.epsilon(self.delta).upper

    def summary(self) -> str:
        """One line: epsilon, delta, steps, accountant, sigma and sampling; says when epsilon is no guarantee."""
        sampling = f"{self.sampling.name}, q = {self.sampling.sample_rate:.4g}" if self.sampling else "-"
        if not self.is_private and self.noise_multiplier is not None:
            return (f"not private: epsilon = inf after {self.steps} steps (sigma = 0, a noiseless ablation: "
                    f"nothing accounted; {sampling})")
        epsilon = epsilon_text(self.epsilon(), ".4g")
        others = f", {self.other_branch_steps} of them in other branches of this run" if self.other_branch_steps else ""
        bound = ("upper bound ASSUMING POISSON SAMPLING, which shuffled batches do not satisfy: not a guarantee"
                 if self.poisson_assumed else "upper bound")
        if self.test_seeded:
            bound += "; the noise is REPRODUCIBLE from `noise_seed` (tests only): not a guarantee"
        return (f"epsilon = {epsilon} at delta = {self.delta:.3g} after {self.steps} steps{others} "
                f"({self.ledger.accountant.upper()} accountant, {bound}; {self._steps_text(sampling)})")

    def _steps_text(self, sampling: str) -> str:
        """This fit's sigma and sampling where every step of the ledger is of its plan; else each kind of step the
        ledger holds, with its count, as accounted (review 31: 10 steps at sigma 1, q 0.1 and 15 at 0.8, q 0.2 read
        ``after 25 steps (...; sigma = 0.8, poisson, q = 0.2)``, and a fit that took no step showed its own plan)."""
        own = {mechanism for mechanism, _ in self._step_constants.cost} if self._step_constants else set()
        if set(self.ledger.counts) <= own:
            return f"{self._sigma_text()}, {sampling}"
        kinds = [f"{count} at {_mechanism_text(mechanism)}" for mechanism, count in self.ledger.counts.items()]
        return "steps by noise multiplier per step: " + ", ".join(kinds)

    def _sigma_text(self) -> str:
        """``sigma = s``; where a step's releases compose to another multiplier (k directions: each of the k sums is
        noised at ``sigma C``, the step's sensitivity is ``sqrt(k) C``), that one too, as accounted (review 25: the
        summary showed only the per-release sigma, 1 where a two-direction DPZero step is accounted at 0.707)."""
        text = f"sigma = {self.noise_multiplier:.4g}"
        if self.step_plan and self.noise_multiplier:
            per_step = composed_multiplier(self.step_plan, self.noise_multiplier)
            if not math.isclose(per_step, self.noise_multiplier, rel_tol=1e-9):
                text += f" per release, {per_step:.4g} per step"
        return text

    # ----------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """The ledger and the plan. Never the noise or sampling state: those are secret."""
        plan, pending = None, self._log_pending()
        if self._restored_plan is not None:  # loaded, and no fit planned since: a refused one's partial plan is not saved
            # but what its plan counted in the ledger (other branches' steps, their noiseless steps and marks) is, with
            # the ledger (review 35: a resume refused after counting 3 steps of another branch saved ledger 6 and the
            # branch map of 3, and a resume of that file counted the 3 again: 10 steps where 7 ran)
            restored = self._restored_plan
            plan = {**restored, "lineage": self.lineage, "other_branch_steps": self.other_branch_steps,
                    "branches": None if self.branches is None else dict(self.branches),
                    "noiseless_steps": self.noiseless_steps,
                    "poisson_assumed": bool(restored.get("poisson_assumed") or self._shuffled_before),
                    "test_seeded": bool(restored.get("test_seeded") or self._seeded_before)}
        elif self.sampling is not None:
            plan = {"noise_multiplier": self.noise_multiplier, "delta": self.delta, "budget": self.budget,
                    "clip": self.clip, "neighbours": self.neighbours, "planned_steps": self.planned_steps, "sampling": self.sampling.name,
                    "sample_rate": self.sampling.sample_rate, "n": self.sampling.n,
                    "lineage": self.lineage, "other_branch_steps": self.other_branch_steps,
                    "branches": None if self.branches is None else _with_pending(self.branches, self.branch, pending),
                    "noiseless_steps": self.noiseless_steps + (pending if pending and not self._constants().cost else 0),
                    "poisson_assumed": self.poisson_assumed, "test_seeded": self.test_seeded,
                    "split": self.split, "single_pass": self.single_pass}
        return {"ledger": self._ledger_with_pending_releases(pending).state_dict(), "plan": plan}

    def _log_pending(self) -> int:
        """The pending steps (:meth:`_pending_steps`), logged in the spend log now: a checkpoint or a pickle is
        published, whether or not they ever commit."""
        pending = self._pending_steps()
        if pending > self._logged_ahead and self._spend_log is not None:
            self._spend_log.count_step(pending - self._logged_ahead)
            self._logged_ahead = pending
        return pending

    def _pending_steps(self) -> int:
        """The steps that cover the releases no optimizer step has committed yet (at sigma = 0: noiseless steps)."""
        if not (self._released and self._in_fit):
            return 0
        return _steps_covering(sorted(self._released), self._constants().names)

    def _ledger_with_pending_releases(self, pending: int) -> PrivacyLedger:
        """The ledger, with the ``pending`` steps that cover the releases no optimizer step has committed yet.

        A checkpoint written between a step's release and its commit (a failing fit whose own ``on_exception``
        callback raised before the privacy callback's could commit it, then ``trainer.save_checkpoint``; a user's
        callback saving in ``on_before_optimizer_step``) holds a model that may carry the release: its ledger must
        count it (review 25's case, when the fit's end never runs). The plan's branch map counts them too, and so
        does the spend log, at once (review 33): a resume of this checkpoint would otherwise add them again, and a
        rollback to an older one would miss them if the process ended before their commit (the commit then logs only
        the steps not logged yet).
        """
        if not (pending and self._constants().cost):
            return self.ledger
        ledger = copy.deepcopy(self.ledger)
        for mechanism, count in self._constants().cost:
            ledger.record(mechanism, count * pending)
        return ledger

    def load_state_dict(self, state: dict) -> None:
        """Continue the ledger; the checkpoint's budget binds together with the configured one.

        A release still pending from a fit of this object that never reached its end_fit is committed first (review
        35): it is this object's run's, and its commit at the next plan went into the loaded ledger and branch map
        instead (8 steps run, 9 counted, resuming the checkpoint saved after the failure; a KeyError for another run's
        checkpoint). The fit itself is left to the next plan, so a callback's load within a live fit does not end it."""
        self._commit_pending()
        if "ledger" not in state:
            raise PrivacyConfigError("This checkpoint holds no privacy ledger (a non-private run's): a private run "
                                     "cannot resume from it without losing what was spent.")
        accountant = state["ledger"].get("accountant", "prv")
        neighbours = (state.get("plan") or {}).get("neighbours", "add_remove")
        if (accountant, neighbours) != (self.ledger.accountant, self.neighbours):
            raise PrivacyConfigError(
                f"The checkpoint was accounted with accountant={accountant!r}, neighbours={neighbours!r}; this "
                f"run is configured with accountant={self.ledger.accountant!r}, neighbours={self.neighbours!r}. "
                "Resume with the checkpoint's.")
        if self._holds_all_of(state.get("plan") or {}):
            return  # an earlier checkpoint of this run (e.g. the best one, tested after the fit): keep the later ledger
        self.ledger.load_state_dict(state["ledger"])
        # (a checkpoint from before red-team review 17 keeps "private_split", a digest of the private rows' ids: not
        # read, and not written again)
        restored = state.get("plan")
        self._restored_plan = None if restored is None else {k: v for k, v in restored.items() if k != "private_split"}
        plan = self._restored_plan or {}
        self.split = plan.get("split")
        self.single_pass = _restored_pass(plan)
        # (steps before this fit were shuffled: the run's epsilon stays no guarantee)
        self._shuffled_before = bool(plan.get("poisson_assumed") or plan.get("sampling") == ShuffledSampling.name)
        self._seeded_before = bool(plan.get("test_seeded"))  # (its noise is reproducible: the run's epsilon stays none)
        self.lineage, self.other_branch_steps = plan.get("lineage"), plan.get("other_branch_steps", 0)
        self.noiseless_steps = plan.get("noiseless_steps", 0)
        branches = plan.get("branches")  # None in a checkpoint from before branch maps
        self.branches = dict(branches) if branches is not None else (None if self.lineage else {})
        if self._restored_plan is not None:  # for epsilon after load_from_checkpoint; plan() resolves again
            self.delta = self.delta if self.delta is not None else self._restored_plan.get("delta")
            if self.configured_noise_multiplier is None:
                self.noise_multiplier = self._restored_plan.get("noise_multiplier")

    def _holds_all_of(self, plan: dict) -> bool:
        """True when this ledger already holds every step of the checkpoint's: same run (lineage), and
        every branch of the checkpoint at least as far here. Loading the checkpoint's ledger would
        then forget steps whose releases made the model that selected it (``test_ckpt: best``)."""
        theirs = plan.get("branches")
        return (self.lineage is not None and plan.get("lineage") == self.lineage and self.branches is not None
                and theirs is not None and all(self.branches.get(b, 0) >= n for b, n in theirs.items()))


def _restored_pass(plan: dict) -> Optional[list]:
    """A checkpoint's single-pass assignment (n, steps, seed); one from before red-team review 17 gives n and the
    steps, not the seed."""
    if plan.get("single_pass") is not None:
        return list(plan["single_pass"])
    if plan.get("sampling") == SinglePassSampling.name and plan.get("sample_rate"):
        return [plan.get("n"), round(1 / plan["sample_rate"]), None]
    return None


def _padded_pass(assignment: Optional[list]) -> Optional[list]:
    """A recorded assignment with the anchor fields (``anchor_period``, ``anchor_weight``) that one from before
    anchored passes lacks: an unanchored pass's."""
    return None if assignment is None else list(assignment) + [1, 1.0][max(0, len(assignment) - 3):]


def _anchors(assignment: list) -> str:
    period, weight = assignment[3:5]
    return "" if period == 1 else f" (an anchor of {weight:g}x the examples every {period})"


def _mechanism_text(mechanism) -> str:
    """``1.528 (q = 0.1)``: a ledger entry's noise multiplier per step and its sampling."""
    if isinstance(mechanism, SubsampledGaussian):
        return f"{mechanism.noise_multiplier:.4g} (q = {mechanism.sample_rate:.4g})"
    if isinstance(mechanism, Gaussian):
        return f"{mechanism.noise_multiplier:.4g} (full batch)"
    if isinstance(mechanism, SinglePassGaussian):
        return f"{mechanism.noise_multiplier:.4g} (single pass, counted once)"
    return str(mechanism)


def _marks_text(marks: list) -> str:
    """``; marked noiseless, test_seeded: no guarantee`` for the marks of the branches counted (empty without)."""
    return f"; marked {', '.join(marks)}: no guarantee" if marks else ""


def _split_change_error(before: Optional[str], now: Optional[str]) -> Optional[str]:
    """A resume whose private rows are not the checkpoint's (audit, 2026-11-28): rows its steps accounted as private
    could now be public or validation rows, used and logged without noise, with nothing said."""
    if before is None or now is None or before == now:
        return None
    return ("This fit's private split is not the one this run's earlier steps were taken on (another `data_seed`, "
            "fraction, `max_*_samples` or data): rows accounted as private could now be public or validation rows, "
            "used without noise; resume with the data settings of the run's checkpoint")


def _with_pending(branches: dict[str, int], branch: Optional[str], pending: int) -> dict[str, int]:
    """A copy of the branch map with this fit's branch ``pending`` steps further (the checkpoint's ledger counts them)."""
    copied = dict(branches)
    if pending and branch in copied:  # (a noiseless fit has one too since review 31: its pending steps are noiseless)
        copied[branch] += pending
    return copied


def _steps_covering(released: list[str], planned: list[str]) -> int:
    """Steps of the plan that cover ``released`` (at least one): each release counted as often as it ran."""
    return max([1] + [math.ceil(released.count(name) / planned.count(name)) for name in set(released)])


class NonPrivate:
    """The non-private twin of :class:`PrivacyComponent` (same API): mean over the realized batch.

    MeZO, SGD and Adam are their private algorithms with this component: ``release`` all-reduces
    the clipped sum and the realized batch size and divides, with no noise and no accounting.
    """

    private = False
    is_private = False
    budget_exhausted = False
    noise_multiplier = 0.0
    delta = None
    budget = None
    steps_allowed = None

    def __init__(self, *, clip: float = math.inf) -> None:
        check_clip(clip)
        self.clip = float(clip)
        self.sampling = None
        self.step_plan: StepPlan = ()
        self._reduce_sum: ReduceSum = _identity
        self.steps = 0

    def plan(self, *, step_plan: StepPlan, sampling=None, planned_steps=None,
             reduce_sum: Optional[ReduceSum] = _identity, broadcast=_identity, spend_log=None,
             split=None) -> None:
        self.step_plan, self.sampling, self._reduce_sum = tuple(step_plan), sampling, reduce_sum or _identity

    in_fit = False

    def end_fit(self) -> None:
        pass

    def release(self, clipped_sum: Tensor, name: str, *, batch_size: int, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The mean in the sum's dtype: ``dtype`` is where a noised release would round, and nothing is noised."""
        if self._reduce_sum is _identity:  # one process: the realized size is a Python int already
            return clipped_sum / float(max(batch_size, 1))
        size = torch.full((1,), float(batch_size), device=clipped_sum.device, dtype=clipped_sum.dtype)
        reduced = self._reduce_sum(torch.cat([clipped_sum.reshape(-1), size]))
        return (reduced[:-1] / reduced[-1].clamp_min(1.0)).reshape(clipped_sum.shape)

    def release_along(self, clipped_sum: Tensor, name: str, *, batch_size: int) -> DirectionRelease:
        return DirectionRelease(self.release(clipped_sum, name, batch_size=batch_size), None, 0.0)

    def release_prefix(self, increment: Tensor, name: str, tree: TreeAggregator, *, batch_size: int) -> Tensor:
        """The period's running sum of the increments' means over the realized batches, with no noise."""
        return tree.push(self.release(increment.to(torch.float64), name, batch_size=batch_size), 0.0, None)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_post_hook(lambda *_: self.commit_step())

    def commit_step(self) -> None:
        self.steps += 1

    def epsilon(self) -> float:
        return math.inf

    def summary(self) -> str:
        return f"non-private (no noise) after {self.steps} steps"

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def config_errors(clip, target_epsilon, noise_multiplier, delta, max_epsilon, eps_error) -> list:
    """Every problem of a privacy configuration, as messages naming the option."""
    errors = [*clip_errors("clip", clip, target_epsilon, noise_multiplier), check_positive("eps_error", eps_error)]
    if (target_epsilon is None) == (noise_multiplier is None):
        errors.append("Give exactly one of `target_epsilon` and `noise_multiplier` "
                      f"(got target_epsilon={target_epsilon}, noise_multiplier={noise_multiplier})")
    for name, value in (("target_epsilon", target_epsilon), ("max_epsilon", max_epsilon)):
        if value is not None:
            errors.append(check_positive(name, value) or _accountable_epsilon(name, value))
    errors.append(_calibration_error(target_epsilon, eps_error))
    if noise_multiplier is not None:
        errors.append(check_non_negative("noise_multiplier", noise_multiplier))
    if max_epsilon is not None and noise_multiplier == 0:  # (a number: a bad value is named above)
        errors.append(f"`max_epsilon`={max_epsilon} cannot bind a noiseless run (`noise_multiplier`=0: its epsilon is "
                      "infinite): drop max_epsilon for an ablation, or give a noise_multiplier > 0")
    if delta is not None:
        errors.append(check_delta(delta))
    return errors


def clip_errors(name: str, clip, target_epsilon, noise_multiplier, noise_std: str = "sigma * clip") -> list:
    """A clip ``name``: positive, and finite where the run adds noise (its noise std, ``noise_std``, is a multiple)."""
    errors = [check_positive(name, clip, allow_inf=True)]
    if isinstance(clip, (int, float)) and math.isinf(clip) and (target_epsilon is not None or noise_multiplier):
        errors.append(f"Expected a finite `{name}` for a private run (noise std is {noise_std}), but got inf")
    return errors


def budget_order_error(target_epsilon: Optional[float], max_epsilon: Optional[float]) -> Optional[str]:
    """A new run whose budget is below its calibration target: sigma is calibrated to spend ``target_epsilon``
    over the planned steps, so ``max_epsilon`` would stop it early (or before its first step).

    Not part of :func:`config_errors`: on a resume, sigma is the checkpoint's and both only bind as
    budgets, so a stricter ``max_epsilon`` there is legitimate. The component checks it when it
    calibrates; the CLI when it parses a ``fit`` without ``ckpt_path``.
    """
    if target_epsilon is None or max_epsilon is None or max_epsilon >= target_epsilon:
        return None
    return (f"Expected `max_epsilon` >= `target_epsilon` for a new run (sigma is calibrated to spend "
            f"target_epsilon over the planned steps), but got max_epsilon={max_epsilon:g} < "
            f"target_epsilon={target_epsilon:g}: set target_epsilon={max_epsilon:g}, or drop max_epsilon")


NEIGHBOURS = {"add_remove": 1.0, "replace_one": 2.0}
ACCOUNTANTS = ("prv", "rdp")


def _accountable_epsilon(name: str, value: float) -> Optional[str]:
    if value > MAX_EPSILON:
        return (f"Expected `{name}` <= {MAX_EPSILON:g} (the PRV accountant cannot certify more, and such "
                f"an epsilon promises nothing), but got {value!r}")
    return None


def _calibration_error(target_epsilon, eps_error) -> Optional[str]:
    """Sigma is calibrated to an upper bound on epsilon within ``eps_error`` of the estimate, so a target at or
    below that error cannot be met (refused before a fit starts, rather than at its calibration)."""
    numbers = all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in (target_epsilon, eps_error))
    if not numbers or eps_error < target_epsilon:
        return None
    return (f"Expected `target_epsilon` above `eps_error`={eps_error:g} (the accountant's error bound on epsilon), but "
            f"got {target_epsilon:g}: give a smaller eps_error, e.g. {target_epsilon / 10:g}")


def _budget_kept_note(configured: Optional[float], runs: Optional[float]) -> Optional[str]:
    """A line when the configured budget is above the run's (its checkpoint's, or this object's last fit's): the
    smaller binds, so the larger one is dropped, which only the planned steps showed before (review 31: a Python
    resume with `target_epsilon` 5 of a run budgeted at 2 said "allows 0 more steps" and nothing else)."""
    if configured is None or runs is None or configured <= runs:
        return None
    return (f"The configured budget epsilon={configured:g} (`target_epsilon`/`max_epsilon`) is above this run's "
            f"budget {runs:g} from its earlier steps: the smaller binds, as a run's budget cannot grow once spent from")


def _warn_if_any(note: Optional[str]) -> None:
    if note:
        warnings.warn(note, LitZodpWarning, stacklevel=4)


def _smallest(*values: Optional[float]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return min(present) if present else None


__all__ = ["DirectionRelease", "MAX_EPSILON", "NonPrivate", "PrivacyComponent", "budget_order_error",
           "clip_errors", "config_errors"]
