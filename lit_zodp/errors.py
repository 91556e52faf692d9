"""The package's error and warning classes and the validation vocabulary that builds their messages.

Validation collects every problem before raising, so a bad config is fixed in one round:
each helper returns ``None`` when the value is fine, or a message naming the bad value. One
problem gives a one-line message; several give one line each.
"""

from __future__ import annotations

import math
import warnings
from typing import Iterable, Optional


class LitZodpWarning(UserWarning):
    """A warning of this package, about the user's configuration, data or run: shown as one line,
    ``lit-zodp: warning: ...``, like its errors (Python's format adds the file and source line that
    warned, which say nothing to a user)."""


def _one_line_warnings(previous):
    def format_warning(message, category, filename, lineno, line=None):
        if isinstance(category, type) and issubclass(category, LitZodpWarning):
            return f"lit-zodp: warning: {message}\n"
        return previous(message, category, filename, lineno, line)
    return format_warning


warnings.formatwarning = _one_line_warnings(warnings.formatwarning)  # as Lightning formats its own


class ConfigError(ValueError):
    """A configuration a run cannot start from: a bad option value, a model that cannot be loaded, a
    model that does not fit the data. The CLI prints it as one line naming the option (exit code 2)."""


class PrivacyConfigError(ConfigError):
    """A privacy or training setting that cannot give the claimed guarantee."""


class AccountingError(PrivacyConfigError):
    """The accountant could not compute epsilon or calibrate sigma for these settings.

    A configuration error too: raised before the first step, it means the requested privacy
    (sigma or epsilon) is outside what the accountant can certify.
    """


def raise_if_any(errors: Iterable[Optional[str]]) -> None:
    """Raise one ``PrivacyConfigError`` listing every non-empty message."""
    messages = [e for e in errors if e]
    if len(messages) == 1:
        raise PrivacyConfigError(f"Invalid configuration: {messages[0]}")
    if messages:
        raise PrivacyConfigError("Invalid configuration:\n  - " + "\n  - ".join(messages))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive(name: str, value, *, allow_inf: bool = False) -> Optional[str]:
    kind = "a positive float" + (" (or inf: `.inf` in YAML)" if allow_inf else "")
    if not _is_number(value) or math.isnan(value) or value <= 0:
        return f"Expected `{name}` to be {kind}, but got {value!r}"
    if math.isinf(value) and not allow_inf:
        return f"Expected `{name}` to be finite, but got {value!r}"
    return None


def check_finite(name: str, value) -> Optional[str]:
    if not _is_number(value) or not math.isfinite(value):
        return f"Expected `{name}` to be a finite float, but got {value!r}"
    return None


def check_non_negative(name: str, value) -> Optional[str]:
    if not _is_number(value) or math.isnan(value) or value < 0 or math.isinf(value):
        return f"Expected `{name}` to be a finite float >= 0, but got {value!r}"
    return None


def check_positive_int(name: str, value) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return f"Expected `{name}` to be a positive int, but got {value!r}"
    return None


def check_bool(name: str, value) -> Optional[str]:
    """``value`` a bool (``True``/``False``, not 0/1 or a string)."""
    return None if isinstance(value, bool) else f"Expected `{name}` to be a bool, but got {value!r}"


def check_choice(name: str, value, choices) -> Optional[str]:
    """``value`` one of ``choices`` (a tuple, or a dict's keys)."""
    return None if value in choices else f"Expected `{name}` in {list(choices)}, but got {value!r}"


def check_probability(name: str, value) -> Optional[str]:
    """A sampling rate: in (0, 1]."""
    if not _is_number(value) or math.isnan(value) or not 0 < value <= 1:
        return f"Expected `{name}` in (0, 1], but got {value!r}"
    return None


def check_delta(value) -> Optional[str]:
    if not _is_number(value) or math.isnan(value) or not 0 < value < 1:
        return f"Expected `delta` in (0, 1), but got {value!r}"
    return None


def check_rank(rank, world_size) -> Optional[str]:
    """A DDP rank: an int in ``[0, world_size)``."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        return f"Expected `rank` in [0, {world_size}), but got {rank!r}"
    return None
