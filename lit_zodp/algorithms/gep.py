"""GEP, gradient embedding perturbation (Yu, Zhang, Chen & Liu, ICLR 2021, "Do not let privacy overbill utility"),
the PAZO paper's fourth FO+PUB baseline (Sec. 5, Tables 2-4), with its non-private twin.

One step (GEP Alg. 1, as its authors' code runs it; the PAZO paper adopts "their provided implementation and privacy
accounting", App. C.3):

    G_pub <- per-example gradients of the public batch at x_t      # the anchor gradients [b', d]
    V_g <- power method on G_pub's columns of group g              # the anchor subspace, orthonormal [n_g, k_g]
    w_i <- (V_g^T g_i)_g ;  r_i <- g_i - V w_i                     # embedding [K] and residual [d] of example i
    w~ <- (sum_i clip_C0(w_i) + N(0, 2 sigma^2 C0^2 I_K)) / B     # sigma: the step's multiplier (see below)
    r~ <- (sum_i clip_C1(r_i) + N(0, 2 sigma^2 C1^2 I_d)) / B
    x_{t+1} <- SGD step on V w~ + r~

Choices, with where they come from:

* Groups (GEP Sec. 3.1 / App. B, the authors' ``group_params``): the flat parameter vector, in the backbone's
  parameter order, cut into ``num_groups`` consecutive parts of equal size (the last takes the remainder), however
  they fall across tensors; group ``g`` gets ``floor(K sqrt(n_g) / sum_h sqrt(n_h))`` bases (at most ``n_g``).
* Power method (the authors' ``get_bases``): ``L ~ N(0, 1)`` of shape ``[n_g, k_g]``, then ``power_iterations``
  times ``L <- orth(G_g^T G_g L)``; ``orth`` is a Householder QR here (the code's Gram-Schmidt, up to the signs of
  columns), run in the coordinates of ``G_g``'s right singular vectors over its singular values above
  ``sqrt(eps) s_1`` (the same subspace: ``G^T G L = W S^2 W^T L``; the smaller ones are round-off in ``G^T G L``).
  With fewer anchor gradients (or a smaller rank) than bases the columns past the rank are an arbitrary orthonormal
  completion: the code normalises round-off there, which a last-bit change of the weights turned completely (a DDP
  fit's weights parted from one process's); here it is the seeded start's remaining columns projected off the
  span. They only add noise dimensions, so keep ``num_bases`` at most ``num_groups * b'`` to avoid them (warned at
  the fit's first step). ``L``'s draw and the anchor pass's dropout are
  public randomness from the run seed and the step (every DDP rank the same subspace without communication); the
  subspace is a function of public data and the released weights, so it costs no privacy.
* Clipping: the embedding is clipped as ONE vector over all groups (``C0``), the residual as one vector over all
  parameters (``C1``); the residual is taken against the UNCLIPPED embedding (the code's ``no_reduction_approx``).
* Accounting (GEP Thm. 3.1; the code's ``get_sigma`` doubles the RDP): two Gaussian releases on the same batch, each
  of noise multiplier ``s``, compose into one of multiplier ``s / sqrt(2)``. Here ``noise_multiplier`` is that
  step's multiplier ``sigma`` (as PAZO's ``q`` queries): each release gets ``sqrt(2) sigma`` times its clip, which is
  the code's noise at the same epsilon.
* ``B`` is the EXPECTED Poisson batch size (the library's convention); the code divides by its fixed batch size.
* Defaults from the authors' code where PAZO is silent: ``num_bases = 1000``, ``num_groups = 3`` (PAZO's reading
  notes, "1000 bases, 3 parameter groups"), ``power_iterations = 1``, ``embedding_clip`` ``C0 = 5`` (PAZO tunes only
  ``C1``, Tables 12-13). The optimizer is SGD (the code's ``optim.SGD`` with ``momentum`` and ``weight_decay``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lit_zodp.algorithms.dpsgd import DPSGD
from lit_zodp.algorithms.public import PublicBatches
from lit_zodp.backbones.base import batch_size_of, per_example_loss
from lit_zodp.errors import ConfigError, LitZodpWarning, check_positive_int, raise_if_any
from lit_zodp.per_example import ClippedParts
from lit_zodp.per_example.ghost import at_least_float32
from lit_zodp.per_example.rounding import outside_autocast
from lit_zodp.privacy import GaussianRelease, StepPlan, clipped_fraction
from lit_zodp.privacy.component import clip_errors
from lit_zodp.privacy.training_randomness import keyed_training_randomness
from lit_zodp.zo.seeds import derive_seed

EMBEDDING, RESIDUAL = "embedding", "residual"
#: Key of the power method's starting draws: never shared with the direction seeds or DP-GRAPE's projectors.
ANCHOR_STREAM = 0x6E9


def parameter_groups(total: int, groups: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each group of the flat parameter vector: ``groups`` consecutive equal parts, the last taking
    the remainder (the authors' ``group_params``); empty groups (fewer coordinates than groups) are dropped."""
    size = total // groups
    bounds = [g * size for g in range(groups)] + [total]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def bases_per_group(num_bases: int, sizes: list[int]) -> list[int]:
    """``floor(K sqrt(n_g) / sum_h sqrt(n_h))`` bases for each group of ``n_g`` coordinates, at most ``n_g``."""
    roots = [math.sqrt(n) for n in sizes]
    return [min(n, int(num_bases * root / sum(roots))) for n, root in zip(sizes, roots)]


