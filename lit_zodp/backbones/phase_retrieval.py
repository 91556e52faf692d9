"""Robust phase retrieval (Kornowski, Liu & Talwar, experiment E2 of the reading notes) as a backbone.

The trained parameter is the point ``x`` itself, and each example is a pair ``(a_i, b_i)``:

    ``f(x; (a_i, b_i)) = | |<a_i, x>| - b_i |``,   ``F_S(x) = (1/n) sum_i f(x; (a_i, b_i))``,

with ``a_i ~ Unif(S^{d-1})`` and ``b_i = |<a_i, x*>|`` for a planted unit signal ``x*`` (a fraction of the
training rows may carry corrupted ``b_i``: :class:`datamodules.PhaseRetrievalDataModule`). Each ``f`` is
nonsmooth, nonconvex and ``||a_i||``-Lipschitz, so 1-Lipschitz on unit rows; ``F`` is minimised (``0`` on clean
data) at ``x*`` and ``-x*`` alike (the sign is not identifiable).

Encoding: an example is one row ``[a_i, b_i]`` of ``d + 1`` float64 values (``a_i`` the first ``d``, ``b_i`` the
last); the targets are zeros (one dummy class), as for the synthetic quadratic
(:class:`~lit_zodp.backbones.QuadraticLoss`), so the base class's label checks and every module's
``(inputs, targets)`` contract apply unchanged.

The backbone and the data module derive ``x*`` from the same ``signal_seed`` through :func:`planted_signal`, so
the backbone's ``distance`` metric needs no data; a ``signal_seed`` other than the data module's is refused at
setup in one line (:attr:`PhaseRetrievalLoss.shared_data_options`), like a ``dim`` other than the rows'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lit_zodp.backbones._utils import as_float_input, check_positive_int
from lit_zodp.backbones.base import Backbone, tensor_data_mismatch
from lit_zodp.backbones.metrics import MeanLoss
from lit_zodp.backbones.quadratic import DTYPES, GradientNorm
from lit_zodp.errors import ConfigError
from lit_zodp.per_example.samplers import register_sampler

#: The starting points by name: a seeded random point of norm ``init_norm``, or the origin.
INITS = ("random", "zeros")
#: The random streams of one seed: the signal, the starting point and the data module's rows draw from distinct
#: generators (seed ``3 * seed + stream``), so equal seeds (all default to 0) never give ``x_0 = x*`` or a row
#: ``a_i`` parallel to ``x*``.
SIGNAL_STREAM, INIT_STREAM, ROWS_STREAM = 0, 1, 2
#: The stream of the Goldstein certificate's points (seed ``3 * certificate_seed + 3``: apart from the others).
CERTIFICATE_STREAM = 3


def seeded_generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one of the streams (:data:`SIGNAL_STREAM`, ...) of ``seed``."""
    return torch.Generator().manual_seed(3 * int(seed) + stream)


def unit_rows(n: int, dim: int, generator: torch.Generator) -> Tensor:
    """``n`` float64 rows uniform on the unit sphere ``S^{d-1}`` (normalised Gaussians), ``[n, d]``."""
    rows = torch.randn(n, dim, generator=generator, dtype=torch.float64)
    return rows / rows.norm(dim=1, keepdim=True)


