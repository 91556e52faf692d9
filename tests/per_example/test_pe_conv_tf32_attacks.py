"""Red-team review 64 (2026-11-30): attacks by one crafted record on the batch-independence check, found against
e7bc614 (the checks' tolerances under cuDNN's TF32 convolutions), all fixed.

The model has a detached batch statistic (``h + alpha * h.mean(0).detach()``, one of the forward mixings that check
exists for): a record ``z`` moves every batch-mate's features by ``alpha h_z / B``, hence their gradients of the last
layer (``(p_i - y_i) h_i^T``), and after clipping one removal changes the released sum by up to ``~2 (B - 1) C``.

* e7bc614 widened ``rounding.working_eps`` to TF32's product error (``sqrt(eps)`` 0.044 instead of 3.5e-4) in every
  check of a model holding a convolution, the batch-independence check included: a mixing of ``alpha = 1e-2`` passed
  and one removal moved the released sum by 4.5 C. That check compares the model's arithmetic with itself, so it no
  longer takes the widening (``checks.rows_differ``).
* Pre-existing: ``rows_differ``'s tolerance added ``sqrt(eps)`` times the *mean* row norm, which one record with huge
  outputs inflated for every row: ``alpha = 3e-5`` released 4.5 C under IEEE float32. It takes the (lower) median.
* Pre-existing: only the engine module's *outputs* were compared, while the per-example gradients come from inner
  rows: a record whose features lie near the null space of ``fc`` (``||W h|| / ||h||`` 2e-4, found from the weights)
  moved the outputs 5000 times less than the features (1.024 C under IEEE with the median; 1.05 C at 7e-5, 20,000
  optimiser steps). The rule layers' inputs are compared too (``engine._rule_inputs``), each on its own scale.

Emulated TF32 convolutions on the CPU as in ``tests/backbones/test_nfresnet.py``. Mixing below the checks' rounding
tolerance stays undetectable: 1 + 1.4e-4 C at ``alpha = 3e-5`` with the null-space record times 100 (open).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_zodp.errors import PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine, rounding
from tests.backbones.test_nfresnet import _TF32Conv2d

CLIP = 1.0
BATCH = 16


class BatchShiftedConvNet(nn.Module):
    """A small conv net with a detached batch statistic added to its features (``alpha`` of the batch mean)."""

    def __init__(self, alpha: float):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 2)
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x)).flatten(1)
        return self.fc(h + self.alpha * h.mean(0, keepdim=True).detach())


def _problem(alpha: float):
    """Float32 throughout (this folder's default dtype is float64, whose tolerance TF32 does not widen)."""
    torch.manual_seed(0)
    model = BatchShiftedConvNet(alpha).float()
    x, y = torch.randn(BATCH - 1, 1, 8, 8, dtype=torch.float32), torch.randint(0, 2, (BATCH - 1,))
    return model, x, y


def _null_space_record(model: BatchShiftedConvNet, target: float = 0.0) -> torch.Tensor:
    """An input whose features ``h = relu(conv(d))`` lie almost in the null space of ``fc`` (the attacker knows the
    weights): ``||W h|| / ||h||`` about 2e-4, or just below ``target``."""
    generator = torch.Generator().manual_seed(1)
    d = torch.randn(1, 1, 8, 8, generator=generator, dtype=torch.float32).requires_grad_()
    weight, fc = model.conv.weight.detach(), model.fc.weight.detach()
    optimizer = torch.optim.Adam([d], lr=0.05)
    for _ in range(2000):
        h = F.relu(torch.conv2d(d, weight, None, 1, 1)).flatten(1)  # (the bias is negligible at the record's scale)
        ratio = (h @ fc.T).norm() / h.norm()
        if ratio < target:
            break
        optimizer.zero_grad()
        ratio.backward()
        optimizer.step()
    return d.detach()


def _release(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str, keep: bool = False) -> torch.Tensor:
    """The clipped sum of a fresh engine (``keep``: fixed-shape forwards, ``keep_call_shape``), flat. (The harness
    of reviews 64-66.)"""
    engine = PerExampleGradientEngine(model, mode=mode)
    engine.keep_call_shape = keep
    clipped = engine.clipped_sum(lambda: F.cross_entropy(model(x), y, reduction="none"), CLIP)
    return torch.cat([g.flatten() for g in clipped.grads])


def _removal_difference(model, x, y, record, mode, label: int = 0, keep: bool = False) -> float:
    """``||S(D) - S(D')|| / C`` for ``D`` the honest batch with ``record`` (labelled ``label``) and ``D'`` without
    it, each a first batch of its structure (every check runs on it); ``inf`` never: a refusal raises."""
    with_record = _release(model, torch.cat([x, record]), torch.cat([y, torch.tensor([label], dtype=y.dtype)]), mode,
                           keep)
    without = _release(model, x, y, mode, keep)
    return float((with_record - without).norm()) / CLIP


@pytest.fixture
def emulated_tf32_convs(monkeypatch):
    """cuDNN's TF32 convolutions (torch's default on CUDA), emulated; the setting itself is set by each test."""
    monkeypatch.setattr(F, "conv2d", lambda x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1:
                        _TF32Conv2d.apply(x, weight, bias, stride, padding, dilation, groups))


def _random_record() -> torch.Tensor:
    return torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float32)


