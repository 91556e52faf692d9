"""The privacy ledger: a run-length record of (mechanism, count), composed by an accountant.

``accountant="prv"`` (default): prv-accountant; epsilon decisions use its UPPER bound (it returns
lower, estimate, upper). The discretised accountant is cached and rebuilt with doubled capacity when
counts outgrow it, so asking for epsilon every step stays cheap; the process keeps the last few built, shared by
every ledger asking for the same mechanisms, capacities and errors (:func:`_build_accountant`).

``accountant="rdp"``: Renyi DP of the subsampled Gaussian (Mironov et al. 2019) converted to
(epsilon, delta) as Opacus's ``RDPAccountant`` does, with its default orders: what the papers'
reference code (DPZero's, via Opacus) reports, offered to reproduce their runs. RDP is looser than
PRV: at the same sigma it reports a larger epsilon.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
from prv_accountant import PRVAccountant

from lit_zodp.errors import AccountingError, check_choice, check_delta, check_positive, raise_if_any
from lit_zodp.privacy.mechanisms import Mechanism, accounted_count, mechanism_from_dict, mechanism_to_dict


@dataclass(frozen=True)
class EpsilonBounds:
    lower: float
    estimate: float
    upper: float


class PrivacyLedger:
    """Composes heterogeneous mechanisms; ``epsilon(delta)`` is their (epsilon, delta)-DP cost.

    Args:
        eps_error: the accountant's allowed error in epsilon (upper - estimate).
        delta_error_ratio: the allowed error in delta, as a fraction of delta.
    """

    def __init__(self, *, eps_error: float = 0.05, delta_error_ratio: float = 1e-3, accountant: str = "prv") -> None:
        raise_if_any([check_positive("eps_error", eps_error),
                      check_positive("delta_error_ratio", delta_error_ratio),
                      check_choice("accountant", accountant, ACCOUNTANTS)])
        self.accountant = accountant
        self.eps_error = eps_error
        self.delta_error_ratio = delta_error_ratio
        self.counts: dict[Mechanism, int] = {}
        self._accountant: Optional[PRVAccountant] = None
        self._accountant_key: Optional[tuple] = None
        self._bounds: dict[tuple, EpsilonBounds] = {}  # memo: composition (and accountant) -> bounds
        self.computations = 0  # accountant evaluations, i.e. memo misses
        self.query_seconds = 0.0  # the last evaluation's time, without building the discretised accountant

    def record(self, mechanism: Mechanism, count: int = 1) -> None:
        if count < 0:
            raise ValueError(f"Expected a count >= 0, but got {count}")
        if count:
            self.counts[mechanism] = self.counts.get(mechanism, 0) + count

    @property
    def total_count(self) -> int:
        return sum(self.counts.values())

    def epsilon(self, delta: float, extra: Iterable[tuple[Mechanism, int]] = ()) -> EpsilonBounds:
        """Bounds on epsilon(delta) of everything recorded, plus ``extra`` planned releases.

        Bounds are memoised by the composition and the accountant that computes them (the PRV
        accountant is deterministic), so the plan's check of the full run at fit start also answers
        the epsilon of its last step, and asking again without new steps is free.
        """
        raise_if_any([check_delta(delta)])
        counts = dict(self.counts)
        for mechanism, count in extra:
            counts[mechanism] = counts.get(mechanism, 0) + count
        counts = {m: accounted_count(m, c) for m, c in counts.items() if c > 0}
        if not counts:
            return EpsilonBounds(0.0, 0.0, 0.0)
        accountant = self._accountant_for(counts, delta) if self.accountant == "prv" else None
        key = (tuple(counts.items()), delta, self.accountant, self._accountant_key if accountant else None)
        if key not in self._bounds:
            self.computations += 1
            start = time.perf_counter()
            if accountant is None:
                epsilon = rdp_epsilon(counts, delta)
                bounds = EpsilonBounds(epsilon, epsilon, epsilon)
            else:
                bounds = compose(counts, delta, accountant, self)
            self.query_seconds = time.perf_counter() - start
            if len(self._bounds) >= MEMO_SIZE:
                del self._bounds[next(iter(self._bounds))]  # the oldest
            self._bounds[key] = bounds
        return self._bounds[key]

    def _accountant_for(self, counts: dict[Mechanism, int], delta: float) -> PRVAccountant:
        """The cached discretised accountant when it covers ``counts``; else one with doubled capacities."""
        mechanisms = tuple(counts)
        errors = (self.eps_error, delta * self.delta_error_ratio)
        key = self._accountant_key
        fits = (key is not None and key[0] == mechanisms and key[2] == errors
                and all(c <= cap for c, cap in zip(counts.values(), key[1])))
        if not fits:
            capacities = tuple(_next_power_of_two(c) for c in counts.values())
            self._accountant = _build_accountant(mechanisms, capacities, *errors)
            self._accountant_key = (mechanisms, capacities, errors)
        return self._accountant

    def state_dict(self) -> dict:
        return {
            "accountant": self.accountant,
            "eps_error": self.eps_error,
            "delta_error_ratio": self.delta_error_ratio,
            "entries": [{"mechanism": mechanism_to_dict(m), "count": c} for m, c in self.counts.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        self.accountant = state.get("accountant", "prv")
        self.eps_error = state["eps_error"]
        self.delta_error_ratio = state["delta_error_ratio"]
        self.counts = {}
        for entry in state["entries"]:
            self.record(mechanism_from_dict(entry["mechanism"]), int(entry["count"]))

    def __repr__(self) -> str:
        items = ", ".join(f"{m} x {c}" for m, c in self.counts.items())
        return f"PrivacyLedger({items})"


ACCOUNTANTS = ("prv", "rdp")
MEMO_SIZE = 64


def rdp_epsilon(counts: dict[Mechanism, int], delta: float) -> float:
    """Epsilon of the composed Gaussian mechanisms under RDP, with Opacus's orders and conversion."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp

    orders = RDPAccountant.DEFAULT_ALPHAS
    total = 0.0
    for mechanism, count in counts.items():
        if not hasattr(mechanism, "noise_multiplier"):
            raise AccountingError(f"The RDP accountant handles Gaussian mechanisms only, not {mechanism}")
        q = getattr(mechanism, "sample_rate", 1.0)
        total = total + np.asarray(rdp.compute_rdp(q=q, noise_multiplier=mechanism.noise_multiplier,
                                                   steps=count, orders=orders))
    epsilon, _ = rdp.get_privacy_spent(orders=orders, rdp=total, delta=delta)
    return float(epsilon)


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


