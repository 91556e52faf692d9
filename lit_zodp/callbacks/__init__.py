"""Callbacks: privacy spend logging; stopping the ranks of a failed DDP fit; an auditor's reading of the releases; a
public warm start."""

from lit_zodp.callbacks.audit import CanaryAudit
from lit_zodp.callbacks.privacy import PrivacySpendCallback
from lit_zodp.callbacks.ranks import StopRanksOnError
from lit_zodp.callbacks.warm_start import PublicWarmStart

__all__ = ["CanaryAudit", "PrivacySpendCallback", "PublicWarmStart", "StopRanksOnError"]
