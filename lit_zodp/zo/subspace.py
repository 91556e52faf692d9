"""Directions in a public subspace: ``v = G u`` with ``G = [g_1 .. g_k]`` public gradients (PAZO-P, Alg. 2).

:class:`SubspacePerturbation` has the interface of :class:`~lit_zodp.zo.PerturbationEngine` (``perturb_``,
``pending``, ``restore_and_update_``), so :func:`~lit_zodp.zo.central_differences`, :class:`~lit_zodp.zo.ZOSGD`
and the zeroth-order module's verbs work unchanged; only the direction differs. The basis ``G`` is held as one
``[k, *p.shape]`` tensor per parameter (the paper's ``O(kd)`` memory, Sec. 3.2) and is replaced each step
(:meth:`SubspacePerturbation.set_basis`); the coefficients ``u in R^k`` are drawn from the public seed, so
every DDP rank holds the same ``u`` without communication.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor

from lit_zodp.per_example.rounding import outside_autocast
from lit_zodp.zo.perturbation import _per_param

#: Columns of ``G`` whose norm (after Gram-Schmidt: whose residual) is below this share of the largest
#: column's norm carry no new direction: they are set to zero instead of divided by (almost) zero.
DEGENERATE_SHARE = 1e-6


def subspace_coefficients(seed: int, k: int) -> Tensor:
    """``u ~ N(0, I_k)`` (float64, CPU) from the public ``seed``: PAZO-P's coefficients (the authors' code draws
    ``N(0, I_k)``; Alg. 2 line 6's ``sqrt(k)`` sphere has the same second moment)."""
    generator = torch.Generator().manual_seed(int(seed) & ((1 << 63) - 1))
    return torch.randn(k, dtype=torch.float64, generator=generator)


def column_dots(basis: Sequence[Tensor]) -> Tensor:
    """``G^T G`` (``[k, k]``, float64) of a basis held as ``[k, *shape]`` tensors, summed over the tensors."""
    k = basis[0].shape[0]
    gram = torch.zeros(k, k, dtype=torch.float64, device=basis[0].device)
    for b in basis:
        flat = b.reshape(k, -1).double()
        gram += flat @ flat.T
    return gram.cpu()


@torch.no_grad()
def normalize_columns_(basis: Sequence[Tensor]) -> list[float]:
    """``g_j <- g_j / ||g_j||`` in place (PAZO-P', the column-normalised variant); returns the norms. A degenerate
    column (norm below :data:`DEGENERATE_SHARE` of the largest, e.g. a zero public gradient) is set to zero."""
    norms = column_dots(basis).diagonal().sqrt().tolist()
    scales = _inverse_norms(norms)
    for b in basis:
        b.mul_(torch.tensor(scales, dtype=b.dtype, device=b.device).view(-1, *([1] * (b.dim() - 1))))
    return norms


@torch.no_grad()
def orthonormalize_(basis: Sequence[Tensor]) -> list[float]:
    """Gram-Schmidt over the columns, in order, each normalised (PAZO-P; the authors' code orthogonalises sequentially,
    then normalises). The modified form: each projection is taken against the column as updated so far (the classical
    form's result in exact arithmetic, and more stable in floating point). Inner products are accumulated in float64
    across the tensors, one host read each. Returns each column's residual norm; a degenerate residual (a public
    gradient in the span of the previous ones) becomes a zero column, so ``G^T G`` is the identity on the kept columns
    and zero elsewhere."""
    largest = max(math.sqrt(max(v, 0.0)) for v in column_dots(basis).diagonal().tolist())
    residuals = []
    for j in range(basis[0].shape[0]):
        for i in range(j):
            if residuals[i]:
                dot = _column_dot(basis, i, j)
                for b in basis:
                    b[j].sub_(b[i], alpha=dot)
        norm = math.sqrt(_column_dot(basis, j, j))
        kept = _kept(norm, largest)
        for b in basis:
            if kept:
                b[j].mul_(1.0 / norm)
            else:
                b[j].zero_()
        residuals.append(norm if kept else 0.0)
    return residuals


def _column_dot(basis: Sequence[Tensor], i: int, j: int) -> float:
    """``<g_i, g_j>`` over every tensor of the basis, summed in float64 on the device and read once."""
    return float(sum((b[i].double() * b[j].double()).sum() for b in basis))


def _kept(norm: float, largest: float) -> bool:
    """Whether a column of this norm carries a direction: not below :data:`DEGENERATE_SHARE` of the largest column."""
    return norm > 0 and norm > DEGENERATE_SHARE * largest


def _inverse_norms(norms: list[float]) -> list[float]:
    largest = max(norms, default=0.0)
    return [1.0 / n if _kept(n, largest) else 0.0 for n in norms]


