"""DP-GRAPE (Mulrooney et al., "Memory-Efficient Differentially Private Training with Gradient Random Projection",
Alg. 1 + 2) and its baseline naive DP-GaLore (Alg. 5), with their non-private twins GRAPE and GaLore (Alg. 4).

DP-GRAPE, one step (Alg. 1):

    P_l <- N_{s_l}(0, 1/r)                 # [m_l, r], a new seed every F steps; public randomness
    R_{l,i} <- P_l^T G_{l,i}               # projected in the backward, B x m x n never formed
    R <- sum_i clip(R_i, C)                # ONE flat clip over every projected and unprojected tensor
    R~ <- (R + N(0, sigma^2 C^2 I)) / B    # noise in the projected space; B the expected Poisson batch
    W <- W - alpha P (M / (sqrt(V) + phi)) # Alg. 2: Adam moments M, V in the projected space

Choices where the paper is silent, with their section:

* Which tensors are projected (Sec. 3.2, "nonlinear layers are handled as in DP-Adam"; Sec. 5.2, RoBERTa's embeddings
  and LM head are not projected): the weight of every ``nn.Linear`` whose smaller side exceeds ``r``, not tied to
  another layer, and not named in ``unprojected`` (default: any name component ``lm_head``, ``classifier``,
  ``head``). Everything else (biases, norms, embeddings, heads) keeps its full per-example gradient, inside the same
  flat clip (the joint sensitivity is then ``C``), with full-dimensional noise and plain Adam moments.
* Side: the smaller dimension (``W in R^{m x n}``, ``m <= n`` "WLOG"; App. D's left and right projections).
* Seeds: period ``t // F`` of the 0-based step ``t`` (Alg. 1 line 3 draws new seeds at ``t mod F == 0``; the first
  period's at initialization), from the run seed (:func:`lit_zodp.projection.projector_seed`): every DDP rank has the
  same ``P`` without communication, and ``P`` costs no privacy (it is data-independent).
* Adam: torch's bias correction, as :class:`~lit_zodp.algorithms.DPAdam` (:class:`~lit_zodp.projection.ProjectedAdam`);
  ``beta1, beta2, phi = 0.9, 0.999, 1e-8``; moments survive a change of subspace (Alg. 2 as written).
* Neighbours and sampling: add/remove one, Poisson (the paper's theory uses replace-one with ``2C/B``, Sec. 4; its
  experiments name no accountant); the released sum is divided by the expected batch size.

Naive DP-GaLore (Alg. 5) privatizes the FULL flat-clipped gradient as DP-Adam does, then (post-processing) projects it
on the top-``r`` singular vectors of the privatized gradient, recomputed every ``F`` steps, and steps projected Adam.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any, Optional, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lit_zodp.algorithms.dpsgd import DPAdam
from lit_zodp.backbones.base import batch_size_of
from lit_zodp.errors import LitZodpWarning, check_positive_int, raise_if_any
from lit_zodp.per_example import ClippedSum
from lit_zodp.per_example.transforms import Projection
from lit_zodp.privacy import clipped_fraction
from lit_zodp.projection import (UNPROJECTED, ProjectedAdam, SeededProjections, projected_names,
                                 projection_side)


class _ProjectedAdamModule(DPAdam):
    """What DP-GRAPE and naive DP-GaLore share: rank ``r``, frequency ``F`` and projected Adam (Alg. 2)."""

    abstract = True

    def __init__(self, backbone: nn.Module, *, rank: int = 16, projection_frequency: int = 100,
                 unprojected: Sequence[str] = UNPROJECTED, **kwargs: Any) -> None:
        raise_if_any([check_positive_int("rank", rank), check_positive_int("projection_frequency",
                                                                             projection_frequency),
                      None if isinstance(unprojected, (list, tuple)) and all(isinstance(n, str) for n in unprojected)
                      else f"Expected `unprojected` a list of layer-name components, but got {unprojected!r}"])
        super().__init__(backbone, **kwargs)
        self.rank, self.projection_frequency, self.unprojected = rank, projection_frequency, tuple(unprojected)
        raise_if_any([_unmatched_unprojected_error(self.backbone, self.unprojected)])
        self.projected = set(projected_names(self.backbone, rank, self.unprojected)) & set(self.engine.names)
        if not self.projected:
            warnings.warn(f"{type(self).__name__}(rank={rank}) projects no tensor: no trainable nn.Linear weight has "
                          f"a smaller side above {rank} (outside `unprojected`), so every gradient keeps its full "
                          f"dimension and this is {'DP-' if self.private else ''}Adam; lower `rank` to project",
                          LitZodpWarning, stacklevel=2)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A Trainer resume continues the checkpoint's subspaces and projected moments: with another ``rank`` or
        ``unprojected`` the moments' shapes no longer match, and the step failed inside Adam after its release was
        spent and part of the weights had moved; another ``projection_frequency`` silently moved the run to another
        period's projectors. Refused in one line, before any step."""
        if self._trainer is not None and self.trainer.training:
            raise_if_any([self._projection_change_error(checkpoint.get("hyper_parameters") or {})])
        super().on_load_checkpoint(checkpoint)

    def _projection_change_error(self, saved: dict) -> Optional[str]:
        now = {"rank": self.rank, "projection_frequency": self.projection_frequency,
               "unprojected": list(self.unprojected)}
        changed = [f"`{key}` {saved[key]!r} -> {value!r}" for key, value in now.items()
                   if key in saved and (list(saved[key]) if key == "unprojected" else saved[key]) != value]
        if not changed:
            return None
        return (f"`ckpt_path`: this checkpoint's projected Adam moments and subspaces were made with other projection "
                f"settings ({', '.join(changed)}); a resume continues them: resume with the checkpoint's settings")

    def make_optimizer(self, params):
        """Projected Adam (its moments and ``phi`` in at least float32, so float16 weights need no larger ``eps``)."""
        return ProjectedAdam(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)

    def on_train_start(self) -> None:
        super().on_train_start()
        sizes = {name: p.numel() for name, p in zip(self.engine.names, self.engine.params)}
        released = sum(self._released_size(name, p) for name, p in zip(self.engine.names, self.engine.params))
        rank_zero_info(f"{type(self).__name__}: rank {self.rank} projections of {len(self.projected)} of "
                       f"{len(sizes)} trained tensors ({sum(sizes[n] for n in self.projected):,} of "
                       f"{sum(sizes.values()):,} parameters); {released:,} coordinates per step in Adam's moments")

    def _released_size(self, name: str, param: Tensor) -> int:
        if name not in self.projected:
            return param.numel()
        return self.rank * (param.shape[1] if projection_side(param.shape) == "left" else param.shape[0])

    def apply_projected(self, gradients: list[Tensor], projections: list[Optional[Projection]]) -> None:
        """Alg. 2: hand the (projected) released gradients to projected Adam and step it (the ledger commits)."""
        self.optimizers().optimizer.hand(gradients, projections)
        self.step_optimizer()


