"""Callbacks: privacy spend tracking and the budget stop."""

from lit_zodp.callbacks.privacy import PrivacySpendCallback, steps_within_budget

__all__ = ["PrivacySpendCallback", "steps_within_budget"]
