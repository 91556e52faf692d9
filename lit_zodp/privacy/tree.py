"""The tree mechanism (Kornowski, Liu & Talwar, Alg. 1 and Prop. 2.5): noisy prefix sums of a stream of vectors.

Within a period of ``Sigma`` steps, step ``p`` (1-based) adds an increment ``v_p`` and releases
``sum_{j <= p} v_j + TREE(p)``, where ``TREE(p)`` sums one independent noise vector ``zeta_node ~ N(0, std^2 I)`` per
dyadic node of the binary decomposition of ``[1, p]``. A node's noise is drawn once and reused by every later
prefix that contains the node, so the releases are post-processing of the noisy node sums: each increment lies in at
most :func:`releases_per_leaf` of them, and a change of one increment by ``s`` in L2 is a composition of that many
Gaussian mechanisms of sensitivity ``s`` (adaptive: ``v_p`` may depend on the earlier releases): ``mu = sqrt(count)
s / std``. Where the paper's indexing is off, this follows the reading notes' fix:

* Alg. 1's ``NODE(t)`` with ``ceil(log Sigma)`` levels covers only ``[1, Sigma - 1]`` when ``Sigma`` is a power of 2,
  and the oracles call ``TREE(t mod Sigma)``, which adds no noise at a period's last step (``NODE(0)`` is empty). Here
  positions run ``1..Sigma`` (``((t - 1) mod Sigma) + 1``) over a dyadic tree whose levels reach ``2^l <= Sigma``, so
  every release has noise and every node lies inside the period.
* Prop. 2.5 calibrates to ``sqrt(log Sigma)`` levels; the exact count of released nodes holding one leaf is
  ``floor(log2 Sigma) + 1`` (:func:`releases_per_leaf`, the first leaf's), which the step plan declares.

The node noise is secret: each node's vector is regenerated on demand from its own 128-bit key drawn from the run's
secret noise source (:class:`~lit_zodp.privacy.noise.SecretGaussianVector`), so no noise vector is stored, and the
keys and the running sum (a function of private data) live in memory only, never in a checkpoint. A resumed run
therefore starts a new period: a node re-drawn under a new key would release its sum a second time.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lit_zodp.errors import check_positive_int, raise_if_any
from lit_zodp.privacy.noise import NoiseSource, SecretGaussianVector

Node = tuple[int, int]  # (first, last) leaf of a dyadic interval, 1-based and inclusive


def dyadic_nodes(position: int) -> list[Node]:
    """``NODE(p)`` of Alg. 1: the dyadic intervals of the binary decomposition of ``[1, p]``, largest first.

    Level ``l`` contributes the node ``(k + 1, k + 2^l)`` exactly when bit ``l`` of ``p`` is set (``k``: the
    leaves covered by the higher levels), so there are ``popcount(p)`` nodes, disjoint, covering ``[1, p]``.
    """
    if position < 1:
        raise ValueError(f"A tree position is 1-based, got {position}")
    nodes, covered = [], 0
    for level in range(position.bit_length() - 1, -1, -1):
        if position >> level & 1:
            nodes.append((covered + 1, covered + (1 << level)))
            covered += 1 << level
    return nodes


def releases_per_leaf(period: int) -> int:
    """The most released nodes one leaf of a period of ``period`` steps lies in: ``floor(log2 period) + 1``.

    A node of level ``l`` is released (by some ``NODE(p)``, ``p <= period``) iff its index ``(first - 1) / 2^l`` is
    even and it ends by ``period``; leaf 1 lies in such a node at every level with ``2^l <= period``, and no leaf
    lies in more (one node per level).
    """
    return check_period(period).bit_length()


def check_period(period: int) -> int:
    raise_if_any([check_positive_int("tree period", period)])
    return period


class TreeAggregator:
    """Noisy prefix sums of one period's increments (Alg. 1), then a fresh tree for the next period.

    ``push(v, std, noise)`` adds the increment ``v`` and returns the running sum plus ``TREE(p)``, in float64 on
    ``v``'s device. ``std = 0`` (non-private) returns the exact running sum. The running sum and the node keys are
    secret and in memory only: :meth:`reset` (a new period, or a resumed run) forgets them.
    """

    def __init__(self, period: int) -> None:
        self.period = check_period(period)
        self.reset()

    def reset(self) -> None:
        """Start a new period: no increments, no node keys."""
        self.position = 0
        self._total: Optional[Tensor] = None
        self._node_noise: dict[Node, SecretGaussianVector] = {}

    @property
    def period_done(self) -> bool:
        """Whether the next push starts a new period (none pushed yet, or ``period`` pushed)."""
        return self.position in (0, self.period)

    def push(self, increment: Tensor, std: float, noise: Optional[NoiseSource]) -> Tensor:
        """Add ``increment`` (the next leaf) and release the noisy prefix sum of the period so far."""
        if self.position == self.period:
            self.reset()
        self.position += 1
        increment = increment.detach().to(torch.float64)
        self._total = increment.clone() if self._total is None else self._total.add_(increment)
        released = self._total.clone()
        if std:
            flat = released.view(-1)
            for node in dyadic_nodes(self.position):
                self._noise_of(node, noise).add_scaled_(flat, std, 0)
        return released

    def _noise_of(self, node: Node, noise: Optional[NoiseSource]) -> SecretGaussianVector:
        """The node's noise vector, keyed once per period from the secret source (the same key on every DDP rank:
        their sources share a secret and draw keys in the same order)."""
        vector = self._node_noise.get(node)
        if vector is None:
            if noise is None:
                raise RuntimeError("A noisy tree release needs the run's secret noise source")
            vector = self._node_noise[node] = noise.vector_key()
        return vector

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickling) holds no secret: a fresh period."""
        return {"period": self.period}

    def __setstate__(self, state: dict) -> None:
        self.period = state["period"]
        self.reset()


__all__ = ["Node", "TreeAggregator", "dyadic_nodes", "releases_per_leaf"]
