"""O2NC with private zeroth-order oracles (Kornowski, Liu & Talwar, "Improved Sample Complexity for Private
Nonsmooth Nonconvex Optimization"): Alg. 2, the online-to-nonconvex conversion of Cutkosky et al., fed by the
single-pass oracle of Alg. 3 (variance-reduced increments, privatized by the tree mechanism of Alg. 1) or the
multi-pass oracle of Alg. 4 (a fresh Gaussian per step, added to the last noisy estimate). ``estimator="first_order"``
replaces eq. 4's estimate by eq. 10's gradients at random points of the ball (Alg. 5 in the single pass, Thm. 6.1;
Sec. 6 notes that the multi-pass oracle takes it the same way).

Choices where the paper is silent, or where its text is off (reading notes, Sec. 6):

* Sensitivity by clipping, not by a high-probability event. Lemma 3.4 bounds an increment's sensitivity with
  probability ``1 - delta/2``, once ``m ~ d^2 B1^2`` directions concentrate each example's estimate around its mean:
  infeasible beyond tiny ``d`` (notes Sec. 5). Here each example's estimate (eq. 4) is clipped to ``C`` (``clip``) in
  L2 at an anchor step, and each example's difference of estimates to ``C'`` (``difference_clip``) at the others, so
  one replaced example moves a leaf by at most ``2C`` (``2C'``): a bound for every ``m``, with no event to condition
  on (the delta of the accountant is the whole delta). For an ``L``-Lipschitz loss ``C ~ L`` and ``C' ~ L sqrt(d) D /
  alpha`` are the paper's scales (Lemma 3.4), plus the ``L d / sqrt(m)`` spread of ``m`` directions.
* Batch sizes ``B1`` and ``B2`` from an *anchored* single pass (the DataModule's ``anchor_batch_size`` = ``B1`` and
  ``anchor_period`` = ``Sigma``, ``batch_size`` = ``B2``; Thm. 3.1 takes ``B1 = Sigma B2`` to balance the anchor's
  sensitivity ``L / B1`` against the increments' ``L sqrt(d) D / (alpha B2)``). Each example goes to one step with
  probability proportional to the step's size (i.i.d. by position, where the paper takes fixed sizes "from unused
  samples": replace-one neighbours still change one leaf), and each step divides by its own expected size (lines 8
  and 16). The node noise covers the larger leaf sensitivity, ``2 sigma max(C / B1, C' / B2)``
  (:meth:`DPO2NC.noise_ratio`), so a small ``C'`` pays off only with ``B1 > B2``: on a plain single pass (``B1 =
  B2``) the noise stays at the anchors' level, and a period longer than 1 adds ``floor(log2 Sigma) + 1`` nodes'
  noise for no smaller sensitivity. A resumed run's first tree starts on whatever step the pass is at (its running
  sum is secret, never checkpointed): an anchor there, on a regular step, is clipped at ``max(C B2 / B1, C')``
  (:meth:`DPO2NC.leaf_clip`) so the node noise covers it, and the pass's next large step starts the next tree.
* The tree's positions run ``1..Sigma`` within a period (Alg. 1's ``TREE(t mod Sigma)`` adds no noise at a period's
  last step; :mod:`lit_zodp.privacy.tree`), and one leaf lies in ``floor(log2 Sigma) + 1`` released nodes.
* By default (``direction_sets="step"``) one set of directions per step, shared by every example of the batch
  (public, from the run seed and the step); ``direction_sets="example"`` draws the paper's set per example:
  Alg. 3 lines 4-5 and 11-12 (and Alg. 4's) draw ``y_1..y_m`` inside the loop over the samples, a set per example.
  Shared, the batch is probed at ``2m`` points (``4m`` at a difference step) instead of ``B`` times as many; the price
  is variance: the directions' spread, Lemma 3.6's ``L^2 d^2 / (B m)`` and ``L^2 d^2 Sigma / (m B2)`` terms, no
  longer shrinks with ``B`` (review 58). Privacy is unchanged: each example's estimate is clipped either way.
* Directions ``y_j`` uniform on the unit sphere (eq. 4 and Lemma 3.4's norm bound), where Alg. 3 lines 12-13 print
  the ball. The first-order points are ``z + alpha y`` with ``y`` uniform in the unit ball (Alg. 5 lines 4 and 9, the
  smoothing of Lemma 2.4; eq. 10 prints the sphere, the reading notes' flag): one point per example at an anchor
  (line 4), ``m`` at each end of a difference (line 9), shared by the batch or a set per example as
  ``direction_sets`` says. Each example's gradient is taken alone (``torch.func``: a batch of one per example,
  vmapped, with the example's own parameters when its points are its own), so nothing couples the examples; the
  base's independence checks (padding read, rows mixed) run on a forward of the batch when they are due. The
  smoothing radius ``alpha`` (option ``lam``) is the Goldstein radius the guarantee is stated at (Lemma 2.4:
  ``2 alpha`` for ``F``).
* Output: ``x_out`` uniform over the window averages ``xbar_k`` (Alg. 2 line 4), kept by reservoir sampling (public
  randomness) and written into the model when the fit ends (``output="window"``); ``output="last"`` keeps ``x_T``.
  Validation during the fit reads the iterate ``x_t``.
* Resume: Alg. 3's running sum ``g_t`` (not noisy) and the tree's node keys are secret and never checkpointed, so a
  resumed single-pass run starts a new period with an anchor step: a fresh tree over fresh data (each example is
  still in one leaf of one tree; on an anchored pass the tree is cut short at the next large step, above). Alg. 4's
  running estimate is noisy (public) and is checkpointed, so it continues.
* State: Alg. 2 keeps ``Delta_t``, ``z_{t-1}``, the window's sum and ``x_out`` (public), the oracle ``g_t`` (secret),
  as flat float64 vectors of the trained parameters' size ``d``; the directions of one step are ``2m x d``. The paper
  is about small ``d`` (its experiments, notes Sec. 5: phase retrieval, small ReLU networks), where this is cheap.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_map

from lit_zodp.algorithms.base import loader_sampling
from lit_zodp.algorithms.first_order import anomaly_mode_error
from lit_zodp.algorithms.zeroth_order import ZerothOrderModule
from lit_zodp.backbones.base import batch_size_of
from lit_zodp.errors import (
    ConfigError,
    LitZodpWarning,
    PrivacyConfigError,
    check_choice,
    check_positive,
    check_positive_int,
    raise_if_any,
)
from lit_zodp.privacy import GaussianRelease, StepPlan, TreeAggregator, releases_per_leaf
from lit_zodp.privacy.clipping import clip_factors
from lit_zodp.per_example.reference import LossOfOne
from lit_zodp.privacy.fixed_shape import take_rows
from lit_zodp.privacy.sampling import SinglePassSampling
from lit_zodp.zo import derive_seed

ESTIMATE = "gradient estimate"
ORACLES = ("single_pass", "multi_pass")
ESTIMATORS = ("zeroth_order", "first_order")
DIFFERENCE_DIRECTIONS = ("independent", "shared")
DIRECTION_SETS = ("step", "example")
#: ``derive_seed``'s direction index of example ``i``'s direction ``j`` (``direction_sets="example"``): past the
#: step's shared indices and below :data:`UNIFORM_STREAM`; DDP ranks apart by ``rank << 30``.
EXAMPLE_STREAM = 1 << 39
OUTPUTS = ("window", "last")
#: Stream indices of ``derive_seed`` past any direction index: the step's ``s_t`` and the reservoir's draws.
UNIFORM_STREAM = 1 << 40
RESERVOIR_STREAM = (1 << 40) + 1
#: The ZerothOrderModule options O2NC fixes: sphere directions drawn here, no weight decay (a checkpoint's
#: hyperparameters hold these values).
FIXED_OPTIONS = {"directions": "sphere", "perturbation": "chunked", "weight_decay": 0.0}


# ------------------------------------------------------------------------------ pure pieces
def sphere_directions(run_seed: int, step: int, indices: range, dim: int, device: torch.device,
                      ball: bool = False) -> Tensor:
    """Directions ``y_j ~ Unif(S^{d-1})`` of one step, ``[len(indices), d]`` float64: public, from (run seed, step, j),
    drawn on the host so every device and DDP rank has the same. ``ball``: ``y_j ~ Unif(B_1)`` instead (the direction
    times ``U^{1/d}``, ``U ~ U[0, 1]`` from the same stream: Alg. 5's points)."""
    rows = []
    for j in indices:
        generator = torch.Generator().manual_seed(derive_seed(run_seed, step, j))
        u = torch.randn(dim, generator=generator, dtype=torch.float64)
        u = u / u.norm()
        if ball:
            u = u * float(torch.rand((), generator=generator, dtype=torch.float64)) ** (1.0 / dim)
        rows.append(u)
    return torch.stack(rows).to(device)


def clipped_combination(coefficients: Tensor, directions: Tensor, clip: float) -> Tensor:
    """``sum_i clip_C(v_i)`` for ``v_i = sum_j c_ij y_j`` (``coefficients [B, k]``, ``directions [k, d]``, or
    ``[B, k, d]``: example ``i``'s own ``y_ij``), float64.

    Each ``v_i`` is formed (in chunks of rows, about ``k x d`` values at a time) and clipped by its own computed norm,
    so the clipped share that enters the sum is the vector that was measured. The norms once came from the Gram
    matrix, ``c_i^T (Y Y^T) c_i``: exact in real numbers, but when ``v_i`` is small beside ``|c_i|`` (a difference
    ``v(z_t) - v(z_{t-1})`` of two huge, nearly equal estimates: shared directions, or ``d = 1``) its rounding error,
    ``~ eps |c_i|^2``, swamped ``||v_i||^2``, and a crafted record entered the leaf hundreds of times over ``C``
    (review 58). A row with a non-finite coefficient (a NaN or infinite loss), or whose ``v_i`` overflows,
    contributes zero.
    """
    coefficients = coefficients.to(torch.float64)
    directions = directions.to(torch.float64)
    own = directions.dim() == 3  # ([B, k, d]: a set of directions per example)
    total = torch.zeros(directions.shape[-1], dtype=torch.float64, device=directions.device)
    chunk = max(1, min(len(coefficients), max(directions.shape[-2], (1 << 22) // max(1, directions.shape[-1]))))
    for start in range(0, len(coefficients), chunk):
        rows = coefficients[start:start + chunk]
        rows = rows.where(torch.isfinite(rows).all(dim=1, keepdim=True), 0.0)
        vectors = (torch.einsum("bk,bkd->bd", rows, directions[start:start + chunk]) if own
                   else rows @ directions)
        total += clipped_sum(vectors, clip)
    return total


def clipped_sum(vectors: Tensor, clip: float) -> Tensor:
    """``sum_i clip_C(v_i)`` over the rows ``v_i`` of ``vectors`` ``[B, d]`` (float64), each clipped by its own
    computed norm; a row with a non-finite entry, or whose norm overflows, contributes zero."""
    vectors = vectors.to(torch.float64)
    finite = torch.isfinite(vectors).all(dim=1, keepdim=True)
    vectors = vectors.where(finite, 0.0)
    norms = vectors.norm(dim=1)
    finite = finite.squeeze(1) & torch.isfinite(norms)  # (a row of finite entries whose norm overflows)
    factors = clip_factors(norms.where(finite, 0.0), clip).where(finite, 0.0)
    return factors @ vectors


def public_uniform(run_seed: int, index: int, stream: int) -> float:
    """A public ``U[0, 1)`` draw from (run seed, index, stream): ``s_t`` and the reservoir's coin flips."""
    return float(np.random.default_rng(derive_seed(run_seed, index, stream)).random())


def project_to_ball(vector: Tensor, radius: float) -> Tensor:
    """``min(1, D / ||v||) v`` (Alg. 2: online projected gradient descent over the ball ``B_D``)."""
    norm = float(vector.norm())
    return vector * (radius / norm) if norm > radius else vector


def flat_point(params: list[Tensor]) -> Tensor:
    """The parameters as one float64 vector."""
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in params])


@torch.no_grad()
def write_point(params: list[Tensor], point: Tensor) -> None:
    """Copy the flat ``point`` into the parameters (rounded once to their dtype)."""
    offset = 0
    for p in params:
        p.copy_(point[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


class StagedStep(torch.optim.Optimizer):
    """The optimizer Lightning counts: ``step()`` runs the update the module staged, with the group's ``lr`` (so
    schedulers work), and the privacy component's hook commits the step to the ledger."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})
        self._staged: Optional[Callable[[float], None]] = None

    def stage(self, update: Callable[[float], None]) -> None:
        self._staged = update

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # (Lightning's: its hooks before an optimizer step run in it)
            with torch.enable_grad():
                loss = closure()
        if self._staged is None:
            raise RuntimeError("StagedStep.step() without a staged update")
        update, self._staged = self._staged, None
        update(self.param_groups[0]["lr"])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: the steps never allocate ``.grad``."""


# ---------------------------------------------------------------------------------- modules
class DPO2NC(ZerothOrderModule):
    """Alg. 2 (O2NC) with the private zeroth-order oracle of Alg. 3 (``oracle="single_pass"``) or Alg. 4
    (``"multi_pass"``) of Kornowski, Liu & Talwar.

    Each step t (Alg. 2), with ``Delta_1 = 0``:
      s_t ~ U[0, 1];  x_t = x_{t-1} + Delta_t;  z_t = x_{t-1} + s_t Delta_t;
      gt_t = O(z_t)                                                       (the oracle: below)
      Delta_{t+1} = min(1, D / ||Delta_t - eta gt_t||) (Delta_t - eta gt_t)
    and ``x_out`` is uniform over the averages of ``z`` over windows of ``M`` steps.

    The oracle on the step's batch ``S_t`` of size ``B``, with eq. 4's per-example estimate
    ``v(z; xi) = (1/m) sum_j (d / 2 alpha) (f(z + alpha y_j; xi) - f(z - alpha y_j; xi)) y_j``
    (first order, eq. 10: ``v(z; xi) = (1/m) sum_j grad f(z + alpha y_j; xi)``, ``y_j`` in the ball, and one point
    per example at an anchor):
      anchor (first step of a period of Sigma):  leaf_t = sum_i clip_C(v(z_t; xi_i))
      other steps:  leaf_t = sum_i clip_C'(v(z_t; xi_i) - v(z_{t-1}; xi_i))   (independent directions for each)
      Alg. 3:  gt_t = sum of the period's leaf_j / B_j + TREE(p) / B2   (tree mechanism, single pass; B_j the
               step's expected size: B1 at an anchored pass's anchors, else B2 = B)
      Alg. 4:  gt_t = [gt_{t-1} if not anchor] + (leaf_t + N(0, (k r sigma C)^2 I)) / B
    (``r = max(B2/B1, C'/C)``; ``k = 2`` for replace-one neighbours, 1 for add/remove; Alg. 3's node noise is the
    same, ``k r sigma C``)

    Args (besides :class:`~lit_zodp.algorithms.AlgorithmModule`'s; ``lr`` is ``eta``, ``clip`` is ``C``):
        lam: ``alpha``, the smoothing radius of eq. 4 (``lam`` as in every zeroth-order module here), the radius the
            guarantee is stated at (Lemma 2.4: ``(2 alpha, beta)``-stationarity of ``F``).
        radius: ``D``, the bound on each movement ``Delta``.
        window: ``M``, steps per averaged window.
        period: ``Sigma``, steps per anchor (and per tree); on an anchored single pass, the data's ``anchor_period``.
        num_directions: ``m``, directions per estimate.
        difference_clip: ``C'`` (``None``: ``C``).
        oracle: ``"single_pass"`` (Alg. 3: needs the DataModule's ``sampling: single_pass``) or ``"multi_pass"``.
        difference_directions: ``"independent"`` (Alg. 3 lines 12-13: ``y_{m+1..2m}`` at ``z_{t-1}``) or ``"shared"``
            (``y_1..y_m`` at both points, the variant of Zhang et al. the reading notes reconstruct): a difference of
            two estimates along the same directions is of the order of ``||z_t - z_{t-1}|| <= 2D``, where
            independent ones differ by the estimates' whole spread unless ``m`` is of the paper's order ``d^2 B^2``.
        direction_sets: ``"step"`` (one set ``y_1..y_2m`` per step, shared by the batch: one batched forward per
            point) or ``"example"`` (a set per example, as Alg. 3 lines 4-5 and 11-12 and Alg. 4 draw them: the
            directions' variance then averages over the batch, Lemma 3.6; each example is forwarded alone, ``B``
            times the forward calls). Under DDP a rank draws its examples' sets by its rank and row, so the update is
            distributed as one process's, not equal to it. Private, it needs replace-one neighbours (a replaced example
            keeps its row; an added or removed one shifts the rows after it to other sets).
        estimator: ``"zeroth_order"`` (eq. 4: Alg. 3 and 4) or ``"first_order"`` (eq. 10: Alg. 5; per-example
            gradients through ``torch.func``, ``B`` copies of the parameters when the points are per example: the
            paper's small models). ``clip`` then bounds each example's gradient (``C ~ L``) and ``difference_clip`` each
            example's difference of eq. 10 means (Lemma 6.3: ``L sqrt(d) D / alpha``, plus their ``L / sqrt(m)``
            spread).
        output: ``"window"`` (Alg. 2's ``x_out``) or ``"last"``.
        neighbours: ``"replace_one"`` (the paper's; single-pass sampling needs it) or ``"add_remove"``.
        directions, perturbation, weight_decay: fixed (``"sphere"``, ``"chunked"``, ``0``: eq. 4's directions are drawn
            here, Alg. 2 has no decay); another value is refused.
    """

    non_private_twin = "O2NC"
    #: Alg. 2's step is not ``x - lr a sum_j c_j u_j``: the canary audit cannot read a release from it.
    audit_through_update = False

    def __init__(self, backbone: nn.Module, *, lam: float = 1e-2, radius: float = 1e-3, window: int = 10,
                 period: int = 16, num_directions: int = 8, difference_clip: Optional[float] = None,
                 oracle: str = "single_pass", difference_directions: str = "independent",
                 direction_sets: str = "step", estimator: str = "zeroth_order", output: str = "window",
                 neighbours: str = "replace_one", directions: str = "sphere", perturbation: str = "chunked",
                 weight_decay: float = 0.0, **kwargs: Any) -> None:
        given = {"directions": directions, "perturbation": perturbation, "weight_decay": weight_decay}
        other = [name for name, value in FIXED_OPTIONS.items() if given[name] != value]
        raise_if_any([
            f"{type(self).__name__} has no option `{other[0]}` (Alg. 2-4 use sphere directions and no weight decay)"
            if other else None,
            check_positive("lam", lam),
            check_positive("radius", radius),
            check_positive_int("window", window),
            check_positive_int("period", period),
            check_choice("oracle", oracle, ORACLES),
            check_choice("difference_directions", difference_directions, DIFFERENCE_DIRECTIONS),
            check_choice("direction_sets", direction_sets, DIRECTION_SETS),
            # (example i's set is drawn by its row i: one example added or removed shifts the rows after it, each to
            # another set, and their clipped vectors move too, a leaf by several C: 8 C on phase retrieval, B = 64)
            "direction_sets='example' draws each example's directions by its row in the batch, so adding or removing "
            "one example moves every later row to other directions (a leaf by up to 2C per row, not C): use "
            "neighbours='replace_one' or direction_sets='step'"
            if self.private and direction_sets == "example" and neighbours == "add_remove" else None,
            check_choice("estimator", estimator, ESTIMATORS),
            check_choice("output", output, OUTPUTS),
            # (each example's gradient is vmapped as a batch of one: the kernels run on the realized batch's B rows)
            "`fixed_forward_rows` does not reach estimator='first_order', whose per-example gradients run vmapped over "
            "the batch's realized rows: leave it unset, or use estimator='zeroth_order'"
            if estimator == "first_order" and kwargs.get("fixed_forward_rows") is not None else None,
            # (named: check_clip said `clip`; a private run needs a finite C': its node noise r sigma C grows with it)
            None if difference_clip is None else check_positive("difference_clip", difference_clip,
                                                                 allow_inf=not self.private),
        ])
        if self.private:
            kwargs["neighbours"] = neighbours
        super().__init__(backbone, lam=lam, num_directions=num_directions, **FIXED_OPTIONS, **kwargs)
        self.radius = radius
        self.window = window
        self.period = period
        self.difference_clip = self.clip if difference_clip is None else float(difference_clip)
        self.oracle = oracle
        self.difference_directions = difference_directions
        self.direction_sets = direction_sets
        self.estimator = estimator
        self.output = output
        self.tree = TreeAggregator(period)
        self._state: dict[str, Any] = {}
        self._pass: Optional[SinglePassSampling] = None
        self._fit_start_step = 0
        self._planned_ratio = 1.0  # (the fit's noise_ratio, fixed at its plan)

    # ------------------------------------------------------------------------- declaration
    @property
    def takes_anchored_pass(self) -> bool:
        """Alg. 3 reads an anchored single pass (``B1`` examples at each anchor, ``B2`` at the other steps)."""
        return self.oracle == "single_pass"

    def step_plan(self) -> StepPlan:
        """One d-dimensional release per step. Its node noise is ``r sigma C`` with :meth:`noise_ratio` ``r``;
        Alg. 3's leaf lies in :func:`releases_per_leaf` released tree nodes (sensitivity ``sqrt(count) r C``),
        Alg. 4's in one."""
        ratio = self._planned_ratio = self.noise_ratio()
        count = releases_per_leaf(self.period) if self.oracle == "single_pass" else 1
        return (GaussianRelease(ESTIMATE, sensitivity=math.sqrt(count) * ratio, noise=ratio),)

    def noise_ratio(self) -> float:
        """``r = max(B2 / B1, C' / C)``: the largest leaf sensitivity (an anchor's ``2C / B1``, an increment's
        ``2C' / B2``; Lemma 3.4) in units of ``2C / B2``, ``B2`` a regular step's expected size (``B1 = B2`` unless
        the single pass is anchored)."""
        if math.isinf(self.clip):
            return 1.0
        return max(1.0 / self._pass_weight(0), self.difference_clip / self.clip)

    def leaf_clip(self, nominal: float, position: int) -> float:
        """The clip of a leaf at pass ``position``: ``nominal`` (``C`` or ``C'``) capped at ``w r C``, ``w`` the step's
        weight and ``r`` the fit's planned :meth:`noise_ratio`, so the leaf's sensitivity ``2 clip / (w B2)`` stays
        within the node noise's ``2 r C / B2``. Only a resumed period's first anchor, on a regular step, is capped (at
        ``max(C B2 / B1, C')``), or a ``difference_clip`` raised within the fit (the noise is the plan's: red-team
        review 59); private runs only."""
        if not self.private:
            return nominal
        return min(nominal, self._pass_weight(position) * self._planned_ratio * self.clip)

    def configure_optimizers(self):
        self.o2nc_params = self.trainable_parameters()
        return self.with_scheduler(self.attach_privacy(StagedStep(self.o2nc_params, lr=self.lr)))

    def on_train_start(self) -> None:
        self._pass = self._read_pass()  # (before the base plans the privacy: the step plan reads its weights)
        self._fit_start_step = self.global_step
        super().on_train_start()
        if self.private and self.oracle == "single_pass" and self.privacy.sampling.name != "single_pass":
            raise PrivacyConfigError(
                f"{type(self).__name__}(oracle='single_pass') is Alg. {5 if self.estimator == 'first_order' else 3}, "
                "whose tree mechanism is accounted over one "
                f"pass (each example in one step), but the private loader samples {self.privacy.sampling.name!r}: set "
                "the DataModule's `sampling: single_pass`, or oracle='multi_pass' (Alg. 4)")
        self._warn_about_oversized_options()
        self.tree.reset()  # (a new fit, or a resumed one: a new period, its secrets in memory only)
        self._start_state()
        if self._state["holding_output"]:  # the model holds x_out since the last fit ended: continue from x_T
            write_point(self.o2nc_params, self._state["last"])
            self._state["holding_output"] = False

    def _read_pass(self) -> Optional[SinglePassSampling]:
        """The training loader's single pass (``None``: another sampling); an anchored one must anchor every
        ``period`` steps, where the tree starts."""
        sampling = loader_sampling(self.trainer)
        if not isinstance(sampling, SinglePassSampling):
            return None
        if sampling.anchored and self.oracle == "single_pass" and sampling.anchor_period != self.period:
            raise PrivacyConfigError(
                f"{type(self).__name__}: the data's `anchor_period`={sampling.anchor_period} must equal the module's "
                f"`period`={self.period} (Alg. 3 takes its B1 examples at the first step of every period)")
        return sampling

    def _anchor_step(self, position: int) -> bool:
        """Whether an anchored pass gives step ``position`` its ``B1`` examples."""
        return self._pass is not None and self._pass.is_anchor(position)

    def _pass_weight(self, position: int) -> float:
        """Step ``position``'s expected size over a regular step's in an anchored pass, else 1."""
        return self._pass.weight(position) if self._pass is not None else 1.0

    def _pass_position(self) -> int:
        """This step's position in the single pass (the steps of earlier fits included)."""
        start = self._pass.start if self._pass is not None else 0
        return start + self.global_step - self._fit_start_step

    def _warn_about_oversized_options(self) -> None:
        """A ``period`` beyond the single pass costs noise for nodes no step reaches (each leaf is accounted in
        ``floor(log2 Sigma) + 1``), and a ``window`` beyond the fit's steps gives no ``x_out`` (the model keeps
        ``x_T``): both were silent (review 58). ``M D > alpha`` voids Prop. 2.6's condition on ``x_out``."""
        sampling = self.privacy.sampling if self.private else None
        steps = getattr(sampling, "steps", None) if getattr(sampling, "name", None) == "single_pass" else None
        if self.oracle == "single_pass" and steps is not None and self.period > steps:
            rank_zero_warn(
                f"{type(self).__name__}: period={self.period} exceeds the single pass ({steps} steps), so each leaf is "
                f"accounted in {releases_per_leaf(self.period)} tree nodes where {releases_per_leaf(steps)} would do "
                f"(more noise for the same epsilon): set period <= {steps}", category=LitZodpWarning)
        if self.output == "window" and self.window * self.radius > self.lam:
            rank_zero_warn(
                f"{type(self).__name__}: window * radius = {self.window * self.radius:g} exceeds lam = {self.lam:g}: "
                "Prop. 2.6's guarantee on x_out (a window's average is (alpha, beta)-stationary) needs M D <= alpha; "
                "shorten the window or the radius", category=LitZodpWarning)
        planned = self.trainer.estimated_stepping_batches if self._trainer is not None else None
        if (self.output == "window" and not self._state.get("windows_done") and isinstance(planned, (int, float))
                and math.isfinite(planned) and planned < self.window):
            rank_zero_warn(
                f"{type(self).__name__}: window={self.window} exceeds the fit's {int(planned)} steps, so no window "
                "completes and the model keeps x_T, not Alg. 2's x_out: set window <= the steps, or output='last'",
                category=LitZodpWarning)

    def on_train_end(self) -> None:
        """Alg. 2 line 4: the model takes ``x_out`` (``output="window"``), ``x_T`` kept to continue from."""
        if self.output == "window" and self._state.get("windows_done"):
            self._state["last"] = flat_point(self.o2nc_params)
            write_point(self.o2nc_params, self._state["output"])
            self._state["holding_output"] = True

    # ---------------------------------------------------------------------------- the step
    def training_step(self, batch, batch_idx: int) -> None:
        (inputs, targets), _ = self.split_batch(batch)
        size = batch_size_of(inputs)
        state = self._state
        x_previous = flat_point(self.o2nc_params)                             # x_{t-1}
        s = self.uniform_draw()                                               # s_t ~ U[0, 1]
        z = x_previous + s * state["delta"]                                   # z_t
        try:
            estimate = self.oracle_estimate(z, inputs, targets, size)         # gt_t = O(z_t)
        except BaseException:  # (a refused forward: the model returns to x_{t-1}, exactly, not a probed point)
            write_point(self.o2nc_params, x_previous)
            raise
        self.average_window(z)                                                # xbar_k
        self.zo_optimizer.stage(lambda eta: self.move(x_previous + state["delta"], estimate, eta))
        self.step_optimizer()                                                 # x_t, Delta_{t+1}
        self.log_step(size)

    def move(self, x: Tensor, estimate: Tensor, eta: float) -> None:
        """``x_t`` into the model; ``Delta_{t+1} = clip_D(Delta_t - eta gt_t)``."""
        write_point(self.o2nc_params, x)
        self._state["delta"] = project_to_ball(self._state["delta"] - eta * estimate, self.radius)

    def oracle_estimate(self, z: Tensor, inputs, targets, size: int) -> Tensor:
        """Alg. 3 (tree) or Alg. 4 (running noisy sum) at ``z_t``."""
        state = self._state
        if self.estimator == "first_order":
            if self.private and torch.is_anomaly_enabled():  # (before any gradient, whatever the batch)
                raise_if_any([anomaly_mode_error()])
            self._run_due_independence_checks(inputs, targets)
        position = self._pass_position()
        if self.oracle == "single_pass" and self._anchor_step(position) and not self.tree.period_done:
            self.tree.reset()  # an anchored pass's anchor step starts a tree (after a resumed, shorter period)
        anchor = self.tree.period_done if self.oracle == "single_pass" else state["position"] % self.period == 0
        leaf = (self.anchor_leaf(z, inputs, targets, self.leaf_clip(self.clip, position)) if anchor
                else self.difference_leaf(z, state["z_previous"], inputs, targets,
                                          self.leaf_clip(self.difference_clip, position)))
        state["z_previous"] = z
        if self.oracle == "single_pass":
            return self.privacy.release_prefix(leaf, ESTIMATE, self.tree, batch_size=size)
        released = self.privacy.release(leaf, ESTIMATE, batch_size=size, dtype=self.loss_dtype).to(torch.float64)
        state["estimate"] = released if anchor else state["estimate"] + released
        state["position"] += 1
        return state["estimate"]

    def anchor_leaf(self, z: Tensor, inputs, targets, clip: float) -> Tensor:
        """``sum_i clip_C(v(z_t; xi_i))`` over directions ``y_1..y_m``; first order (Alg. 5 lines 4-5):
        ``sum_i clip_C(grad f(z_t + alpha y_i; xi_i))``, one ``y_i ~ Unif(B_1)`` per example."""
        if self.estimator == "first_order":
            offsets = self.directions_of(range(1), inputs, ball=True)
            return clipped_sum(self.example_gradients(z + self.lam * offsets[..., 0, :], inputs, targets), clip)
        directions = self.directions_of(range(self.num_directions), inputs)
        return clipped_combination(self.estimate_coefficients(z, directions, inputs, targets), directions, clip)

    def difference_leaf(self, z: Tensor, z_previous: Tensor, inputs, targets, clip: float) -> Tensor:
        """``sum_i clip_C'(v(z_t; xi_i) - v(z_{t-1}; xi_i))``, ``y_1..y_m`` at ``z_t`` and ``y_{m+1}..y_{2m}`` at
        ``z_{t-1}`` (independent, Alg. 3 lines 12-13); first order, ``v`` is eq. 10's (Alg. 5 lines 9-11)."""
        m = self.num_directions
        ball = self.estimator == "first_order"
        now = self.directions_of(range(m), inputs, ball=ball)
        before = (now if self.difference_directions == "shared"
                  else self.directions_of(range(m, 2 * m), inputs, ball=ball))
        if ball:
            return clipped_sum(self.mean_gradient(z, now, inputs, targets)
                               - self.mean_gradient(z_previous, before, inputs, targets), clip)
        coefficients = torch.cat([self.estimate_coefficients(z, now, inputs, targets),
                                  -self.estimate_coefficients(z_previous, before, inputs, targets)], dim=1)
        return clipped_combination(coefficients, torch.cat([now, before], dim=-2), clip)

    def estimate_coefficients(self, point: Tensor, directions: Tensor, inputs, targets) -> Tensor:
        """``c_ij = (d / (2 alpha m)) (f(p + alpha y_j; xi_i) - f(p - alpha y_j; xi_i))``, ``[B, m]`` float64: eq. 4's
        ``v(p; xi_i) = sum_j c_ij y_j``. The model ends at ``p + alpha y_m - 2 alpha y_m`` (overwritten by the step)."""
        if directions.dim() == 3:  # a set per example: each example forwarded alone at its own points
            rows = [self.estimate_coefficients(point, own, take_rows(inputs, slice(i, i + 1)), targets[i:i + 1])
                    for i, own in enumerate(directions)]
            return torch.cat(rows) if rows else torch.zeros(0, directions.shape[1], dtype=torch.float64,
                                                            device=point.device)
        columns = []
        for y in directions:
            write_point(self.o2nc_params, point + self.lam * y)
            plus = self.private_losses(inputs, targets).to(torch.float64)
            write_point(self.o2nc_params, point - self.lam * y)
            columns.append(plus - self.private_losses(inputs, targets).to(torch.float64))
        scale = directions.shape[1] / (2 * self.lam * len(directions))
        return torch.stack(columns, dim=1) * scale

    def _run_due_independence_checks(self, inputs, targets) -> None:
        """Alg. 5 sends no batch through ``private_losses``: the base's per-example independence checks (audit 5:
        rows mixed by the forward, padding read) run on one forward of the batch at ``x_{t-1}`` when one is due (the
        first batches, then the re-checks the OS draws); a padding check alone waits, at no forward, for a batch with a
        row shorter than its longest, as in :meth:`private_losses`."""
        if self.private and (self._pending_checks or self._recheck_pending) and self._checks_can_compare(inputs):
            self.private_losses(inputs, targets)

    def mean_gradient(self, point: Tensor, offsets: Tensor, inputs, targets) -> Tensor:
        """Eq. 10 per example: ``(1/m) sum_j grad f(p + alpha y_j; xi_i)``, ``[B, d]`` float64 (``offsets``: ``[m, d]``
        shared, or ``[B, m, d]`` a set per example)."""
        count = offsets.shape[-2]
        total = self.example_gradients(point + self.lam * offsets[..., 0, :], inputs, targets)
        for j in range(1, count):
            total = total + self.example_gradients(point + self.lam * offsets[..., j, :], inputs, targets)
        return total / count

    def example_gradients(self, points: Tensor, inputs, targets) -> Tensor:
        """``grad f(p_i; xi_i)`` per example, ``[B, d]`` float64, at ``points`` ``[d]`` (one for the batch) or ``[B,
        d]`` (each example's own): each example differentiated alone (``torch.func``: a batch of one per example,
        vmapped, the per-example engine's reference recipe), the backbone in eval mode. The parameters take the
        point rounded to their dtype; the gradient is widened to float64. An empty batch is vmapped too (over zero
        rows, which still runs the forward): a backbone ``vmap`` cannot run (``.item()``, data-dependent branches)
        is refused at the fit's first step, whether or not it sampled an example."""
        size = batch_size_of(inputs)
        dim = self._state["delta"].numel()
        self._enter_private_forward(targets)  # (eval mode, no cached value, the device target check, the watch)
        layout = self._parameter_layout()
        wrapper = LossOfOne(self.backbone, self.example_losses)

        def loss(point: Tensor, example_inputs, example_targets) -> Tensor:
            params, offset = {}, 0
            for name, shape, dtype, numel in layout:
                params[f"module.{name}"] = point[offset:offset + numel].view(shape).to(dtype)
                offset += numel
            one = tree_map(lambda t: t.unsqueeze(0), (example_inputs, example_targets))
            return functional_call(wrapper, params, one).reshape(()).to(torch.float64)

        in_dims = (0 if points.dim() == 2 else None, 0, 0)
        registrations = self._registrations
        try:
            with torch.enable_grad():
                gradients = vmap(grad(loss), in_dims=in_dims)(points.to(torch.float64), inputs, targets)
        except RuntimeError as error:
            if not str(error).startswith("vmap"):
                raise
            raise ConfigError(
                f"estimator='first_order' takes each example's gradient under torch.func.vmap, which "
                f"{type(self.backbone).__name__}'s forward or loss does not support ({str(error).split('. ')[0]}): "
                "use estimator='zeroth_order'") from None
        if registrations is not None and registrations.registered:  # (a slot reassigned in the vmapped forward)
            self._drop_vmapped_registrations(registrations.registered)
            registrations.refuse()
        return gradients.reshape(size, dim)

    def _drop_vmapped_registrations(self, names: list) -> None:
        """Remove from the model what a vmapped forward registered (``path.name``): a tensor made under ``vmap`` is
        unusable outside it, and left on the model it failed Lightning's teardown (``module.cpu()``), hiding the
        refusal that follows (review of the contract suite's first-order variant)."""
        for path in set(names):
            owner_path, _, name = path.rpartition(".")
            owner = self.backbone.get_submodule(owner_path)
            for slots in (owner._parameters, owner._buffers):
                value = slots.get(name)
                if isinstance(value, Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(value):
                    del slots[name]

    def _parameter_layout(self) -> list:
        """``(name, shape, dtype, numel)`` of the trained parameters, in ``o2nc_params``' order (the flat point's)."""
        names = {id(p): name for name, p in self.backbone.named_parameters()}
        return [(names[id(p)], p.shape, p.dtype, p.numel()) for p in self.o2nc_params]

    # ------------------------------------------------------------------------ public state
    def directions_of(self, indices: range, inputs, ball: bool = False) -> Tensor:
        """The step's directions ``y_j``, ``j`` in ``indices``: ``[k, d]``, or ``[B, k, d]`` with a set per example;
        ``ball``: uniform in the unit ball (Alg. 5), else on the sphere."""
        dim, device = self._state["delta"].numel(), self._state["delta"].device
        if self.direction_sets == "step":
            return sphere_directions(self.run_seed, self.global_step, indices, dim, device, ball)
        base = EXAMPLE_STREAM + (self.global_rank << 30)
        width = 2 * self.num_directions
        sets = [sphere_directions(self.run_seed, self.global_step, range(base + i * width + indices.start,
                                                                         base + i * width + indices.stop), dim, device,
                                  ball)
                for i in range(batch_size_of(inputs))]
        return torch.stack(sets) if sets else torch.zeros(0, len(indices), dim, dtype=torch.float64, device=device)

    def uniform_draw(self) -> float:
        """``s_t ~ U[0, 1]``: public, from (run seed, step)."""
        return public_uniform(self.run_seed, self.global_step, UNIFORM_STREAM)

    def average_window(self, z: Tensor) -> None:
        """Add ``z_t`` to the window; a full window's average replaces ``x_out`` with probability ``1/k`` (reservoir
        sampling: ``x_out`` is uniform over the ``k`` windows so far, Alg. 2 line 4)."""
        state = self._state
        state["window_sum"] = state["window_sum"] + z
        state["window_steps"] += 1
        if state["window_steps"] < self.window:
            return
        state["windows_done"] += 1
        k = state["windows_done"]
        if public_uniform(self.run_seed, k, RESERVOIR_STREAM) < 1.0 / k:
            state["output"] = state["window_sum"] / self.window
        state["window_sum"] = torch.zeros_like(z)
        state["window_steps"] = 0

    def _start_state(self) -> None:
        """Alg. 2's public state at a fit start: kept from an earlier fit or a checkpoint, else ``Delta_1 = 0``."""
        params = self.o2nc_params
        dim, device = sum(p.numel() for p in params), params[0].device
        state = self._state
        if state.get("dim") not in (None, dim):
            raise PrivacyConfigError(f"{type(self).__name__}'s state is for {state['dim']} trained values, but the "
                                     f"model trains {dim}: keep the trainable parameters of the run")
        vectors = ("delta", "z_previous", "window_sum", "output", "last", "estimate")
        defaults = {"dim": dim, "window_steps": 0, "windows_done": 0, "holding_output": False, "position": 0}
        defaults |= {key: torch.zeros(dim, dtype=torch.float64, device=device) for key in vectors}  # (one each)
        for key, value in defaults.items():
            state.setdefault(key, value)
            if isinstance(state[key], Tensor):
                state[key] = state[key].to(device=device, dtype=torch.float64)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Alg. 2's public state (``Delta``, ``z_{t-1}``, the windows, ``x_out``; Alg. 4's noisy estimate). Alg. 3's
        running sum and tree keys are secret and stay out."""
        super().on_save_checkpoint(checkpoint)
        checkpoint["o2nc"] = {key: value.cpu() if isinstance(value, Tensor) else value
                              for key, value in self._state.items()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self._state = dict(checkpoint.get("o2nc") or {})


class O2NC(DPO2NC):
    """The non-private Alg. 2 + 3/4: the same oracle with no noise, the mean over the realized batch, and no clipping
    by default (``clip=inf``)."""

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, **kwargs)


__all__ = ["DPO2NC", "O2NC", "clipped_combination", "clipped_sum", "project_to_ball", "sphere_directions"]