def _unmatched_unprojected_error(module: nn.Module, unprojected: Sequence[str]) -> Optional[str]:
    """An ``unprojected`` entry (beyond the defaults, which many models lack) that is no component of any layer's
    name: a typo left the layer it meant projected, silently."""
    components = {part for name, _ in module.named_modules() for part in re.split(r"\.", name) if part}
    unmatched = [n for n in unprojected if n not in UNPROJECTED and n not in components]
    if not unmatched:
        return None
    return (f"`unprojected` names {', '.join(repr(n) for n in unmatched)}, but no layer of the model has such a name "
            f"component (e.g. {', '.join(repr(c) for c in sorted(components)[:5])})")


class DPGRAPE(_ProjectedAdamModule):
    """DP-GRAPE (Alg. 1 + 2): per-example gradients projected onto seeded Gaussian subspaces in the backward, one
    flat clip, Gaussian noise in the projected space, Adam with projected moments.

    Args (besides :class:`~lit_zodp.algorithms.DPAdam`'s):
        rank: ``r``, the projection dimension (the paper: 16 for RoBERTa-large and OPT-1.3B, 32 for OPT-2.7B,
            64 for OPT-6.7B and ViT).
        projection_frequency: ``F``, steps between new projectors (the paper: 100).
        unprojected: name components of layers kept unprojected (full per-example gradients, plain Adam).
    """

    non_private_twin = "GRAPE"

    def __init__(self, backbone: nn.Module, **kwargs: Any) -> None:
        super().__init__(backbone, **kwargs)
        self.projections = SeededProjections([n for n in self.engine.names if n in self.projected], self.rank,
                                             self.projection_frequency)
        self.engine.transform = self.projections

    def projections_at(self, step: int) -> list[Optional[Projection]]:
        """``P_l^t`` of every trained tensor at the 0-based step ``step`` (``None``: unprojected); public."""
        self.projections.run_seed = self.run_seed
        self.projections.at_step(step)
        return [self.projections.projection(name, p) for name, p in zip(self.engine.names, self.engine.params)]

    def projected_sum(self, clipped: ClippedSum, projections: list[Optional[Projection]]) -> ClippedSum:
        """The non-private path (:meth:`_batch_gradient`, no per-example gradients) sums full gradients: project the
        sum (``sum_i P^T G_i = P^T sum_i G_i``)."""
        late = [name for name, g, p, pr in zip(self.engine.names, clipped.grads, self.engine.params, projections)
                if pr is not None and g.shape == p.shape]
        # A projection AFTER the per-example clip is no projection of clipped rows: |P^T G| reaches sigma_max(P) |G|,
        # above C (sigma_max ~ 1 + sqrt(m / r)), so the noise would no longer cover one example. Only the sum of the
        # unclipped batch gradient (the non-private twin's path) may be projected here.
        raise_if_any([None if not (late and self.privacy.is_private) else
                      f"The per-example gradients of {', '.join(f'`{n}`' for n in late[:3])} came back unprojected, so "
                      f"they were clipped in full; projecting their clipped sum would raise the sensitivity above "
                      f"`clip`: the engine's transform must be this module's SeededProjections"])
        grads = [pr.of_gradients(g) if pr is not None and g.shape == p.shape else g
                 for g, p, pr in zip(clipped.grads, self.engine.params, projections)]
        return ClippedSum(grads, clipped.norms, clipped.batch_size)

    def training_step(self, batch, batch_idx: int) -> None:
        private, _ = self.split_batch(batch)
        inputs, targets = private
        size = batch_size_of(inputs)
        projections = self.projections_at(self.global_step)                 # P_l <- N_{s_l}(0, 1/r)
        clipped = self.projected_sum(self.private_gradient(inputs, targets),  # sum_i clip_C(P^T G_i), flat clip
                                     projections)
        released = self.release_gradient(clipped)                           # (. + N(0, sigma^2 C^2 I)) / B
        self.apply_projected(released, projections)                         # Alg. 2: projected Adam
        self.log_step(size, lambda: clipped_fraction(clipped.norms, self.clip))