#: How many discretised PRV accountants a process keeps (the most recently built; each holds a few MB of grids).
ACCOUNTANTS_KEPT = 4


@functools.lru_cache(maxsize=ACCOUNTANTS_KEPT)
def _build_accountant(mechanisms: tuple[Mechanism, ...], capacities: tuple[int, ...],
                      eps_error: float, delta_error: float) -> PRVAccountant:
    """The discretised accountant of ``mechanisms`` up to ``capacities`` compositions, shared by every ledger of the
    process that asks for the same ones: it is a function of these public settings alone, and answering a query
    changes nothing in it. So the plan's check of the full run at fit start reuses the one the calibration built at
    the calibrated sigma, and a second fit or a resume of one configuration builds none (each build computes RDP
    bounds over a grid of orders and discretises every mechanism: 0.1-1 s). A refusal is raised, not stored."""
    try:
        return PRVAccountant(prvs=[m.to_prv() for m in mechanisms], max_self_compositions=list(capacities),
                             eps_error=eps_error, delta_error=delta_error)
    except (ValueError, RuntimeError, OverflowError, FloatingPointError, MemoryError) as err:
        raise AccountingError(_extreme_message(mechanisms, capacities, err)) from err


def compose(counts: dict[Mechanism, int], delta: float, accountant: PRVAccountant,
            ledger: PrivacyLedger) -> EpsilonBounds:
    try:
        lower, estimate, upper = accountant.compute_epsilon(
            delta=delta, num_self_compositions=list(counts.values()))
    except (ValueError, RuntimeError, OverflowError, FloatingPointError, MemoryError) as err:
        raise AccountingError(_extreme_message(list(counts), list(counts.values()), err)) from err
    return EpsilonBounds(max(0.0, float(lower)), max(0.0, float(estimate)), float(upper))


def _extreme_message(mechanisms, counts, err: Exception) -> str:
    parts = ", ".join(f"{m} x {c}" for m, c in zip(mechanisms, counts))
    return (f"The PRV accountant could not compute epsilon for [{parts}]: {err}. This happens at "
            "extreme settings (very small noise multiplier, very small delta, or epsilon beyond "
            "~100); use more noise, fewer steps or a larger delta.")