@dataclass
class AnchorSubspace:
    """The anchor subspace: per group ``[start, end)`` an orthonormal basis ``V_g [n_g, k_g]`` (float32, or float64
    for float64 weights)."""

    groups: list[tuple[int, int]]
    bases: list[Tensor]

    @property
    def dimension(self) -> int:
        """``K = sum_g k_g``, the embedding's size."""
        return sum(basis.shape[1] for basis in self.bases)

    def embed(self, flat: Tensor) -> Tensor:
        """``w = (V_g^T g)_g`` of rows ``flat [B, d]``: ``[B, K]``."""
        return torch.cat([flat[:, a:b] @ basis for (a, b), basis in zip(self.groups, self.bases)], 1)

    def subtract_reconstruction_(self, flat: Tensor, embedding: Tensor) -> Tensor:
        """``flat - V w`` in place, row by row (each row's residual from its own embedding): the residuals."""
        offset = 0
        for (a, b), basis in zip(self.groups, self.bases):
            k = basis.shape[1]
            flat[:, a:b] -= embedding[:, offset:offset + k] @ basis.T
            offset += k
        return flat

    def reconstruct(self, embedding: Tensor) -> Tensor:
        """``V w`` of one embedding ``[K]``: ``[d]``."""
        parts, offset = [], 0
        for basis in self.bases:
            k = basis.shape[1]
            parts.append(basis @ embedding[offset:offset + k])
            offset += k
        return torch.cat(parts)


def anchor_subspace(anchors: Tensor, groups: list[tuple[int, int]], counts: list[int], power_iterations: int,
                    seed: int) -> AnchorSubspace:
    """The power method on each group's anchor gradients ``anchors [m, d]`` (GEP Sec. 3.1; the authors' ``get_bases``):
    ``L ~ N(0, 1)`` (torch's generator of the anchors' device, keyed by ``seed`` and the group: the same on every rank
    of one device type), ``power_iterations`` times ``L <- orth(G^T G L)``. (The package's counter-based Philox drew
    the 155M starting values of a 1.4M-parameter LSTM's group in minutes on a CPU.) Autocast is off: under
    ``bf16-mixed`` the products came out in bfloat16, which CUDA's QR refuses (found on an H200)."""
    with outside_autocast(anchors.device.type):
        return _power_method(anchors, groups, counts, power_iterations, seed)


