"""The zeroth-order family base: the seeded in-place perturbation engine and the verbs of ZO papers.

The module owns the perturbation engine (perturb, central differences, the fused
restore-and-update): the chunked :class:`~lit_zodp.zo.PerturbationEngine` (any direction law, CPU
threads) or the fused :class:`~lit_zodp.zo.fused.FusedPerturbation` (one Triton launch per dtype and
pass, Gaussian law, coefficients left on the device); the registered :class:`~lit_zodp.zo.ZOSGD`
optimizer only applies the coefficients it is handed, so Lightning counts steps and the privacy
component commits each one. A private batch is forwarded only through ``private_losses`` (no
autograd, eval mode).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lit_zodp.algorithms.base import AlgorithmModule, remaining_steps
from lit_zodp.errors import (
    ConfigError,
    LitZodpWarning,
    check_choice,
    check_non_negative,
    check_positive,
    check_positive_int,
    raise_if_any,
)
from lit_zodp.per_example.checks import frozen_statistics_note, refuse_batch_statistics
from lit_zodp.privacy import DirectionRelease
from lit_zodp.zo import ZOSGD, PerturbationEngine, central_differences, derive_seed, make_direction_law
from lit_zodp.zo.eval_mode import EvalMode, eval_mode_cache_owners
from lit_zodp.zo.fused import SUPPORTED_DTYPES as FUSED_DTYPES, FusedPerturbation, triton_available
from lit_zodp.zo.perturbation import DirectionCache
from lit_zodp.zo.precision import low_precision_note, rounding_loss

DIRECTION_LAWS = ("gaussian", "sphere")
PERTURBATION_ENGINES = ("auto", "chunked", "fused")


class ZerothOrderModule(AlgorithmModule):
    """Base of the ZO algorithms.

    Args (besides :class:`AlgorithmModule`'s):
        weight_decay: decoupled weight decay, applied to tensors of 2+ dimensions only.
        lam: smoothing parameter ``lambda`` of the two-point estimator.
        num_directions: directions ``u`` per step (the estimate averages them).
        directions: ``"gaussian"`` (the papers' experiments) or ``"sphere"`` (radius ``sqrt(d)``).
        perturbation: the engine: ``"chunked"`` (torch generators chunk by chunk), ``"fused"``
            (Philox in a Triton kernel; on CPU its torch reference, exact but slow: for tests), or
            ``"auto"``: fused for Gaussian directions on CUDA with Triton, chunked otherwise. The
            two engines draw different (equally distributed) directions for the same seed.
    """

    abstract = True
    #: Whether the update adds a secret d-dimensional noise vector (DPGD-0th): chunked engine only.
    vector_noise = False

    def __init__(self, backbone: nn.Module, *, weight_decay: float = 0.0, lam: float = 1e-3,
                 num_directions: int = 1, directions: str = "gaussian", perturbation: str = "auto",
                 **kwargs: Any) -> None:
        raise_if_any([
            check_non_negative("weight_decay", weight_decay),
            check_positive("lam", lam),
            check_positive_int("num_directions", num_directions),
            check_choice("directions", directions, DIRECTION_LAWS),
            check_choice("perturbation", perturbation, PERTURBATION_ENGINES),
            None if perturbation != "fused" or directions == "gaussian" else
            f"`perturbation='fused'` draws Gaussian directions, but got directions={directions!r}: "
            f"use perturbation='chunked'",
            None if perturbation != "fused" or not self.vector_noise else
            f"{type(self).__name__} adds a secret noise vector the fused engine does not draw: "
            f"use perturbation='chunked'",
        ])
        super().__init__(backbone, **kwargs)
        if self.private:
            refuse_batch_statistics(self.backbone)
        note = frozen_statistics_note(self.backbone)
        if note:
            rank_zero_warn(note, category=LitZodpWarning)
        self.weight_decay = weight_decay
        self.lam = lam
        self.num_directions = num_directions
        self.directions = directions
        self.perturbation = perturbation
        self.engine: Optional[PerturbationEngine | FusedPerturbation] = None
        self._eval_mode = EvalMode()
        self._eval_mode_caches = eval_mode_cache_owners(self.backbone)  # (read again with the engine)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.backbone.parameters() if p.requires_grad]

    def parameter_groups(self) -> list[dict]:
        """The optimizer's param groups: weight decay on 2+-dimensional tensors only; ``lr`` is the module's."""
        decay = [p for p in self.trainable_parameters() if p.ndim >= 2]
        no_decay = [p for p in self.trainable_parameters() if p.ndim < 2]
        return [g for g in ({"params": decay, "weight_decay": self.weight_decay},
                            {"params": no_decay, "weight_decay": 0.0}) if g["params"]]

    def configure_optimizers(self):
        groups = self.parameter_groups()
        self.engine = self.make_engine([p for g in groups for p in g["params"]])
        self._eval_mode_caches = eval_mode_cache_owners(self.backbone)
        return self.with_scheduler(self.attach_privacy(ZOSGD(groups, lr=self.lr, engine=self.engine)))

    def make_engine(self, params: list[nn.Parameter], offsets: Optional[list[int]] = None,
                    cache: Optional[DirectionCache] = None) -> PerturbationEngine | FusedPerturbation:
        """The engine ``perturbation`` names (``"auto"``: fused where it is the fast path).

        ``offsets``: the fused engine's global element offsets of ``params`` (a subset of a larger
        layout, e.g. one block of MeZO-BCD); ignored by the chunked engine. ``cache``: the chunked
        engine's :class:`~lit_zodp.zo.perturbation.DirectionCache`; the fused engine draws ``u`` in
        registers and needs none.
        """
        if self.uses_fused_engine(params):
            return FusedPerturbation(params, offsets=offsets, backend="triton" if params[0].is_cuda else "reference")
        return PerturbationEngine(params, make_direction_law(self.directions), cache=cache)

    def uses_fused_engine(self, params: list[nn.Parameter]) -> bool:
        """``"auto"`` takes the fused kernel only for the dtypes it has (not float64: ``precision="64-true"``)."""
        return self.perturbation == "fused" or (
            self.perturbation == "auto" and self.directions == "gaussian" and not self.vector_noise
            and params[0].is_cuda and all(p.dtype in FUSED_DTYPES for p in params) and triton_available())

    @property
    def zo_optimizer(self) -> ZOSGD:
        optimizer = self.optimizers()
        return getattr(optimizer, "optimizer", optimizer)

    def on_train_start(self) -> None:
        super().on_train_start()
        self._warn_low_precision()

    def _warn_low_precision(self) -> None:
        """One line at fit start where 16-bit weights round the step's in-place passes (review 30,
        :mod:`lit_zodp.zo.precision`): measured once on a sample of the trained weights (no data). Before, a
        ``bf16-true`` fit ran silently with its perturbations off by 24% at ``lam`` 1e-3 and its weights drifting 16%
        of their norm in 2000 steps at ``lr`` 0 (a digits MLP: test accuracy 0.917 -> 0.892 without learning)."""
        if self.engine is None or self.coordinate_step is None or not self.trainer.is_global_zero:
            return
        step = self.coordinate_step
        note = low_precision_note(rounding_loss(self.engine.params, step), self.lam, type(self).__name__,
                                  remaining_steps(self.trainer), self.perturbed_share())
        if note:
            rank_zero_warn(note, category=LitZodpWarning)

    @property
    def coordinate_step(self) -> Optional[float]:
        """The in-place perturbation ``lam u`` per unit of a standard normal coordinate (``lam``: ``u ~ N(0, I)``), the
        scale the low-precision note measures rounding at; ``None``: nothing is perturbed in place."""
        return self.lam

    def perturbed_share(self) -> float:
        """The share of steps that perturb a given parameter (1: every step perturbs every parameter)."""
        return 1.0

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self._refuse_changed_trainable_parameters()

    def _refuse_changed_trainable_parameters(self) -> None:
        """The engine perturbs and updates the tensors that were trainable when the fit built it. A parameter unfrozen
        since (Lightning's ``BaseFinetuning``), frozen, or replaced (``load_state_dict(assign=True)``) would be left
        untrained, or trained against the user's wish, silently (review 24: an unfrozen layer moved by 0.0): refused
        at the next epoch's start, in one line (one walk over the parameters per epoch)."""
        if self.engine is None:
            return
        built, now = {id(p) for p in self.engine.params}, {id(p) for p in self.trainable_parameters()}
        if built != now:
            raise ConfigError(
                f"The trainable parameters changed during the fit ({len(now - built)} new or unfrozen, "
                f"{len(built - now)} frozen or replaced): a zeroth-order module perturbs the tensors trainable when "
                "its fit started; freeze, unfreeze or load weights before `fit` (a new fit from a checkpoint)")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        self._eval_mode.ensure(self.backbone)  # the two-point passes must see the same function (no dropout)
        return super().on_train_batch_start(batch, batch_idx)

    # ------------------------------------------------------------------------------ verbs
    def direction_seeds(self) -> list[int]:
        """Seeds of this step's directions ``u_1..u_q``: public, from (run seed, step)."""
        return [derive_seed(self.run_seed, self.global_step, k) for k in range(self.num_directions)]

    def directional_differences(self, seed: int, inputs, targets) -> Tensor:
        """Per-example ``(f(x + lam u; xi_i) - f(x - lam u; xi_i)) / (2 lam)``; leaves ``x - lam u`` pending."""
        return central_differences(self.engine, seed, self.lam, lambda: self.private_losses(inputs, targets))

    def public_gradient(self, public_batch, params=None):
        """The public gradient at the UNPERTURBED point: call it before perturbing or after the update."""
        if self.engine is not None and self.engine.pending:
            raise RuntimeError("public_gradient() while a perturbation is pending: restore the parameters first")
        return super().public_gradient(public_batch, params)

    @property
    def update_scale(self) -> float:
        """``a`` in the step ``x <- x - lr a sum_j c_j u_j`` over the released coefficients ``c_j`` and the engine's
        directions ``u_j``: ``1 / k`` for the k directions' average (an auditor reads the release through it)."""
        return 1.0 / self.num_directions

    def restore(self) -> None:
        """Undo the pending perturbation (when the next direction is probed before the update)."""
        self.engine.restore_()

    def update(self, coefficients: Mapping[int, Tensor | float], scale: float = 1.0,
               noise: Optional[DirectionRelease] = None, dense: Sequence[tuple[Sequence[Tensor], float]] = ()) -> None:
        """``x <- x - lr * scale * sum_k c_k u_k`` (minus the release's secret noise vector), fused with the restore;
        ``dense``: ``(g, a)`` pairs adding ``-lr * a * g`` for public vectors ``g`` (one tensor per parameter)."""
        # tensors stay on the device; scale 1 (one direction) launches nothing
        terms = {seed: c if scale == 1.0 else c * scale for seed, c in coefficients.items()}
        noise_terms = []
        if noise is not None and noise.noise is not None:
            noise_terms = [(noise.noise, noise.noise_coefficient)]
        self.zo_optimizer.set_coefficients(terms, noise_terms, dense)
        self.step_optimizer()


__all__ = ["ZerothOrderModule"]
