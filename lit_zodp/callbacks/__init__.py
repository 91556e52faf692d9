"""Callbacks: privacy spend logging; stopping the ranks of a failed DDP fit; an auditor's reading of the releases."""

from lit_zodp.callbacks.audit import CanaryAudit
from lit_zodp.callbacks.privacy import PrivacySpendCallback
from lit_zodp.callbacks.ranks import StopRanksOnError

__all__ = ["CanaryAudit", "PrivacySpendCallback", "StopRanksOnError"]
