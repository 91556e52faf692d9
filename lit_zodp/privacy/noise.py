"""Gaussian noise from its own secret generator, and the privatized mean it produces.

The noise generator is seeded from OS entropy unless a test passes ``seed``; it is never derived
from the run seed (the perturbation directions are public, the noise is secret). Under DDP only
rank 0 draws noise, so the all-reduced sum carries exactly one draw.

Note: torch's generators are Mersenne-Twister/Philox, not cryptographically secure PRNGs; the
secrecy here is that of the seed.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from lit_zodp.privacy.errors import (
    PrivacyConfigError,
    check_non_negative,
    check_positive,
    raise_if_any,
)
from lit_zodp.privacy.sampling import entropy_seed


class NoiseSource:
    """A dedicated generator of DP noise, one per device, seeded once."""

    def __init__(self, seed: Optional[int] = None) -> None:
        self.seeded_by_user = seed is not None
        self.seed = entropy_seed() if seed is None else int(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._pending_states: dict[str, Tensor] = {}

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        key = str(torch.device(device))
        if key not in self._generators:
            gen = torch.Generator(device=key).manual_seed(self.seed + len(self._generators))
            if key in self._pending_states:
                gen.set_state(self._pending_states.pop(key))
            self._generators[key] = gen
        return self._generators[key]

    def gaussian(self, shape, std: float, *, device="cpu", dtype=torch.float32) -> Tensor:
        """A draw of ``N(0, std^2)`` with the given shape."""
        raise_if_any([check_non_negative("noise std", std)])
        noise = torch.randn(shape, generator=self.generator(device), device=device, dtype=dtype)
        return noise * std

    def state_dict(self) -> dict:
        states = {k: g.get_state() for k, g in self._generators.items()}
        return {"seed": self.seed, "states": {**self._pending_states, **states}}

    def load_state_dict(self, state: dict) -> None:
        self.seed = int(state["seed"])
        self._generators.clear()
        self._pending_states = dict(state["states"])


def noised_sum(
    clipped_sum: Tensor,
    *,
    noise_multiplier: float,
    clip: float,
    noise: Optional[NoiseSource],
    add_noise: bool = True,
) -> Tensor:
    """``sum_i clip(v_i) + N(0, (sigma C)^2 I)``: the Gaussian mechanism on a sum of sensitivity C.

    ``add_noise=False`` is for DDP ranks other than 0: rank 0 adds the single draw before the
    all-reduce, so the reduced sum carries exactly one.
    """
    raise_if_any([check_non_negative("noise_multiplier", noise_multiplier)])
    if not add_noise or noise_multiplier == 0:
        return clipped_sum
    if math.isinf(clip):
        raise PrivacyConfigError("Noise needs a finite `clip`; got clip=inf with noise_multiplier > 0")
    if noise is None:
        raise ValueError("A NoiseSource is required when noise_multiplier > 0")
    std = noise_multiplier * clip
    return clipped_sum + noise.gaussian(clipped_sum.shape, std, device=clipped_sum.device,
                                        dtype=clipped_sum.dtype)


def noisy_mean(clipped_sum: Tensor, *, expected_batch_size: float, **noise_kwargs) -> Tensor:
    """``(sum_i clip(v_i) + N(0, (sigma C)^2 I)) / B`` with ``B`` the EXPECTED batch size.

    Dividing by the expected size, not the realized one, is what the Poisson-subsampled Gaussian
    accountant assumes (DESIGN.md); dividing by the realized size would leak it.
    """
    raise_if_any([check_positive("expected_batch_size", expected_batch_size)])
    return noised_sum(clipped_sum, **noise_kwargs) / expected_batch_size