def _power_method(anchors: Tensor, groups: list[tuple[int, int]], counts: list[int], power_iterations: int,
                  seed: int) -> AnchorSubspace:
    bases = []
    for index, ((a, b), k) in enumerate(zip(groups, counts)):
        block = at_least_float32(anchors[:, a:b])  # (float64 weights: float64 bases, as their rows)
        generator = torch.Generator(device=anchors.device).manual_seed(derive_seed(seed, index))
        start = torch.randn(b - a, k, generator=generator, device=anchors.device,
                            dtype=torch.float32).to(block.dtype)  # (float32 draws whatever the default dtype)
        rows, squares = _row_space(block)  # G = U S W^T: W^T [r, n_g] and S^2 [r] of its numerical rank r
        spanned = min(k, len(rows))  # G^T G L has rank r: QR's columns past it were its round-off
        coords = rows @ start[:, :spanned]  # (L <- orth(G^T G L) in the coordinates of W: W orth(S^2 W^T L))
        for _ in range(power_iterations):
            coords = torch.linalg.qr(squares[:, None] * coords).Q
        basis = rows.T @ coords
        bases.append(basis if spanned == k else torch.cat([basis, _completion(basis, start[:, spanned:])], 1))
    return AnchorSubspace(groups, bases)


def _row_space(block: Tensor) -> tuple[Tensor, Tensor]:
    """``W_r^T`` and ``S_r^2`` of ``block = U S W^T`` over the singular values above ``sqrt(eps) s_1``, those that
    ``G^T G L`` resolves in the block's precision (its round-off is ``eps s_1^2``). A zero or repeated anchor gradient
    (a dead ReLU's group) leaves a singular value of round-off, and one just above it a direction that a last-bit
    change of the weights turned by ~ that change over it: both changed the basis, and the noise ``V z`` with it."""
    _, values, rows = torch.linalg.svd(block, full_matrices=False)
    if not len(values) or not bool(values[0] > 0):
        return rows[:0], values[:0]
    rank = int((values > values[0] * math.sqrt(torch.finfo(block.dtype).eps)).sum())
    return rows[:rank], values[:rank] ** 2


def _completion(basis: Tensor, draws: Tensor) -> Tensor:
    """Orthonormal columns spanning ``draws`` (the start's columns past the anchors' rank) projected off ``basis``:
    the bases past the anchor gradients' span. QR's columns past the rank of ``G^T G L`` came from its round-off, so
    a last-bit change of the weights (a DDP all-reduce summing the clipped sums in another order) turned them, and
    the embedding's noise ``V z`` with them, completely (the DDP test's 0.19, from step 3); the projected draws
    move with ``basis`` only as much as it moves. Public: the seeded start and the public subspace."""
    for _ in range(2):  # (twice: orthogonal to working precision)
        draws = draws - basis @ (basis.T @ draws)
    return torch.linalg.qr(draws).Q


def flatten_rows(grads: list[Tensor]) -> Tensor:
    """Per-example gradients ``[B, ...]`` (one per parameter) as one float32 (or wider) matrix ``[B, d]``; the list is
    emptied as the rows are copied, so each tensor's memory can go."""
    size = len(grads[0]) if grads else 0
    flat = torch.cat([at_least_float32(g).reshape(size, math.prod(g.shape[1:])) for g in grads], 1)
    grads.clear()
    return flat


