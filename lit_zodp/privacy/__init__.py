"""Pure, separately tested privacy pieces: clipping, noise, mechanisms, ledger, calibration, sampling."""

from lit_zodp.privacy.calibration import bisect_sigma, calibrate_noise_multiplier, dpzero_theory_sigma
from lit_zodp.privacy.clipping import clip_factors, clip_scalars, clip_vectors, clipped_fraction
from lit_zodp.privacy.errors import AccountingError, PrivacyConfigError
from lit_zodp.privacy.ledger import EpsilonBounds, PrivacyLedger
from lit_zodp.privacy.mechanisms import Gaussian, Laplace, Mechanism, SubsampledGaussian
from lit_zodp.privacy.noise import NoiseSource, noised_sum, noisy_mean
from lit_zodp.privacy.sampling import PoissonBatchSampler, entropy_seed

__all__ = [
    "AccountingError",
    "EpsilonBounds",
    "Gaussian",
    "Laplace",
    "Mechanism",
    "NoiseSource",
    "PoissonBatchSampler",
    "PrivacyConfigError",
    "PrivacyLedger",
    "SubsampledGaussian",
    "bisect_sigma",
    "calibrate_noise_multiplier",
    "clip_factors",
    "clip_scalars",
    "clip_vectors",
    "clipped_fraction",
    "dpzero_theory_sigma",
    "entropy_seed",
    "noised_sum",
    "noisy_mean",
]
