"""Callbacks: privacy spend logging; stopping the ranks of a failed DDP fit."""

from lit_zodp.callbacks.privacy import PrivacySpendCallback
from lit_zodp.callbacks.ranks import StopRanksOnError

__all__ = ["PrivacySpendCallback", "StopRanksOnError"]
