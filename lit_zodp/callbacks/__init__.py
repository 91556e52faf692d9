"""Callbacks: privacy spend logging."""

from lit_zodp.callbacks.privacy import PrivacySpendCallback

__all__ = ["PrivacySpendCallback"]
