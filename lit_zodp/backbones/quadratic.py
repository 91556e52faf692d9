"""The synthetic quadratic of DPZero (Zhang et al.), Sec. 5.1 and App. B.1, as a backbone.

The trained parameter is the point ``x`` itself, and each example ``xi_i`` is a row ``x_i``:

    ``f(x; x_i) = (x - x_i)^T A (x - x_i) / 2``,   ``F_S(x) = (1/n) sum_i f(x; x_i)``,
    ``grad F_S(x) = A (x - mean_i x_i)``,

with ``A`` diagonal and ``||A||_2 = 1``, so the effective rank ``r = Tr(A)`` (Assumption 3.5) is set by
the pattern of its diagonal (App. B.1, (a)-(c)):

* ``"identity"``: ``A = I``, ``r = d``;
* ``"sqrt"``: ``A = diag(1, 1/sqrt(2), ..., 1/sqrt(d))``, ``r = O(sqrt(d))``;
* ``"log"``: ``A = diag(1, 1/2, ..., 1/d)``, ``r = O(log d)``.

Evaluation reports the exact gradient norm ``||A (x - mean_i x_i)||`` over the evaluated rows (Fig. 1's
metric) and the mean loss (Fig. 2's), instead of cross-entropy and accuracy
(:meth:`QuadraticLoss.evaluation_metrics`).
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
from lit_zodp.errors import ConfigError
from lit_zodp.per_example.samplers import register_sampler

#: The Hessian patterns of App. B.1 by name, with the order of their effective rank ``Tr(A)``.
HESSIANS = {"identity": "O(d)", "sqrt": "O(sqrt(d))", "log": "O(log d)"}
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def hessian_diagonal(hessian: str, dim: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """The diagonal of ``A`` for one of :data:`HESSIANS` (App. B.1 (a)-(c)): ``1``, ``i^(-1/2)`` or ``1/i``."""
    index = torch.arange(1, dim + 1, dtype=torch.float64)
    if hessian == "identity":
        diagonal = torch.ones(dim, dtype=torch.float64)
    elif hessian == "sqrt":
        diagonal = index.rsqrt()
    elif hessian == "log":
        diagonal = index.reciprocal()
    else:
        raise ConfigError(f"Expected the backbone's `hessian` in {list(HESSIANS)}, but got {hessian!r}")
    return diagonal.to(dtype)


#: Elements per chunk of the losses' no-grad pass (4 MB of float64): the residuals of one chunk of rows are squared
#: in place, where ``x - rows`` for the whole batch allocated ``B x d`` twice per forward (10,000 x 2,000: 19x slower
#: on one CPU core, page faults of the fresh memory dominating); small ``d`` takes many rows per chunk.
CHUNK_ELEMENTS = 1 << 19


def quadratic_losses(x: Tensor, rows: Tensor, diagonal: Tensor) -> Tensor:
    """``(x - x_i)^T A (x - x_i) / 2`` per row, ``[B]``, chunk by chunk in place (no autograd)."""
    out = torch.empty(len(rows), dtype=x.dtype, device=x.device)
    step = max(1, CHUNK_ELEMENTS // max(1, x.numel()))
    with torch.no_grad():
        for start in range(0, len(rows), step):
            residuals = rows[start:start + step] - x
            residuals.mul_(residuals)
            torch.mv(residuals, diagonal, out=out[start:start + step])
    return out.mul_(0.5)


class _QuadraticLosses(torch.autograd.Function):
    """The per-example losses with the exact backward ``d/dx sum_i g_i f_i = A (x sum_i g_i - sum_i g_i x_i)`` (a
    matrix-vector product): the batch gradient a first-order step's backward reaches (the per-example gradients
    come from :func:`_per_example_grads`, the layer rule)."""

    @staticmethod
    def forward(ctx, x: Tensor, rows: Tensor, diagonal: Tensor) -> Tensor:
        ctx.save_for_backward(x, rows, diagonal)
        return quadratic_losses(x, rows, diagonal)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, rows, diagonal = ctx.saved_tensors
        grad_x = diagonal * (x * grad.sum() - grad @ rows) if ctx.needs_input_grad[0] else None
        grad_rows = grad[:, None] * diagonal * (rows - x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_rows, None


def _is_transformed(*tensors: Tensor) -> bool:
    """Whether a torch.func transform (vmap, grad) wraps any of ``tensors``: the plain formula is used then."""
    return any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


class GradientNorm(Metric):
    """``||(1/N) sum_i g_i||`` over every row evaluated (all batches, all DDP ranks): the norm of the mean of
    the per-example gradients ``g_i``, which for the quadratic is the exact ``||grad F(x)||`` over the set,
    ``x`` being fixed during an evaluation.

    Args:
        dim: the gradient's length ``d``.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, dim: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.zeros(dim, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, gradient_sum: Tensor, count: int) -> None:
        """Add the sum of ``count`` rows' gradients."""
        self.total += gradient_sum.to(self.total)
        self.count += count

    def compute(self) -> Tensor:
        return (self.total / self.count.clamp_min(1)).norm()


