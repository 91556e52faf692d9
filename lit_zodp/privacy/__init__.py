"""Privacy: the component every private module composes, and the pure pieces it is built from.

clipping, noise (secret, OS entropy), mechanisms, ledger (PRV accountant), calibration, step plans,
sampling descriptions and samplers, and the spend log (every branch of a run, for rollbacks and forks).
"""

from lit_zodp.errors import AccountingError, PrivacyConfigError
from lit_zodp.privacy.calibration import (
    bisect_sigma,
    calibrate_noise_multiplier,
    dpzero_theory_sigma,
    steps_within_budget,
)
from lit_zodp.privacy.clipping import clip_factors, clip_scalars, clip_vectors, clipped_fraction, clipped_sum
from lit_zodp.privacy.component import DirectionRelease, NonPrivate, PrivacyComponent
from lit_zodp.privacy.ledger import EpsilonBounds, PrivacyLedger
from lit_zodp.privacy.mechanisms import Gaussian, Laplace, Mechanism, SinglePassGaussian, SubsampledGaussian
from lit_zodp.privacy.noise import NoiseSource, SecretGaussianVector, secret_seed
from lit_zodp.privacy.plan import GaussianRelease, StepPlan, composed_multiplier
from lit_zodp.privacy.sampling import (
    FullBatchSampler,
    FullBatchSampling,
    PoissonBatchSampler,
    PoissonSampling,
    PrivateBatchSampler,
    ShuffleBatchSampler,
    ShuffledSampling,
    SinglePassBatchSampler,
    SinglePassSampling,
)
from lit_zodp.privacy.spend_log import SPEND_DIR_ENV, SpendLog
from lit_zodp.privacy.tree import TreeAggregator, dyadic_nodes, releases_per_leaf

__all__ = [
    "AccountingError",
    "DirectionRelease",
    "EpsilonBounds",
    "FullBatchSampler",
    "FullBatchSampling",
    "Gaussian",
    "GaussianRelease",
    "Laplace",
    "Mechanism",
    "NoiseSource",
    "NonPrivate",
    "PoissonBatchSampler",
    "PoissonSampling",
    "PrivacyComponent",
    "PrivacyConfigError",
    "PrivacyLedger",
    "PrivateBatchSampler",
    "SecretGaussianVector",
    "ShuffleBatchSampler",
    "ShuffledSampling",
    "SinglePassBatchSampler",
    "SinglePassGaussian",
    "SinglePassSampling",
    "SPEND_DIR_ENV",
    "SpendLog",
    "StepPlan",
    "SubsampledGaussian",
    "TreeAggregator",
    "bisect_sigma",
    "calibrate_noise_multiplier",
    "clip_factors",
    "clip_scalars",
    "clipped_sum",
    "clip_vectors",
    "clipped_fraction",
    "composed_multiplier",
    "dpzero_theory_sigma",
    "dyadic_nodes",
    "releases_per_leaf",
    "secret_seed",
    "steps_within_budget",
]
