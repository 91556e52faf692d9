"""The zeroth-order engine: seeded in-place perturbations, direction laws and the ZO optimizer."""

from lit_zodp.zo.directions import GaussianDirections, SphereDirections, make_direction_law, parameter_chunks
from lit_zodp.zo.estimators import central_differences, second_differences
from lit_zodp.zo.optimizer import ZOSGD
from lit_zodp.zo.perturbation import PerturbationEngine
from lit_zodp.zo.seeds import derive_seed

__all__ = [
    "GaussianDirections",
    "PerturbationEngine",
    "SphereDirections",
    "ZOSGD",
    "central_differences",
    "derive_seed",
    "make_direction_law",
    "parameter_chunks",
    "second_differences",
]