class QuadraticLoss(Backbone):
    """``f(x; x_i) = (x - x_i)^T A (x - x_i) / 2`` with the point ``x`` as the only parameter (DPZero Sec. 5.1).

    Inputs are the rows ``x_i`` ``[B, d]`` (:class:`datamodules.QuadraticDataModule`); the targets are
    ignored (the data module gives zeros, one dummy class). ``forward`` returns the per-example losses ``[B]``.

    Args:
        dim: the dimension ``d`` (App. B.1: 20 to 2000).
        hessian: the diagonal of ``A``: ``"identity"``, ``"sqrt"`` or ``"log"`` (:data:`HESSIANS`).
        init: the starting point ``x_0 = init * (1, ..., 1)``. The paper does not state ``x_0``; the code its
            synthetic example is based on (App. B.1: Li et al. 2022, ``examples/decay_toy.py`` and
            ``decay_mean.py`` of lxuechen/private-transformers) starts its iterate at zero, so the default is
            ``0``: with rows ``~ N(1, I)``, ``F(x_0) - F* ~ Tr(A) / 2``, of the order of the effective rank.
        dtype: ``"float64"`` (default) or ``"float32"``. At the paper's ``lam = 1e-4`` the central difference
            of two losses of order ``d`` loses about ``d * 1e-7 / 1e-4`` to float32 rounding; the zeroth-order
            modules keep a float64 model's losses in float64 (review 33), and so does this default.
    """

    num_classes = 1

    def __init__(self, dim: int, hessian: str = "log", init: float = 0.0, dtype: str = "float64") -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        if dtype not in DTYPES:
            raise ConfigError(f"Expected the backbone's `dtype` in {list(DTYPES)}, but got {dtype!r}")
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not torch.isfinite(torch.tensor(init)):
            raise ConfigError(f"Expected the backbone's `init` to be a finite float, but got {init!r}")
        self.hessian = hessian
        self.x = nn.Parameter(torch.full((dim,), float(init), dtype=DTYPES[dtype]))
        # (derived from the configuration: not saved, rebuilt on load)
        self.register_buffer("hessian_diagonal", hessian_diagonal(hessian, dim, DTYPES[dtype]), persistent=False)

    @property
    def effective_rank(self) -> float:
        """``Tr(A) / ||A||_2`` (Assumption 3.5); ``||A||_2 = 1`` for every pattern."""
        return float(self.hessian_diagonal.sum() / self.hessian_diagonal.max())

    def data_mismatch(self, *, text: bool, example_shape: Optional[tuple[int, ...]]) -> Optional[str]:
        if text or example_shape is None or tuple(example_shape) == (self.dim,):
            return tensor_data_mismatch(self, text)
        return (f"the backbone QuadraticLoss has `dim` {self.dim}, but the data's rows have shape "
                f"{tuple(example_shape)}: set the same `dim` on both")

    def rows(self, inputs: Tensor) -> Tensor:
        """The rows ``x_i`` in the parameter's dtype and device, checked to be ``[B, d]``."""
        rows = as_float_input(inputs, self.x)
        if rows.dim() != 2 or rows.shape[1] != self.dim:
            raise ValueError(f"QuadraticLoss expects rows [B, {self.dim}], got examples of shape "
                             f"{tuple(rows.shape[1:])} (no batch size: a Poisson batch's is private)")
        return rows

    def forward(self, inputs: Tensor) -> Tensor:
        """The per-example losses ``(x - x_i)^T A (x - x_i) / 2``, ``[B]``: the plain formula under a torch.func
        transform, else a chunked in-place pass (:func:`quadratic_losses`; with an exact backward when autograd
        records)."""
        rows = self.rows(inputs)
        if _is_transformed(self.x, rows):
            residuals = self.x - rows
            return 0.5 * (residuals * residuals) @ self.hessian_diagonal
        if torch.is_grad_enabled() and (self.x.requires_grad or rows.requires_grad):
            return _QuadraticLosses.apply(self.x, rows, self.hessian_diagonal)
        return quadratic_losses(self.x, rows, self.hessian_diagonal)

    def per_example_loss(self, inputs: Tensor, targets: Tensor) -> Tensor:
        return self(inputs)

    def predict(self, inputs: Tensor) -> Tensor:
        """The per-example losses as ``[B, 1]`` (there are no classes)."""
        return self(inputs).unsqueeze(1)

    @torch.no_grad()
    def gradient(self, rows: Tensor) -> Tensor:
        """``grad F(x) = A (x - mean_i x_i)`` over ``rows`` (exact, no autograd)."""
        rows = self.rows(rows)
        return self.hessian_diagonal * (self.x - rows.mean(0))

    def evaluation_metrics(self) -> dict[str, Metric]:
        """``loss`` (``F`` over the evaluated set, Fig. 2) and ``grad_norm`` (``||grad F||``, Fig. 1)."""
        return {"loss": MeanLoss(), "grad_norm": GradientNorm(self.dim)}

    @torch.no_grad()
    def update_evaluation(self, metrics: Mapping[str, Metric], inputs: Tensor, targets: Tensor) -> None:
        rows = self.rows(inputs)
        metrics["loss"].update(self(rows))
        metrics["grad_norm"].update(self.hessian_diagonal * (len(rows) * self.x - rows.sum(0)), len(rows))