class GEP(PublicBatches, DPSGD):
    """GEP (Yu et al. 2021, Alg. 1): embed each private per-example gradient in an anchor subspace found from public
    per-example gradients, clip and noise the embedding and the residual separately, step SGD on their sum.

    Args (besides :class:`~lit_zodp.algorithms.DPSGD`'s; ``clip`` is the residual's ``C1``):
        embedding_clip: ``C0``, the embedding's clip (the authors' default 5).
        num_bases: ``K``, the anchor subspace's dimension over all groups (1000).
        num_groups: parameter groups, each with its own subspace (3).
        power_iterations: power-method iterations per step (1).
    Per-example gradients are materialised (``grad_mode`` "hooks" or "vmap"): each is projected as a whole vector.
    """

    non_private_twin = "NonPrivateGEP"

    def __init__(self, backbone: nn.Module, *, embedding_clip: float = 5.0, num_bases: int = 1000,
                 num_groups: int = 3, power_iterations: int = 1, **kwargs: Any) -> None:
        mode = kwargs.get("grad_mode", "hooks")
        budget = (kwargs.get("target_epsilon"), kwargs.get("noise_multiplier")) if self.private else (None, None)
        raise_if_any([
            None if mode in ("hooks", "vmap") else
            f"GEP embeds materialised per-example gradients: expected `grad_mode` 'hooks' or 'vmap', but got {mode!r}",
            *clip_errors("embedding_clip", embedding_clip, *budget, noise_std="sqrt(2) sigma * embedding_clip"),
            check_positive_int("num_bases", num_bases), check_positive_int("num_groups", num_groups),
            check_positive_int("power_iterations", power_iterations)])
        super().__init__(backbone, **kwargs)
        self.embedding_clip, self.num_bases = float(embedding_clip), num_bases
        self.num_groups, self.power_iterations = num_groups, power_iterations
        sizes = [p.numel() for p in self.engine.params]
        self.groups = parameter_groups(sum(sizes), num_groups)
        self.bases_counts = bases_per_group(num_bases, [b - a for a, b in self.groups])
        self.subspace: AnchorSubspace | None = None
        self._planned_embedding_clip = math.inf  # (the fit's C0, fixed at its plan: the embedding's noise is its)

    def step_plan(self) -> StepPlan:
        """Two releases on the batch, in units of ``clip = C1``: the embedding sum (sensitivity ``C0``, noise
        ``sqrt(2) sigma C0``) and the residual sum (``C1``, ``sqrt(2) sigma C1``): one Gaussian of multiplier
        ``sigma``. (An infinite clip is the noiseless ablation's: its units do not matter.)"""
        self._planned_embedding_clip = self.embedding_clip
        finite = not (math.isinf(self.embedding_clip) or math.isinf(self.clip))
        ratio = self.embedding_clip / self.clip if finite else 1.0
        return (GaussianRelease(EMBEDDING, sensitivity=ratio, noise=math.sqrt(2) * ratio),
                GaussianRelease(RESIDUAL, noise=math.sqrt(2)))

    def on_train_start(self) -> None:
        super().on_train_start()
        self._bases_checked = False

    def _warn_of_bases_past_the_anchors(self, anchors: int) -> None:
        """Once per fit: bases beyond the ``num_groups * b'`` the anchor gradients span are arbitrary directions."""
        self._bases_checked = True
        if self.num_bases > self.num_groups * anchors:
            warnings.warn(f"GEP(num_bases={self.num_bases}, num_groups={self.num_groups}) asks more bases than the "
                          f"{anchors} anchor gradients of a public batch span in each group: the rest are arbitrary "
                          f"directions that only add noise; set num_bases <= {self.num_groups * anchors}",
                          LitZodpWarning, stacklevel=2)

    # ------------------------------------------------------------------------------ verbs
    def anchor_gradients(self, public_batch, seed: int) -> Tensor:
        """Per-example gradients ``[b', d]`` of the PUBLIC batch at the current weights (backprop on public data only).
        Its dropout is drawn from streams keyed by the step's public ``seed``, so every DDP rank draws the same masks
        and finds the same subspace (secret states, as a private forward's, gave each rank its own ``V_r``: the
        all-reduced embedding then added coordinates of different bases and the ranks' weights parted, review 62);
        torch's seeded streams stay where they were."""
        inputs, targets = public_batch
        with (self.public_backprop(), self._no_ddp_grad_sync(),
              keyed_training_randomness(self.device, derive_seed(seed, 0, 1))):  # (the groups' starts: (seed, g, 0))
            grads = self.engine.per_example_gradients(
                lambda: at_least_float32(per_example_loss(self.backbone, inputs, targets)))
        return flatten_rows(grads)

    def find_subspace(self, public_batch) -> AnchorSubspace:
        """``V``: the power method on the anchor gradients, from this step's public draw (Alg. 1, lines 3-4)."""
        seed = derive_seed(self.run_seed, ANCHOR_STREAM, self.global_step)
        anchors = self.anchor_gradients(public_batch, seed)
        if not bool(anchors.isfinite().all()):  # (a NaN basis would zero every private row and NaN the weights)
            raise ConfigError(f"GEP: the anchor gradients at step {self.global_step} are not finite (the public "
                              "batch's loss is inf or NaN at these weights): lower `lr`, or check the public data")
        if not getattr(self, "_bases_checked", False):
            self._warn_of_bases_past_the_anchors(len(anchors))
        return anchor_subspace(anchors, self.groups, self.bases_counts, self.power_iterations, seed)

    def embedding_and_residual(self, grads: list[Tensor]) -> list[Tensor]:
        """``[w_i, r_i]`` of each example from its per-example gradients (the engine's part split)."""
        flat = flatten_rows(grads)
        embedding = self.subspace.embed(flat)
        return [embedding, self.subspace.subtract_reconstruction_(flat, embedding)]

    def takes_batch_gradient(self) -> bool:
        """Never: GEP's step always splits the per-example gradients (the twin's too, whose unclipped embedding and
        residual add up to SGD's step, to rounding)."""
        return False

    def clipped_sums(self, loss_fns: list) -> ClippedParts:
        """``sum_i clip_C0(w_i)`` and ``sum_i clip_C1(r_i)``, micro-batch by micro-batch. ``C0`` is at most the fit's
        planned one: the embedding's noise is the plan's, so an ``embedding_clip`` raised within the fit (a callback,
        a scheduler) clipped embeddings above it (red-team review 62; O2NC's ``difference_clip``, review 59)."""
        return self.engine.clipped_parts_microbatched(loss_fns, self.embedding_and_residual,
                                                      (self.embedding_clip_now(), self.clip))

    def embedding_clip_now(self) -> float:
        """This step's ``C0``: ``embedding_clip``, capped at the value the fit's plan noised for."""
        return min(self.embedding_clip, self._planned_embedding_clip)

    def release_gradient(self, clipped: ClippedParts) -> list[Tensor]:
        """``V w~ + r~``, the two releases' sum, split back per parameter."""
        embedding, residual = clipped.sums
        with outside_autocast(embedding.device.type):  # (V w~ in the sums' precision, not autocast's bfloat16)
            released = (self.subspace.reconstruct(self.privacy.release(embedding, EMBEDDING,
                                                                       batch_size=clipped.batch_size))
                        + self.privacy.release(residual, RESIDUAL, batch_size=clipped.batch_size))
        shapes = [p.shape for p in self.engine.params]
        return [part.view(shape) for part, shape in zip(released.split([math.prod(s) for s in shapes]), shapes)]

    # ------------------------------------------------------------------------------ step
    def training_step(self, batch, batch_idx: int) -> None:
        inputs, targets = self.private_batch(batch)
        size = batch_size_of(inputs)
        (public,) = self.public_batches(batch)
        self.subspace = self.find_subspace(public)                                # V from the anchor gradients
        clipped = self.private_gradient(inputs, targets)                          # sum clip_C0(w_i), sum clip_C1(r_i)
        self.apply_gradient(self.release_gradient(clipped))                       # V w~ + r~, SGD step
        self.log_step(size, lambda: clipped_fraction(clipped.norms[:, 1], self.clip))


class NonPrivateGEP(GEP):
    """GEP's step without privacy: ``clip = embedding_clip = inf`` by default, where it is SGD on the private batch
    (the embedding and the residual add up to the gradient); finite clips give the noiseless clipped ablation."""

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, embedding_clip: float = math.inf,
                 **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, embedding_clip=embedding_clip, **kwargs)


__all__ = ["GEP", "NonPrivateGEP", "AnchorSubspace", "anchor_subspace", "bases_per_group", "parameter_groups"]