def _released_or_refused(model, x, y, record, mode, label: int = 0, keep: bool = False) -> float:
    """``||S(D) - S(D')|| / C``, or 0 where the engine refuses (safe)."""
    try:
        return _removal_difference(model, x, y, record, mode, label, keep)
    except PrivacyConfigError:
        return 0.0


MODES = ["hooks", "ghost", "bookkeeping"]


@pytest.mark.parametrize("mode", MODES)
def test_tf32_convolutions_do_not_widen_the_batch_mixing_check(emulated_tf32_convs, monkeypatch, mode):
    """e7bc614 with the mean row norm: IEEE refused this model (on honest batches too) and the record; TF32 admitted
    both, and one removal moved the released sum by 4.5 C (B = 16). Refused under both now."""
    model, x, y = _problem(alpha=1e-2)
    record = _random_record() * 1e5
    monkeypatch.setattr(rounding, "float32_conv_setting", lambda device_type: "ieee")
    with pytest.raises(PrivacyConfigError, match="batch-mates"):
        _removal_difference(model, x, y, record, mode)
    monkeypatch.setattr(rounding, "float32_conv_setting", lambda device_type: "tf32")
    released = _released_or_refused(model, x, y, record, mode)
    assert released <= CLIP * (1 + 1e-3), f"one removal changed the released sum by {released:.3f} C"


@pytest.mark.parametrize("mode", MODES)
def test_under_tf32_convolutions_a_null_space_record_is_refused(emulated_tf32_convs, monkeypatch, mode):
    """e7bc614 alone: a model whose honest batches pass both tolerances (``alpha = 3e-5``) and a record crafted from
    the weights released 3.0 C under TF32 (with the median row norm too)."""
    model, x, y = _problem(alpha=3e-5)
    record = _null_space_record(model) * 1e6
    monkeypatch.setattr(rounding, "float32_conv_setting", lambda device_type: "tf32")
    assert _removal_difference(model, x, y, torch.zeros_like(record), mode) <= CLIP * (1 + 1e-3)  # honest: passes
    released = _released_or_refused(model, x, y, record, mode)
    assert released <= CLIP * (1 + 1e-3), f"one removal changed the released sum by {released:.3f} C"


@pytest.mark.parametrize("mode", MODES)
def test_one_huge_record_no_longer_widens_every_rows_tolerance(mode):
    """Pre-existing (IEEE float32, no TF32): the record's own output row inflated the mean row norm of
    ``rows_differ``'s tolerance: 4.5 C released at ``alpha = 3e-5``, which honest batches pass."""
    model, x, y = _problem(alpha=3e-5)
    honest = torch.zeros(1, 1, 8, 8, dtype=torch.float32)
    assert _removal_difference(model, x, y, honest, mode) <= CLIP * (1 + 1e-3)  # honest batches pass
    released = _released_or_refused(model, x, y, _random_record() * 3e7, mode)
    assert released <= CLIP * (1 + 1e-3), f"one removal changed the released sum by {released:.3f} C"


@pytest.mark.parametrize("mode", MODES)
def test_a_record_that_moves_the_features_but_not_the_outputs_is_refused(mode):
    """Pre-existing (IEEE float32, the median row norm): the null-space record moves the outputs within rounding and
    every batch-mate's features by its full size; the module's outputs alone passed it (1.024 C released here). The
    rule layers' inputs are compared on the halves too."""
    model, x, y = _problem(alpha=1e-4)
    honest = torch.zeros(1, 1, 8, 8, dtype=torch.float32)
    assert _removal_difference(model, x, y, honest, mode) <= CLIP * (1 + 1e-3)  # honest batches pass
    released = _released_or_refused(model, x, y, _null_space_record(model) * 1e3, mode)
    assert released <= CLIP * (1 + 1e-3), f"one removal changed the released sum by {released:.3f} C"