def _per_example_grads(layer: QuadraticLoss, rows: Tensor, grad: Tensor) -> dict[str, Tensor]:
    """The per-example gradients ``g_i A (x - x_i)``, ``[B, d]`` (the engine's layer rule)."""
    if not layer.x.requires_grad:
        return {}
    return {"x": grad.to(rows.dtype)[:, None] * layer.hessian_diagonal * (layer.x.detach() - rows)}


def _per_example_norms(layer: QuadraticLoss, rows: Tensor, grad: Tensor) -> dict[str, Tensor]:
    """``||g_i A (x - x_i)||^2`` per row without the ``[B, d]`` gradients (ghost norms)."""
    if not layer.x.requires_grad:
        return {}
    squared = quadratic_losses(layer.x.detach().to(rows.dtype), rows, layer.hessian_diagonal.to(rows.dtype) ** 2)
    return {"x": 2 * squared * grad.to(rows.dtype) ** 2}


def _summed_grads(layer: QuadraticLoss, rows: Tensor, grad: Tensor) -> dict[str, Tensor]:
    """``sum_i g_i A (x - x_i) = A (x sum_i g_i - sum_i g_i x_i)``."""
    if not layer.x.requires_grad:
        return {}
    grad = grad.to(rows.dtype)
    return {"x": layer.hessian_diagonal * (layer.x.detach() * grad.sum() - grad @ rows)}


register_sampler(QuadraticLoss, parameters=("x",), norms=_per_example_norms,
                 summed=_summed_grads)(_per_example_grads)


__all__ = ["DTYPES", "GradientNorm", "HESSIANS", "MeanLoss", "QuadraticLoss", "hessian_diagonal"]
