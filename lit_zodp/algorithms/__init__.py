"""One module per paper family; each ``training_step`` reads like the paper's pseudo-code."""

from lit_zodp.algorithms.base import PrivateZerothOrderModule, ZerothOrderModule
from lit_zodp.algorithms.dpzero import DPGD0th, DPZero, MeZO

__all__ = ["DPGD0th", "DPZero", "MeZO", "PrivateZerothOrderModule", "ZerothOrderModule"]