def planted_signal(dim: int, seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """The planted signal ``x*``: a unit vector uniform on ``S^{d-1}``, a function of ``(dim, seed)`` only (the
    backbone and :class:`datamodules.PhaseRetrievalDataModule` both call it)."""
    return unit_rows(1, dim, seeded_generator(seed, SIGNAL_STREAM))[0].to(dtype)


def phase_retrieval_losses(x: Tensor, rows: Tensor) -> Tensor:
    """``| |<a_i, x>| - b_i |`` per row ``[a_i, b_i]``, ``[B]``. Autograd's ``abs`` has derivative ``sign`` with
    ``sign(0) = 0``, so its gradient is :func:`subgradient_signs` times ``a_i``."""
    return (rows[:, :-1] @ x).abs().sub(rows[:, -1]).abs()


def subgradient_signs(x: Tensor, rows: Tensor) -> Tensor:
    """``s_i = sign(<a_i, x>) sign(|<a_i, x>| - b_i)`` (``sign(0) = 0``), ``[B]``: the per-example (sub)gradient is
    ``s_i a_i``."""
    inner = rows[:, :-1] @ x
    return inner.sign() * (inner.abs() - rows[:, -1]).sign()


def ball_points(count: int, dim: int, seed: int) -> Tensor:
    """``count`` offsets in the unit ball ``B_1`` of ``R^d``, ``[count, d]`` float64: the first is 0 (the point itself),
    the others uniform in the ball (a uniform direction times ``U^(1/d)``); public, from ``seed``."""
    generator = seeded_generator(seed, CERTIFICATE_STREAM)
    radii = torch.rand(count - 1, 1, generator=generator, dtype=torch.float64) ** (1.0 / dim)
    return torch.cat([torch.zeros(1, dim, dtype=torch.float64), radii * unit_rows(count - 1, dim, generator)])


def min_norm_in_hull(vectors: Tensor, iterations: int = 2000) -> Tensor:
    """``min ||sum_k lambda_k v_k||`` over the simplex (the norm of the minimum-norm point of ``conv{v_k}``), by
    Frank-Wolfe with exact line search from the mean: an upper bound that tightens with ``iterations`` (float64)."""
    gram = vectors.to(torch.float64) @ vectors.to(torch.float64).T
    weights = torch.full((len(vectors),), 1.0 / len(vectors), dtype=torch.float64)
    for _ in range(iterations):
        gradient = gram @ weights  # (half the gradient of ||V^T lambda||^2)
        vertex = int(gradient.argmin())
        direction = -weights
        direction[vertex] += 1.0
        curvature = float(direction @ gram @ direction)
        if curvature <= 0.0:
            break
        step = min(1.0, max(0.0, -float(gradient @ direction) / curvature))
        if step == 0.0:
            break
        weights = weights + step * direction
    return (weights @ gram @ weights).clamp_min(0.0).sqrt()


class GoldsteinBound(Metric):
    """An upper bound on ``||dbar_r F(x)||``, the norm of the minimum-norm element of the Goldstein subdifferential
    at radius ``r`` over every row evaluated (the O2NC paper's Def. 2.1; the reading notes' measure (a)).

    Any convex combination of gradients of ``F`` at points of ``B(x, r)`` where ``F`` is differentiable lies in
    ``d_r F(x)``, so the norm of the minimum-norm point of the hull of the gradients at ``x + r w_k`` (``w_k``:
    :func:`ball_points`, ``w_0 = 0``) bounds it from above, for the evaluated rows, with no Monte-Carlo error (the
    points are random, so ``F`` is differentiable at each of them almost surely). More points tighten it.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, count: int, dim: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.zeros(count, dim, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("rows", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, gradient_sums: Tensor, count: int) -> None:
        """Add the sums over ``count`` rows of the per-example gradients at each point, ``[points, d]``."""
        self.total += gradient_sums.to(self.total)
        self.rows += count

    def compute(self) -> Tensor:
        return min_norm_in_hull(self.total / self.rows.clamp_min(1))


def signal_distance(x: Tensor, signal: Tensor) -> Tensor:
    """``min_{s = +-1} ||x - s x*|| / ||x*||`` (the sign of ``x*`` is not identifiable)."""
    return torch.minimum((x - signal).norm(), (x + signal).norm()) / signal.norm()


class PhaseRetrievalLoss(Backbone):
    """``f(x; (a, b)) = | |<a, x>| - b |`` with the point ``x`` as the only parameter (robust phase retrieval).

    Inputs are rows ``[a_i, b_i]`` ``[B, d + 1]`` (:class:`datamodules.PhaseRetrievalDataModule`); the targets are
    ignored (the data module gives zeros, one dummy class). ``forward`` returns the per-example losses ``[B]``.

    Args:
        dim: the dimension ``d`` of ``x`` (the rows have ``d + 1`` values).
        signal_seed: the seed of the planted signal ``x* = planted_signal(dim, signal_seed)``, which the ``distance``
            metric compares ``x`` with; it must equal the data module's (refused at setup otherwise).
        init: ``"random"`` (default): ``x_0`` uniform on the sphere of radius ``init_norm`` (seed ``init_seed``);
            ``"zeros"``: ``x_0 = 0``, where every per-example subgradient is ``0`` (``sign(<a_i, 0>) = 0``): a
            stationary point of the sign-symmetric problem that a (sub)gradient method without noise never leaves,
            and, ``f`` being even in ``x``, every central difference ``f(lam u) - f(-lam u)`` there is exactly 0.
        init_norm: the norm of the random ``x_0`` (``||x*|| = 1``).
        init_seed: the seed of the random ``x_0`` (a stream apart from the signal's: equal seeds are fine).
        dtype: ``"float64"`` (default) or ``"float32"``, as for :class:`~lit_zodp.backbones.QuadraticLoss`.
        certificate_radius: ``r`` of the ``goldstein`` metric (:class:`GoldsteinBound`): O2NC at smoothing radius
            ``alpha`` (its ``lam``) certifies ``(2 alpha, beta)``-stationarity of ``F`` (Lemma 2.4), so ``2 lam``.
        certificate_points: the points of ``B(x, r)`` whose gradients the ``goldstein`` bound combines (``x`` is one
            of them).
    """

    num_classes = 1
    #: Held by both this backbone and :class:`datamodules.PhaseRetrievalDataModule`; a differing value is refused
    #: at setup (:func:`~lit_zodp.backbones.base.shared_option_mismatch`).
    shared_data_options = ("signal_seed",)

    def __init__(self, dim: int, signal_seed: int = 0, init: str = "random", init_norm: float = 1.0,
                 init_seed: int = 0, dtype: str = "float64", certificate_radius: float = 0.1,
                 certificate_points: int = 32) -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        check_positive_int("certificate_points", certificate_points)
        if isinstance(certificate_radius, bool) or not isinstance(certificate_radius, (int, float)) \
                or not 0 <= float(certificate_radius) < float("inf"):
            raise ConfigError(f"Expected the backbone's `certificate_radius` to be a finite float >= 0, but got "
                              f"{certificate_radius!r}")
        self.certificate_radius = float(certificate_radius)
        self.certificate_points = certificate_points
        for name, value in (("signal_seed", signal_seed), ("init_seed", init_seed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"Expected the backbone's `{name}` to be an int >= 0, but got {value!r}")
        if init not in INITS:
            raise ConfigError(f"Expected the backbone's `init` in {list(INITS)}, but got {init!r}")
        if isinstance(init_norm, bool) or not isinstance(init_norm, (int, float)) \
                or not 0 < float(init_norm) < float("inf"):
            raise ConfigError(f"Expected the backbone's `init_norm` to be a positive finite float, but got "
                              f"{init_norm!r}")
        if dtype not in DTYPES:
            raise ConfigError(f"Expected the backbone's `dtype` in {list(DTYPES)}, but got {dtype!r}")
        self.signal_seed = signal_seed
        if init == "zeros":
            start = torch.zeros(dim, dtype=torch.float64)
        else:
            start = float(init_norm) * unit_rows(1, dim, seeded_generator(init_seed, INIT_STREAM))[0]
        self.x = nn.Parameter(start.to(DTYPES[dtype]))
        # (derived from the configuration: not saved, rebuilt on load)
        self.register_buffer("signal", planted_signal(dim, signal_seed, DTYPES[dtype]), persistent=False)
        self.register_buffer("certificate_offsets", self.certificate_radius
                             * ball_points(certificate_points, dim, signal_seed).to(DTYPES[dtype]), persistent=False)

    def data_mismatch(self, *, text: bool, example_shape: Optional[tuple[int, ...]]) -> Optional[str]:
        if text or example_shape is None or tuple(example_shape) == (self.dim + 1,):
            return tensor_data_mismatch(self, text)
        return (f"the backbone PhaseRetrievalLoss has `dim` {self.dim} (rows [a, b] of {self.dim + 1} values), but "
                f"the data's rows have shape {tuple(example_shape)}: set the same `dim` on both")

    def rows(self, inputs: Tensor) -> Tensor:
        """The rows ``[a_i, b_i]`` in the parameter's dtype and device, checked to be ``[B, d + 1]``."""
        rows = as_float_input(inputs, self.x)
        if rows.dim() != 2 or rows.shape[1] != self.dim + 1:
            raise ValueError(f"PhaseRetrievalLoss expects rows [B, {self.dim + 1}] ([a, b]), got examples of shape "
                             f"{tuple(rows.shape[1:])} (no batch size: a Poisson batch's is private)")
        return rows

    def forward(self, inputs: Tensor) -> Tensor:
        """The per-example losses ``| |<a_i, x>| - b_i |``, ``[B]``."""
        return phase_retrieval_losses(self.x, self.rows(inputs))

    def per_example_loss(self, inputs: Tensor, targets: Tensor) -> Tensor:
        return self(inputs)

    def predict(self, inputs: Tensor) -> Tensor:
        """The per-example losses as ``[B, 1]`` (there are no classes)."""
        return self(inputs).unsqueeze(1)

    @torch.no_grad()
    def distance(self) -> Tensor:
        """``min_{s = +-1} ||x - s x*|| / ||x*||`` (:func:`signal_distance`)."""
        return signal_distance(self.x, self.signal)

    @torch.no_grad()
    def gradient(self, rows: Tensor) -> Tensor:
        """The mean per-example subgradient ``(1/n) sum_i s_i a_i`` over ``rows`` (no autograd)."""
        rows = self.rows(rows)
        return subgradient_signs(self.x, rows) @ rows[:, :-1] / max(1, len(rows))

    def evaluation_metrics(self) -> dict[str, Metric]:
        """``loss`` (``F`` over the evaluated set), ``distance`` (to ``+-x*``, data-free: each batch adds the same
        value, so the mean is that value), ``grad_norm`` (the norm of the mean per-example subgradient) and
        ``goldstein`` (:class:`GoldsteinBound` at ``certificate_radius``)."""
        return {"loss": MeanLoss(), "distance": MeanLoss(), "grad_norm": GradientNorm(self.dim),
                "goldstein": GoldsteinBound(self.certificate_points, self.dim)}

    @torch.no_grad()
    def update_evaluation(self, metrics: Mapping[str, Metric], inputs: Tensor, targets: Tensor) -> None:
        rows = self.rows(inputs)
        metrics["loss"].update(self(rows))
        metrics["distance"].update(self.distance().reshape(1))
        metrics["grad_norm"].update(subgradient_signs(self.x, rows) @ rows[:, :-1], len(rows))
        points = self.x + self.certificate_offsets  # [points, d]
        signs = torch.stack([subgradient_signs(point, rows) for point in points])  # [points, B]
        metrics["goldstein"].update(signs @ rows[:, :-1], len(rows))


def _signs(layer: PhaseRetrievalLoss, inputs: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """The rows in the parameter's dtype and ``g_i s_i`` per row (the output gradient times the subgradient sign)."""
    rows = as_float_input(inputs, layer.x)
    return rows, grad.to(rows.dtype) * subgradient_signs(layer.x.detach(), rows)


def _per_example_grads(layer: PhaseRetrievalLoss, inputs: Tensor, grad: Tensor) -> dict[str, Tensor]:
    """The per-example subgradients ``g_i s_i a_i``, ``[B, d]`` (the engine's layer rule)."""
    if not layer.x.requires_grad:
        return {}
    rows, weights = _signs(layer, inputs, grad)
    return {"x": weights[:, None] * rows[:, :-1]}


def _per_example_norms(layer: PhaseRetrievalLoss, inputs: Tensor, grad: Tensor) -> dict[str, Tensor]:
    """``||g_i s_i a_i||^2 = (g_i s_i)^2 ||a_i||^2`` per row without the ``[B, d]`` gradients (ghost norms)."""
    if not layer.x.requires_grad:
        return {}
    rows, weights = _signs(layer, inputs, grad)
    a = rows[:, :-1]
    return {"x": weights ** 2 * torch.einsum("ij,ij->i", a, a)}


def _summed_grads(layer: PhaseRetrievalLoss, inputs: Tensor, grad: Tensor) -> dict[str, Tensor]:
    """``sum_i g_i s_i a_i``."""
    if not layer.x.requires_grad:
        return {}
    rows, weights = _signs(layer, inputs, grad)
    return {"x": weights @ rows[:, :-1]}


register_sampler(PhaseRetrievalLoss, parameters=("x",), norms=_per_example_norms,
                 summed=_summed_grads)(_per_example_grads)


__all__ = ["GoldsteinBound", "INITS", "PhaseRetrievalLoss", "ball_points", "min_norm_in_hull", "phase_retrieval_losses",
           "planted_signal", "seeded_generator",
           "signal_distance", "subgradient_signs", "unit_rows"]
