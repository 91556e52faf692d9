"""The mechanisms a training run composes, as hashable records the ledger can group and save.

Each maps to one prv-accountant privacy random variable. Sensitivities are normalised: a Gaussian
mechanism with noise ``sigma * Delta`` on a quantity of L2 sensitivity ``Delta`` has
``noise_multiplier = sigma``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar, Union

from prv_accountant import GaussianMechanism, LaplaceMechanism, PoissonSubsampledGaussianMechanism

from lit_zodp.errors import check_positive, check_probability, raise_if_any


@dataclass(frozen=True)
class SubsampledGaussian:
    """Gaussian noise on a clipped sum over a Poisson sample of rate ``sample_rate``."""

    noise_multiplier: float
    sample_rate: float
    kind: ClassVar[str] = "subsampled_gaussian"

    def __post_init__(self) -> None:
        raise_if_any([check_positive("noise_multiplier", self.noise_multiplier),
                      check_probability("sample_rate", self.sample_rate)])

    def to_prv(self):
        if self.sample_rate == 1.0:
            return GaussianMechanism(noise_multiplier=self.noise_multiplier)
        return PoissonSubsampledGaussianMechanism(sampling_probability=self.sample_rate,
                                                  noise_multiplier=self.noise_multiplier)


@dataclass(frozen=True)
class Gaussian:
    """Gaussian noise on a full-data quantity (no subsampling)."""

    noise_multiplier: float
    kind: ClassVar[str] = "gaussian"

    def __post_init__(self) -> None:
        raise_if_any([check_positive("noise_multiplier", self.noise_multiplier)])

    def to_prv(self):
        return GaussianMechanism(noise_multiplier=self.noise_multiplier)


@dataclass(frozen=True)
class SinglePassGaussian:
    """Gaussian noise on a sum over a batch of a single pass: each example is in one step only.

    The steps touch disjoint data, so they compose in parallel (the maximum, not the sum): the
    ledger counts this mechanism once however many steps record it.
    """

    noise_multiplier: float
    kind: ClassVar[str] = "single_pass_gaussian"
    composes_in_parallel: ClassVar[bool] = True

    def __post_init__(self) -> None:
        raise_if_any([check_positive("noise_multiplier", self.noise_multiplier)])

    def to_prv(self):
        return GaussianMechanism(noise_multiplier=self.noise_multiplier)


@dataclass(frozen=True)
class Laplace:
    """Laplace noise of scale ``b`` on a quantity of L1 sensitivity ``Delta``: ``mu = Delta / b``."""

    mu: float
    kind: ClassVar[str] = "laplace"

    def __post_init__(self) -> None:
        raise_if_any([check_positive("mu", self.mu)])

    def to_prv(self):
        return LaplaceMechanism(mu=self.mu)


Mechanism = Union[SubsampledGaussian, Gaussian, SinglePassGaussian, Laplace]
MECHANISMS = {cls.kind: cls for cls in (SubsampledGaussian, Gaussian, SinglePassGaussian, Laplace)}


def accounted_count(mechanism: Mechanism, count: int) -> int:
    """How many self-compositions ``count`` recorded steps cost: 1 for parallel (single-pass) steps."""
    return min(count, 1) if getattr(mechanism, "composes_in_parallel", False) else count


def mechanism_to_dict(mechanism: Mechanism) -> dict:
    return {"kind": mechanism.kind, **asdict(mechanism)}


def mechanism_from_dict(state: dict) -> Mechanism:
    params = dict(state)
    kind = params.pop("kind")
    if kind not in MECHANISMS:
        raise ValueError(f"Unknown mechanism kind {kind!r}; expected one of {sorted(MECHANISMS)}")
    return MECHANISMS[kind](**params)