class SubspacePerturbation:
    """Applies ``theta += s * G u(seed)`` and the fused restore-and-update, ``G`` a public basis set each step.

    Args:
        params: the parameters, in a fixed order.
        k: the number of basis columns.
    """

    def __init__(self, params: Sequence[Tensor], k: int) -> None:
        self.params = list(params)
        if not self.params:
            raise ValueError("The perturbation engine needs at least one trainable parameter")
        self.k = int(k)
        self.pending: dict[int, float] = {}
        self.basis: Optional[list[Tensor]] = None

    @property
    def dim(self) -> int:
        return sum(p.numel() for p in self.params)

    def set_basis(self, basis: Sequence[Tensor]) -> None:
        """The step's ``G``: one ``[k, *p.shape]`` tensor per parameter. Refused while a perturbation is pending
        (its restore needs the basis it was made with)."""
        if self.pending:
            raise RuntimeError("set_basis() while a perturbation is pending: restore the parameters first")
        shapes = [tuple(b.shape) for b in basis]
        expected = [(self.k, *p.shape) for p in self.params]
        if shapes != expected:
            raise ValueError(f"Expected a basis of shapes {expected}, but got {shapes}")
        self.basis = list(basis)

    def direction(self, seed: int) -> list[Tensor]:
        """``G u(seed)`` as tensors shaped like the parameters (in the basis' dtype)."""
        u = subspace_coefficients(seed, self.k)
        with outside_autocast(self.params[0].device.type):
            return [_combine(b, u) for b in self._basis()]

    @torch.no_grad()
    def perturb_(self, seed: int, scale: float) -> None:
        """``theta += scale * G u(seed)`` in place."""
        u = subspace_coefficients(seed, self.k)
        with outside_autocast(self.params[0].device.type):
            for p, b in zip(self.params, self._basis()):
                p.add_(_combine(b, u).to(p.dtype), alpha=scale)
        total = self.pending.get(seed, 0.0) + scale
        if abs(total) <= 1e-12 * max(1.0, abs(scale)):
            self.pending.pop(seed, None)
        else:
            self.pending[seed] = total

    @torch.no_grad()
    def restore_and_update_(self, coefficients: Optional[Mapping[int, float]] = None, *,
                            lr: Sequence[float] | float = 0.0, weight_decay: Sequence[float] | float = 0.0,
                            extra_terms: Sequence[tuple] = ()) -> None:
        """One pass: remove the pending perturbation, then ``theta <- (1-lr*wd) theta - lr * sum_k c_k G u_k``
        (the chunked engine's order of operations). The ``u_k`` are combined first: one ``G``-product per tensor."""
        if extra_terms:
            raise ValueError("SubspacePerturbation does not apply extra noise terms")
        coefficients = {int(s): float(c) for s, c in (coefficients or {}).items()}
        seeds = sorted(set(self.pending) | set(coefficients))
        lrs, decays = _per_param(lr, len(self.params)), _per_param(weight_decay, len(self.params))
        us = {seed: subspace_coefficients(seed, self.k) for seed in seeds}
        with outside_autocast(self.params[0].device.type):
            for index, (p, b) in enumerate(zip(self.params, self._basis() if seeds else [None] * len(self.params))):
                shrink = 1.0 - lrs[index] * decays[index]
                if shrink != 1.0:
                    p.mul_(shrink)
                if not seeds:
                    continue
                weights = sum((-shrink * self.pending.get(s, 0.0) - lrs[index] * coefficients.get(s, 0.0)) * us[s]
                              for s in seeds)
                p.add_(_combine(b, weights).to(p.dtype))
        self.pending.clear()

    def restore_(self) -> None:
        """Undo the pending perturbation (exact up to floating point)."""
        if self.pending:
            self.restore_and_update_()

    def _basis(self) -> list[Tensor]:
        if self.basis is None:
            raise RuntimeError("SubspacePerturbation has no basis: call set_basis(G) first")
        return self.basis


def _combine(basis: Tensor, weights: Tensor) -> Tensor:
    """``sum_j weights_j basis[j]`` (one ``tensordot``; the weights cast to the basis' dtype and device). Callers turn
    autocast off (:func:`~lit_zodp.per_example.rounding.outside_autocast`, once per pass): under ``bf16-mixed`` the
    perturbation and its restore were combined in bfloat16, each rounded its own way, so ``-lam G u`` left
    ``2^-8``-relative residues of the perturbation in the weights."""
    return torch.tensordot(weights.to(dtype=basis.dtype, device=basis.device), basis, dims=1)


__all__ = ["SubspacePerturbation", "normalize_columns_", "orthonormalize_", "subspace_coefficients"]
