"""PAZO (Gong & Li, "Private Zeroth-Order Optimization with Public Data", NeurIPS 2025): PAZO-M (Alg. 1),
PAZO-P (Alg. 2, orthonormalised or column-normalised) and PAZO-S (Alg. 3), and their non-private twins.

Each step forwards the private batch only through :meth:`~lit_zodp.algorithms.base.AlgorithmModule.private_losses`
(no autograd) and backpropagates through PUBLIC batches only; the directions, the public gradients and PAZO-S's
exploration noise are data-independent of the private set. What a step releases is a vector of clipped scalar sums.

Choices where the paper is silent or where its text and the authors' code (github.com/xuchengong/PAZO) differ:

* Public batches (Alg. 1-3 line 1). The DataModule hands one public batch with every private batch
  (``public_in_step: true``); PAZO-P and PAZO-S cut it into ``k`` consecutive parts of equal size (``b'`` each: set
  ``public_batch_size`` to ``k b'``). The proofs treat the ``k`` batches as disjoint parts of one batch (App. B); the
  code draws ``k`` consecutive batches of a cycling loader, which is the same stream.
* Directions. PAZO-M's ``u`` is ``d^(-1/4)`` times the module's ``directions`` law: ``"gaussian"``
  (``N(0, I)/d^(1/4)``, the code and App. C.1) or ``"sphere"`` (uniform on the ``d^(1/4)`` sphere, Alg. 1 line 5);
  ``d`` counts the trainable parameters. PAZO-P's coefficients are ``N(0, I_k)`` (the code; Alg. 2's ``sqrt(k)``
  sphere has the same second moment).
* Noise and neighbours (Sec. 3, Eq. 2). Each of the ``q`` queries (PAZO-S: ``k`` or ``k+1``) releases a sum of
  per-example values clipped to ``[-C, C]`` plus ``N(0, m C^2 sigma^2)``, ``m`` the number of queries, divided by
  the EXPECTED batch size ``b``; under add/remove-one neighbours the ``m`` releases compose into one Gaussian
  mechanism of multiplier ``sigma`` (the plan's sensitivities and noises), subsampled at the DataModule's rate
  (Poisson by default; the code's loaders shuffle, its accountant assumes Poisson) and accounted with the PRV
  accountant (``accountant="rdp"``: the code's RDP).
* PAZO-S's exploration candidate (Alg. 3 lines 4-6) is released after the first ``k`` losses (adaptive composition,
  the same total); it replaces the best candidate only if its noisy loss is strictly lower (the code). Its noise
  ``z' ~ N(0, epsilon^2 I)`` is public randomness (from the run seed and the step): it is not a privacy noise.
* Non-finite private losses (PAZO-S, Alg. 3 line 6; the paper is silent): a NaN loss counts as ``+inf``, the worst
  loss, clipped to ``C`` (:func:`clipped_loss_sum`); the library's rule for differences, NaN as 0, would make a
  diverged queried point the best candidate.
* Public gradients (line 2) are taken in eval mode (no dropout), as every forward of a zeroth-order step here; the
  authors' code takes them in train mode.
* Weight decay (not in the paper, whose optimiser is plain SGD) is decoupled and applied in the update only; PAZO-S's
  queried points are ``x_t - eta g_j`` without it, so with ``weight_decay > 0`` the step leaves the queried point.
* Output: the last iterate (the code's evaluation).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lit_zodp.algorithms.dpzero import DERIVATIVES, DPZero
from lit_zodp.algorithms.public import PublicBatches
from lit_zodp.backbones.base import batch_size_of
from lit_zodp.errors import check_choice, check_non_negative, check_positive_int, raise_if_any
from lit_zodp.privacy import GaussianRelease, StepPlan, clipped_fraction, clipped_sum
from lit_zodp.zo import central_differences, derive_seed
from lit_zodp.zo.subspace import SubspacePerturbation, normalize_columns_, orthonormalize_

BASES = ("orthonormal", "normalized")
CANDIDATE_LOSSES = "candidate losses"
EXPLORED_LOSS = "explored loss"
#: Spawn key of PAZO-S's exploration noise ``z'`` (public: run seed and step).
EXPLORATION_STREAM = 0x9A20


def clipped_loss_sum(losses: Tensor, clip: float) -> Tensor:
    """Alg. 3 line 6's ``sum_i clip_C(f(x_t - eta g_j; xi_i))`` with a NaN loss (a forward that overflowed at the
    queried point) counted as the worst loss, ``+inf``, so clipped to ``C`` (``C = inf``: an infinite sum).
    :func:`~lit_zodp.privacy.clipped_sum` counts a non-finite value as 0, neutral for a difference but the best of
    losses: a candidate whose point diverged won line 8's argmin and made every weight NaN (review 53). Each value
    stays in ``[-C, C]``: the sensitivity is unchanged."""
    worst = torch.where(torch.isnan(losses), torch.full_like(losses, math.inf), losses)
    return worst.sum(dtype=torch.float64) if math.isinf(clip) else clipped_sum(worst, clip)


class _PublicAssisted(PublicBatches, DPZero):
    """What the three PAZO variants share: ``k`` public batches per step and a release of ``m`` queries at ``m``
    times the variance, which compose into one query at multiplier ``sigma`` (Sec. 3)."""

    abstract = True

    def step_plan(self) -> StepPlan:
        """PAZO-M/P: the q-vector of clipped sums, each with noise std ``sqrt(q) sigma C``: one query at ``sigma``."""
        q = self.num_directions
        return (GaussianRelease(DERIVATIVES, sensitivity=math.sqrt(q), noise=math.sqrt(q)),)


class PAZOM(_PublicAssisted):
    """PAZO-M, Algorithm 1: a public gradient mixed with a private two-point estimate.

    Each step t:
      line 1   draw a private batch B (Poisson) and a public batch B';
      line 2   g_pub = grad f(x_t; B') by backprop on B' only, at the unperturbed x_t;
      l. 4-6   for j = 1..q: u_j on the d^(1/4) sphere (or N(0, I)/d^(1/4)), public from (run seed, t, j);
               s_j = ((1/b) sum_i clip_C((f(x_t + lam u_j; xi_i) - f(x_t - lam u_j; xi_i)) / (2 lam)) + z_j),
               z_j ~ (1/b) N(0, q C^2 sigma^2);
      line 8   x_{t+1} = x_t - eta (alpha g_pub + (1 - alpha) (1/q) sum_j s_j u_j).

    Args (besides :class:`~lit_zodp.algorithms.DPZero`'s; ``num_directions`` is ``q``):
        alpha: the public gradient's weight, in [0, 1] (Table 12's grid: 0.25, 0.5, 0.75). ``alpha = 0`` is
            DPZero with the ``d^(1/4)`` radius.
    """

    non_private_twin = "NonPrivatePAZOM"

    def __init__(self, backbone: nn.Module, *, alpha: float = 0.5, **kwargs: Any) -> None:
        raise_if_any([None if 0.0 <= alpha <= 1.0 else f"Expected `alpha` in [0, 1], but got {alpha!r}",
                      None if alpha != 1.0 or not self.private else
                      "`alpha` = 1 steps along the public gradient alone and multiplies every private release by 0: "
                      "it would spend privacy for nothing; train on public data without privacy "
                      "(configs/pazo/quickstart_public_only.yaml) or set alpha < 1"])
        super().__init__(backbone, **kwargs)
        self.alpha = float(alpha)

    @property
    def radius_factor(self) -> float:
        """``d^(-1/4)``: the module's direction law (``E||u||^2 = d``) rescaled to ``E||u||^2 = sqrt(d)`` (App. A.1)."""
        return self.engine.dim ** -0.25

    @property
    def coordinate_step(self) -> float:
        """``lam d^(-1/4)``: line 7's ``u`` is ``d^(-1/4)`` times a standard direction (the low-precision note)."""
        return self.lam * self.radius_factor

    @property
    def update_scale(self) -> float:
        """``(1 - alpha) d^(-1/4) / q``: line 8's weight of each released ``s_j`` times the engine's ``u_0``."""
        return (1.0 - self.alpha) * self.radius_factor / self.num_directions

    def directional_differences(self, seed: int, inputs, targets) -> Tensor:
        """``(f(x + lam u) - f(x - lam u)) / (2 lam)`` per example with ``u = d^(-1/4) u_0``, ``u_0`` the engine's
        direction: the engine moves by ``lam d^(-1/4) u_0``. Leaves ``x - lam u`` pending."""
        r = self.radius_factor
        return r * central_differences(self.engine, seed, self.lam * r, lambda: self.private_losses(inputs, targets))

    def training_step(self, batch, batch_idx: int) -> None:
        inputs, targets = self.private_batch(batch)                                          # line 1
        size = batch_size_of(inputs)
        public_gradient = (self.finite_public_gradient(self.public_batches(batch, 1)[0], self.engine.params)  # l. 2
                           if self.alpha > 0 else None)
        seeds = self.direction_seeds()                                                       # line 5
        derivatives, differences = self.released_derivatives(seeds, inputs, targets, size)  # line 6: clip, + z, / b
        dense = [(public_gradient, self.alpha)] if public_gradient is not None else []       # g~ = sum_j s_j u_j
        self.update(dict(zip(seeds, derivatives.unbind())), scale=self.update_scale, dense=dense)  # line 8
        self.log_step(size, lambda: clipped_fraction(torch.cat(differences), self.clip))


class PAZOP(_PublicAssisted):
    """PAZO-P, Algorithm 2: a private two-point search inside the span of k public gradients.

    Each step t:
      line 1   draw a private batch B (Poisson) and k public batches B'_1..B'_k;
      l. 2-3   g_j = grad f(x_t; B'_j); G = [g_1..g_k], orthonormalised by Gram-Schmidt (``basis="orthonormal"``,
               PAZO-P) or column-normalised (``basis="normalized"``, PAZO-P');
      l. 5-7   for j = 1..q: u_j ~ N(0, I_k), public; v_j = G u_j;
               s_j = ((1/b) sum_i clip_C((f(x_t + lam v_j; xi_i) - f(x_t - lam v_j; xi_i)) / (2 lam)) + z_j),
               z_j ~ (1/b) N(0, q C^2 sigma^2);
      line 9   x_{t+1} = x_t - eta (1/q) sum_j s_j G u_j.

    Args (besides :class:`~lit_zodp.algorithms.DPZero`'s; ``num_directions`` is ``q``):
        k: public gradients per step (the reported results: 3 or 6).
        basis: ``"orthonormal"`` (PAZO-P) or ``"normalized"`` (PAZO-P').
    The update stays in ``col(G)``; memory ``O(k d)`` (the basis). ``directions`` and ``perturbation`` do not
    apply (the directions are ``G u``).
    """

    non_private_twin = "NonPrivatePAZOP"

    def __init__(self, backbone: nn.Module, *, k: int = 3, basis: str = "orthonormal", **kwargs: Any) -> None:
        raise_if_any([
            check_positive_int("k", k),
            check_choice("basis", basis, BASES),
            None if kwargs.get("directions", "gaussian") == "gaussian" and kwargs.get("perturbation", "auto") == "auto"
            else "PAZO-P's directions are G u in the public subspace: leave `directions` and `perturbation` unset",
        ])
        super().__init__(backbone, **kwargs)
        self.k, self.basis = int(k), basis

    @property
    def coordinate_step(self) -> float:
        """``lam sqrt(k / d)``: the root mean square of a coordinate of ``lam G u`` (``E ||G u||^2 = k`` for unit
        columns and ``u ~ N(0, I_k)``), the scale the low-precision note measures rounding at. An estimate: ``G``
        may concentrate on a few coordinates, which it then moves by more."""
        return self.lam * math.sqrt(self.k / self.engine.dim)

    def make_engine(self, params: list[nn.Parameter], offsets=None, cache=None) -> SubspacePerturbation:
        return SubspacePerturbation(params, self.k)

    def public_basis(self, public_batches: list) -> list[Tensor]:
        """Lines 2-3: ``G`` as one ``[k, *p.shape]`` tensor per parameter (float32, float64 for float64 weights)."""
        params = self.engine.params
        basis = [torch.empty((self.k, *p.shape), dtype=torch.promote_types(p.dtype, torch.float32), device=p.device)
                 for p in params]
        for j, public in enumerate(public_batches):
            for b, g in zip(basis, self.finite_public_gradient(public, params)):
                b[j].copy_(g)
        (orthonormalize_ if self.basis == "orthonormal" else normalize_columns_)(basis)
        return basis

    def training_step(self, batch, batch_idx: int) -> None:
        inputs, targets = self.private_batch(batch)                                          # line 1
        size = batch_size_of(inputs)
        self.engine.set_basis(self.public_basis(self.public_batches(batch, self.k)))       # lines 2-3
        seeds = self.direction_seeds()                                                       # line 5: u_j
        derivatives, differences = self.released_derivatives(seeds, inputs, targets, size)  # line 6: clip, + z, / b
        self.update(dict(zip(seeds, derivatives.unbind())), scale=self.update_scale)        # line 9
        self.log_step(size, lambda: clipped_fraction(torch.cat(differences), self.clip))


class PAZOS(_PublicAssisted):
    """PAZO-S, Algorithm 3: the best of k public gradients, chosen by noisy private losses.

    Each step t:
      line 1   draw a private batch B (Poisson) and k public batches B'_1..B'_k;
      line 2   g_j = grad f(x_t; B'_j) (raw batch means);
      line 3   f_j = (1/b) (sum_i clip_C(f(x_t - eta g_j; xi_i)) + z_j), z_j ~ N(0, m C^2 sigma^2),
               m = k + 1 (k without exploration);
      line 4   j_hat = argmin_j f_j;
      l. 5-7   (``exploration > 0``) g_{k+1} = g_j_hat + z', z' ~ N(0, epsilon^2 I) public; f_{k+1} as line 3;
               j* = k+1 if f_{k+1} < f_j_hat, else j_hat;
      line 8   x_{t+1} = x_t - eta g_j*   (eta: the current ``lr``; x_{t+1} is the queried point).

    Args (besides :class:`~lit_zodp.algorithms.DPZero`'s; ``lam``, ``num_directions`` and ``directions`` do not
    apply):
        k: public gradients per step (the paper: 3).
        exploration: the exploration std ``epsilon`` (Table 13: 1e-2, 1e-3; 0: no exploration candidate).
    """

    non_private_twin = "NonPrivatePAZOS"

    def __init__(self, backbone: nn.Module, *, k: int = 3, exploration: float = 0.0, **kwargs: Any) -> None:
        raise_if_any([check_positive_int("k", k), check_non_negative("exploration", exploration),
                      None if kwargs.get("num_directions", 1) == 1 else
                      f"PAZO-S queries the k public gradients, not random directions: leave `num_directions` unset "
                      f"(got {kwargs['num_directions']})"])
        super().__init__(backbone, **kwargs)
        self.k, self.exploration = int(k), float(exploration)

    #: Nothing is perturbed in place: each queried point is copied back exactly (no low-precision note on ``lam``).
    coordinate_step = None

    @property
    def queries(self) -> int:
        """``m``: the private loss queries per step, ``k`` plus the exploration candidate's."""
        return self.k + (1 if self.exploration > 0 else 0)

    def step_plan(self) -> StepPlan:
        """The k candidate losses (sensitivity ``sqrt(k) C``), then the explored one (``C``), each with noise std
        ``sqrt(m) sigma C``: one query at ``sigma``."""
        m = math.sqrt(self.queries)
        plan = (GaussianRelease(CANDIDATE_LOSSES, sensitivity=math.sqrt(self.k), noise=m),)
        return plan + ((GaussianRelease(EXPLORED_LOSS, noise=m),) if self.exploration > 0 else ())

    @torch.no_grad()
    def clipped_loss_at(self, start: list[Tensor], step: list[Tensor], eta: float, inputs, targets) -> tuple:
        """``sum_i clip_C(f(x_t - eta g; xi_i))`` and the losses: the parameters are set to ``x_t - eta g`` (the
        update's own arithmetic) for the forward, then back to ``x_t`` exactly."""
        params = self.engine.params
        for p, x, g in zip(params, start, step):
            p.copy_(x).add_(g.to(p.dtype), alpha=-eta)
        try:
            losses = self.private_losses(inputs, targets)
        finally:
            for p, x in zip(params, start):
                p.copy_(x)
        return clipped_loss_sum(losses, self.clip), losses

    def exploration_candidate(self, best: list[Tensor]) -> list[Tensor]:
        """Line 5: ``g_j_hat + z'``, ``z' ~ N(0, epsilon^2 I)`` drawn from the public (run seed, step)."""
        generator = torch.Generator().manual_seed(derive_seed(self.run_seed, self.global_step, EXPLORATION_STREAM))
        return [g + self.exploration * torch.randn(g.shape, generator=generator, dtype=torch.float32).to(g)
                for g in best]

    def training_step(self, batch, batch_idx: int) -> None:
        inputs, targets = self.private_batch(batch)                                          # line 1
        size = batch_size_of(inputs)
        params, eta = self.engine.params, self.zo_optimizer.param_groups[0]["lr"]
        candidates = [self.public_gradient(public, params) for public in self.public_batches(batch, self.k)]  # l. 2
        start = [p.detach().clone() for p in params]
        sums, losses = zip(*(self.clipped_loss_at(start, g, eta, inputs, targets) for g in candidates))  # line 3
        released = self.privacy.release(torch.stack(sums), CANDIDATE_LOSSES, batch_size=size, dtype=self.loss_dtype)
        chosen = int(torch.argmin(released))                                                 # line 4
        if self.exploration > 0:                                                              # lines 5-7
            explored = self.exploration_candidate(candidates[chosen])
            explored_sum, explored_losses = self.clipped_loss_at(start, explored, eta, inputs, targets)
            losses += (explored_losses,)
            explored_value = self.privacy.release(explored_sum, EXPLORED_LOSS, batch_size=size, dtype=self.loss_dtype)
            if float(explored_value) < float(released[chosen]):
                candidates[chosen] = explored
        self.update({}, dense=[(candidates[chosen], 1.0)])                                  # line 8
        self.log_step(size, lambda: clipped_fraction(torch.cat(losses), self.clip))


class NonPrivatePAZOM(PAZOM):
    """PAZO-M without privacy: no noise, the mean over the realized batch, ``clip = inf`` by default."""

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, **kwargs)


class NonPrivatePAZOP(PAZOP):
    """PAZO-P without privacy: no noise, the mean over the realized batch, ``clip = inf`` by default."""

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, **kwargs)


class NonPrivatePAZOS(PAZOS):
    """PAZO-S without privacy: the true clipped losses pick the candidate; ``clip = inf`` by default."""

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, **kwargs)


__all__ = ["NonPrivatePAZOM", "NonPrivatePAZOP", "NonPrivatePAZOS", "PAZOM", "PAZOP", "PAZOS"]