class GRAPE(DPGRAPE):
    """Non-private twin of DP-GRAPE (clip=inf, no noise): Adam with projected moments on seeded Gaussian subspaces,
    i.e. GaLore (Alg. 4) with random projections in place of the SVD."""

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, **kwargs)


class DPGaLore(_ProjectedAdamModule):
    """Naive DP-GaLore (Alg. 5): DP-Adam's release of the full flat-clipped gradient ``G~``, then every ``F`` steps
    ``P_l <- U[:, :r]`` (left, ``out <= in``) or ``V[:, :r]`` (right) of ``SVD(G~_l)`` (post-processing of the
    release, no privacy cost), ``R~_l = P_l^T G~_l``, and Adam with projected moments (Alg. 2). The projectors are
    kept in the optimizer's state (checkpointed: they are functions of released values)."""

    non_private_twin = "GaLore"

    def svd_projection(self, gradient: Tensor) -> Projection:
        """The top-``r`` singular vectors on the smaller side of a released gradient ``[out, in]``."""
        side = projection_side(gradient.shape)
        u, _, vh = torch.linalg.svd(gradient.to(torch.float32), full_matrices=False)
        return Projection((u[:, :self.rank] if side == "left" else vh[:self.rank].T).contiguous(), side)

    def galore_projections(self, released: list[Tensor]) -> list[Optional[Projection]]:
        """``P_l`` of this step: recomputed at the steps ``t`` (0-based) with ``t mod F == 0``, else kept."""
        state = self.optimizers().optimizer.state
        renew = self.global_step % self.projection_frequency == 0
        projections = []
        for name, param, gradient in zip(self.engine.names, self.engine.params, released):
            if name not in self.projected:
                projections.append(None)
                continue
            if renew or "projector" not in state[param]:
                state[param]["projector"] = self.svd_projection(gradient).matrix
            matrix = state[param]["projector"]
            projections.append(Projection(matrix, projection_side(param.shape)))
        return projections

    def training_step(self, batch, batch_idx: int) -> None:
        private, _ = self.split_batch(batch)
        inputs, targets = private
        size = batch_size_of(inputs)
        clipped = self.private_gradient(inputs, targets)                  # sum_i clip_C(G_i), flat clip
        released = self.release_gradient(clipped)                         # G~ = (. + N(0, sigma^2 C^2 I_d)) / B
        projections = self.galore_projections(released)                   # P_l <- SVD(G~_l)[:, :r] every F
        projected = [g if pr is None else pr.of_gradients(g) for g, pr in zip(released, projections)]
        self.apply_projected(projected, projections)                      # Alg. 2: projected Adam
        self.log_step(size, lambda: clipped_fraction(clipped.norms, self.clip))


class GaLore(DPGaLore):
    """Non-private GaLore (Alg. 4): the batch gradient's top-``r`` singular subspace every ``F`` steps, projected Adam."""

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, **kwargs)


__all__ = ["DPGRAPE", "DPGaLore", "GRAPE", "GaLore", "UNPROJECTED"]
