"""The first-order baselines with public data of the PAZO paper (Gong & Li, Sec. 5, "FO+PUB"): DOPE-SGD's recentred
clipping and DPMD's public/private mix, with their non-private twins.

The paper names and cites them without pseudo-code; the steps below follow its authors' code
(github.com/xuchengong/PAZO), as its reading notes record (``shared/notes/004``, Sec. 1 "Baselines"):

* DOPE-SGD: ``g = (sum_i clip_C(grad f(x; xi_i) - g_pub) + b g_pub + N(0, sigma^2 C^2 I)) / b``: the recentred
  clipping of Nasr et al. (ICML 2023, "Effectively using public data in privacy preserving machine learning")
  without its synthetic-data part. Here ``b`` is the EXPECTED Poisson batch size (so the public term is exactly
  ``g_pub``), and the clip bounds each example's distance to ``g_pub`` in one flat norm.
* DPMD (PDA-DPMD, Amid et al. 2022, "Public data-assisted mirror descent"): ``g = a_t g~ + (1 - a_t) g_pub`` with
  ``g~`` DP-SGD's release and ``a_t = cos(pi t / (2 T))``, ``T`` the run's steps (the code's schedule).

``g_pub`` is the mean-loss gradient of the step's public batch at the current weights, by ordinary backprop
(:meth:`~lit_zodp.algorithms.base.AlgorithmModule.public_gradient`): public, so only DP-SGD's release is accounted
(one Gaussian release of sensitivity ``C`` per step). The optimizer is SGD (the code's ``torch.optim.SGD(lr)``;
``momentum`` as DP-SGD's).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from torch import Tensor, nn

from lit_zodp.algorithms.base import fit_steps
from lit_zodp.algorithms.dpsgd import DPSGD
from lit_zodp.algorithms.public import PublicBatches
from lit_zodp.backbones.base import batch_size_of
from lit_zodp.errors import check_positive_int, raise_if_any
from lit_zodp.per_example import ClippedSum
from lit_zodp.per_example.transforms import Recentring
from lit_zodp.privacy import clipped_fraction


class DOPESGD(PublicBatches, DPSGD):
    """DOPE-SGD (recentred clipping), the PAZO paper's FO+PUB baseline.

    Each step t:
      g_pub = grad f(x_t; B') on the public batch (backprop on public data only);
      g = (sum_i clip_C(grad f(x_t; xi_i) - g_pub) + N(0, sigma^2 C^2 I)) / B + g_pub   (B the expected size);
      x_{t+1} = SGD step on g.
    The recentring is the per-example engine's transform (materialised per-example gradients: ``grad_mode`` "hooks"
    or "vmap").
    """

    non_private_twin = "NonPrivateDOPESGD"

    def __init__(self, backbone: nn.Module, **kwargs: Any) -> None:
        mode = kwargs.get("grad_mode", "hooks")
        raise_if_any([None if mode in ("hooks", "vmap") else
                      f"DOPE-SGD recentres materialised per-example gradients: expected `grad_mode` 'hooks' or 'vmap', "
                      f"but got {mode!r}"])
        super().__init__(backbone, **kwargs)
        self.engine.transform = Recentring()

    def recentred_gradient(self, center: list[Tensor], inputs, targets) -> ClippedSum:
        """``sum_i clip_C(g_i - g_pub)``. Without clipping and noise (the twin's default) the engine forms the plain
        batch sum, recentred here: ``sum_i g_i - n g_pub``."""
        self.engine.transform.centers = dict(zip(self.engine.names, center))
        clipped = self.private_gradient(inputs, targets)
        if self.privacy.is_private or not math.isinf(self.clip):
            return clipped
        grads = [g - clipped.batch_size * c.to(g.dtype) for g, c in zip(clipped.grads, center)]
        return ClippedSum(grads, clipped.norms, clipped.batch_size)

    def training_step(self, batch, batch_idx: int) -> None:
        inputs, targets = self.private_batch(batch)
        size = batch_size_of(inputs)
        (public,) = self.public_batches(batch)
        center = self.finite_public_gradient(public, self.engine.params)                      # g_pub
        clipped = self.recentred_gradient(center, inputs, targets)                        # sum_i clip_C(g_i - g_pub)
        released = self.release_gradient(clipped)                                          # (. + N) / B
        self.apply_gradient([r + c.to(r.dtype) for r, c in zip(released, center)])        # + g_pub, SGD step
        self.log_step(size, lambda: clipped_fraction(clipped.norms, self.clip))


class DPMD(PublicBatches, DPSGD):
    """DPMD (PDA-DPMD, Amid et al. 2022), the PAZO paper's FO+PUB baseline.

    Each step t (of T):
      g~ = (sum_i clip_C(grad f(x_t; xi_i)) + N(0, sigma^2 C^2 I)) / B    (DP-SGD's release);
      g_pub = grad f(x_t; B') on the public batch;
      g = a_t g~ + (1 - a_t) g_pub,  a_t = cos(pi t / (2 T));   x_{t+1} = SGD step on g.

    Args (besides :class:`~lit_zodp.algorithms.DPSGD`'s):
        total_steps: ``T``; ``None``: the Trainer's ``max_steps``, else its estimated stepping batches.
    """

    non_private_twin = "NonPrivateDPMD"

    def __init__(self, backbone: nn.Module, *, total_steps: Optional[int] = None, **kwargs: Any) -> None:
        raise_if_any([None if total_steps is None else check_positive_int("total_steps", total_steps)])
        super().__init__(backbone, **kwargs)
        self.total_steps = total_steps

    def private_weight(self, step: int) -> float:
        """``a_t = cos(pi t / (2 T))``: 1 at the start, 0 at step T (clamped there after it)."""
        return math.cos(math.pi * min(step, self.run_steps()) / (2 * self.run_steps()))

    def run_steps(self) -> int:
        """``T``: ``total_steps``, else the fit's steps."""
        return self.total_steps if self.total_steps is not None else max(fit_steps(self.trainer), 1)

    def training_step(self, batch, batch_idx: int) -> None:
        inputs, targets = self.private_batch(batch)
        size = batch_size_of(inputs)
        (public,) = self.public_batches(batch)
        public_gradient = self.finite_public_gradient(public, self.engine.params)                # g_pub
        clipped = self.private_gradient(inputs, targets)                                    # sum_i clip_C(g_i)
        released = self.release_gradient(clipped)                                          # g~ = (. + N) / B
        a = self.private_weight(self.global_step)
        self.apply_gradient([a * r + (1 - a) * g.to(r.dtype) for r, g in zip(released, public_gradient)])
        self.log_step(size, lambda: clipped_fraction(clipped.norms, self.clip), private_weight=a)


class NonPrivateDOPESGD(DOPESGD):
    """DOPE-SGD's step without privacy (``clip = inf`` by default: plain SGD on the private batch, recentred and
    shifted back by the public gradient)."""

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, **kwargs)


class NonPrivateDPMD(DPMD):
    """DPMD's step without privacy (``clip = inf`` by default): the mean private gradient mixed with the public one."""

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, **kwargs)


__all__ = ["DOPESGD", "DPMD", "NonPrivateDOPESGD", "NonPrivateDPMD"]
