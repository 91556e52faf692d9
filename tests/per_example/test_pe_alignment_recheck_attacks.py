"""Red-team review 69 (2026-11-30): attacks on the alignment check's recheck of failing rows (``alignment``, 8831465).
Open (strict ``xfail``), pre-existing (45962bd, before the recheck, releases it too): a backward that gives every
batch-mate's row a small share of one flagged example's output gradient, each share inside that row's own tolerance
(``2 sqrt(eps) |w_r| ||G_1[r]||``), adds up over the batch, and the gradient halves (:mod:`.gradient_halves`) stay
under their tolerance: 1.013 C released at ``B = 128`` in float32 (every mode; the halves at 0.42 of their
tolerance), 1.97 C at ``B = 64`` under the TF32 matmul setting (emulated: the tolerances of
``torch.set_float32_matmul_precision("high")`` on CUDA, ``eps = 2^-9``), and 3.9 C at ``B = 64`` under
``torch.set_float32_matmul_precision("medium")`` on this CPU (real: oneDNN's bfloat16 operands, ``eps = 2^-6``;
45962bd: 4.2 C, and 1.013 C in float32 at ``B = 64``, in float32-default runs). Found in the recheck itself, fixed
by the lead after the review: at shares of ``1.2-1.5 sqrt(eps)`` of each row, the rows that fail the first comparison
(at most 8) passed their recheck, and the same draw released 1.0031 C (float32, ``B = 16``) or 1.57 C (TF32, ``B =
16``) where without the recheck (``ROW_RECHECKS = 0``) the ``Linear`` is recomputed (1.0 C). The recheck's own part
scales exactly (a power of two), so its tolerance is now ``2 eps |w_r| ||G_1[r]||``, not ``2 sqrt(eps) ...``: those
rows stay failed.

Why: the recheck passes a share ``c`` of a row whenever ``|w_i - w_r| ||c|| <= 2 sqrt(eps) |w_r| ||row||`` with
``|w_r| = 4`` and ``|w_i - w_r|`` in ``[2, 6]``: every share up to ``1.33 sqrt(eps)`` of its row (the estimate's
``chi2_8`` aside), where the first comparison (``|w_r|`` in ``[1, 2)``, ``|w_i - w_r|`` up to 4) passes every share
only up to ``0.5-0.67 sqrt(eps)``. Per row that is rounding's size, as documented; but here the honest examples are
unclipped (norms just below ``C``) and share a common input feature with the record, so each share moves its
example's clipped gradient along the record's own, and ``B`` of them add up to about ``B rho sqrt(eps) C`` on top of
the record's ``C``. The gradient halves' unit ``u = min(sqrt(eps), 256 eps)`` is ``sqrt(eps)`` itself from TF32 on,
against norms' terms of about ``4 B C``. No fix here: the per-row tolerance is the documented rounding allowance,
and bounding the sum over rows is a design change (a tolerance on the sum of the rows' shares, or the halves' unit).

The model is user code of the style of ``test_pe_folded_attacks._GradientMixing`` (the forward unchanged, the
backward mixing rows: ``k + s (k - k.detach())``), gated on a flagged example (an input norm above 5, which only the
record has), so the batch without the record is not mixed: the difference is the record's alone. Tried and not
breaking (report of review 69): more than 8 failing rows (not rechecked, recomputed: safe), shares far above the
tolerance (found, then the fallback's sum check refuses), the rescue of a share at ``16 sqrt(eps)`` (never, in 200
seeded draws: the last test).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_zodp.errors import PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine, alignment, rounding

WIDTH = 32
MODES = ["hooks", "ghost", "bookkeeping"]
#: ``sqrt(eps)`` of the check's tolerances under each float32 matmul setting (``rounding.working_eps``: IEEE, TF32's
#: and bfloat16 operands' product errors).
SQRT_EPS = {"ieee": math.sqrt(2.0 ** -23), "tf32": math.sqrt(2 * 2.0 ** -10 + 2.0 ** -20),
            "medium": math.sqrt(2 * 2.0 ** -7 + 2.0 ** -14)}
FLOAT32_SQRT_EPS = SQRT_EPS["ieee"]


@pytest.fixture
def matmul_setting(monkeypatch):
    """``setting(name)``: ``"ieee"`` (this CPU's default); ``"tf32"`` emulated (the engine's tolerances of CUDA's TF32
    matmuls, ``set_float32_matmul_precision("high")``; this CPU still computes in IEEE); ``"medium"`` real
    (``set_float32_matmul_precision("medium")``: oneDNN's bfloat16 operands on this CPU), restored after the test."""
    previous = torch.get_float32_matmul_precision()

    def setting(name: str) -> float:
        if name == "tf32":
            monkeypatch.setattr(rounding, "float32_matmul_setting", lambda device_type: "tf32")
        elif name == "medium":
            torch.set_float32_matmul_precision("medium")
            assert rounding.float32_matmul_setting("cpu") == "bf16"
        return SQRT_EPS[name]

    yield setting
    torch.set_float32_matmul_precision(previous)


class FlaggedMixing(nn.Module):
    """A ``Linear`` (no bias) and a head; when the batch's last example is flagged (input norm above 5), its output
    row also reads ``s`` times every row's ``Linear`` output in the backward alone (``k - k.detach()``: the forward
    is unchanged), so each row's output gradient holds ``s`` times the flagged example's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH, bias=False)
        self.head = nn.Linear(WIDTH, 2)
        self.share = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.lin(x)
        if len(k) > 1 and float(x[-1].norm()) > 5:
            k = torch.cat([k[:-1], k[-1:] + self.share * (k - k.detach()).sum(0, keepdim=True)])
        return self.head(k)


def _problem(size: int, rho: float, sqrt_eps: float = FLOAT32_SQRT_EPS):
    """The model, ``size - 1`` honest examples (a common feature of norm 3, labelled as the model predicts them:
    small, unclipped gradients), the record (the feature at norm 9, the other label: flagged, clipped), the clip
    (just above every honest norm) and ``s``: ``rho sqrt(eps)`` of the smallest honest row's output gradient."""
    torch.manual_seed(0)
    model = FlaggedMixing().float()  # (the per-example tests' default dtype is float64)
    feature = torch.randn(WIDTH, dtype=torch.float32)
    feature = feature / feature.norm()
    x = 3.0 * feature + 0.01 * torch.randn(size - 1, WIDTH, dtype=torch.float32)
    with torch.no_grad():
        label = int(model(x[:1]).argmax())
    y = torch.full((size - 1,), label)
    record, record_label = (9.0 * feature)[None], torch.tensor([1 - label])
    norms = []
    for r in range(size - 1):
        model.zero_grad()
        F.cross_entropy(model(x[r:r + 1]), y[r:r + 1]).backward()
        norms.append(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters())))
    model.zero_grad()
    k = model.lin(torch.cat([x, record])).detach().requires_grad_()
    rows, = torch.autograd.grad(F.cross_entropy(model.head(k), torch.cat([y, record_label]), reduction="none").sum(),
                                k)
    rows = rows.norm(dim=1)
    model.share = rho * sqrt_eps * float(rows[:-1].min()) / float(rows[-1])
    return model, (x, y), (torch.cat([x, record]), torch.cat([y, record_label])), 1.05 * max(norms)


def _release(model, batch, mode, clip):
    """The flat clipped sum of a fresh engine, and the parameters it recomputed."""
    x, y = batch
    engine = PerExampleGradientEngine(model, mode=mode)
    clipped = engine.clipped_sum(lambda: F.cross_entropy(model(x), y, reduction="none"), clip)
    return torch.cat([g.flatten() for g in clipped.grads]), sorted(engine.last_recomputed)


def _removal(size: int, rho: float, mode: str, monkeypatch, seed: int, rechecks: int = alignment.ROW_RECHECKS,
             sqrt_eps: float = FLOAT32_SQRT_EPS):
    """``||S(D) - S(D')|| / C`` (0 where refused) and the parameters recomputed with the record, the alignment check's
    draws seeded (``seed``) and at most ``rechecks`` rows rechecked."""
    monkeypatch.setattr(alignment, "ROW_RECHECKS", rechecks)
    monkeypatch.setattr(alignment, "secret_cpu_generator", lambda: torch.Generator().manual_seed(seed))
    model, without, with_record, clip = _problem(size, rho, sqrt_eps)
    try:
        released, recomputed = _release(model, with_record, mode, clip)
        other, _ = _release(model, without, mode, clip)
    except PrivacyConfigError:
        return 0.0, None
    return float((released - other).norm()) / clip, recomputed


def test_the_flagged_model_is_exact_without_its_share(monkeypatch):
    """The control: with ``s = 0`` one removal moves the release by the record's ``C`` (to rounding)."""
    released, recomputed = _removal(128, 0.0, "hooks", monkeypatch, seed=0)
    assert released == pytest.approx(1.0, abs=1e-4) and recomputed == []


@pytest.mark.xfail(strict=True, reason="open (review 69, pre-existing: 45962bd releases it too): shares of one "
                                        "example's output gradient each within its row's alignment tolerance add "
                                        "up over the batch, under the gradient halves' tolerance")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setting, size", [("ieee", 128), ("tf32", 64), ("medium", 64)])
def test_shares_within_each_rows_tolerance_do_not_add_up_over_the_batch(setting, size, mode, matmul_setting,
                                                                          monkeypatch):
    """Shares of ``0.6 sqrt(eps)`` of the smallest honest row (every row passes the first comparison): 1.013 C
    released in float32 (``B = 128``; the gradient halves at 0.42 of their tolerance), 1.97 C under TF32's tolerances
    (``B = 64``), 3.9 C under ``set_float32_matmul_precision("medium")`` (``B = 64``), every mode."""
    released, _ = _removal(size, 0.6, mode, monkeypatch, seed=0, sqrt_eps=matmul_setting(setting))
    assert released <= 1 + 1e-3, f"one removal changed the released sum by {released:.4f} C"


#: (setting, rho, seed of the check's draws) where some rows (at most 8) fail the first comparison and pass their
#: recheck: ``B = 16``.
RESCUED = [("ieee", 1.2, 4), ("tf32", 1.5, 0)]


@pytest.mark.parametrize("setting, rho, seed", RESCUED)
def test_rows_failing_the_first_comparison_are_not_rescued_with_another_examples_share(setting, rho, seed,
                                                                                       matmul_setting, monkeypatch):
    """1.0031 C released in float32, 1.57 C under TF32's tolerances (``B = 16``) at 8831465, whose recheck had the
    first comparison's tolerance ``2 sqrt(eps)``; the recheck's own part scales exactly, so its tolerance is ``2 eps``
    now: the rows stay failed and ``lin`` is recomputed, as without rechecks (the next test)."""
    released, recomputed = _removal(16, rho, "hooks", monkeypatch, seed=seed, sqrt_eps=matmul_setting(setting))
    assert recomputed == ["lin.weight"]
    assert released <= 1 + 1e-3, f"one removal changed the released sum by {released:.4f} C"


@pytest.mark.parametrize("setting, rho, seed", RESCUED)
def test_without_the_recheck_the_same_draw_recomputes_the_mixed_layer(setting, rho, seed, matmul_setting,
                                                                      monkeypatch):
    """The same draws with ``ROW_RECHECKS = 0``: the failing rows stay failed, ``lin`` is recomputed on the whole
    module (the record's row alone), and one removal moves the release by ``C``."""
    released, recomputed = _removal(16, rho, "hooks", monkeypatch, seed=seed, rechecks=0,
                                    sqrt_eps=matmul_setting(setting))
    assert recomputed == ["lin.weight"]
    assert released <= 1 + 1e-3


def _rescued(relative: float, draws: int) -> int:
    """Of ``draws`` seeded rechecks of one failing row (float32, ``[8, 16]``) that also holds example 0's share of
    ``relative`` times the row's norm (``relative`` in units of ``sqrt(eps)``), how many rescue it."""
    torch.manual_seed(0)
    own = torch.randn(4, 8, 16, dtype=torch.float32)
    share = torch.randn(8, 16, dtype=torch.float32)
    share = share / share.norm() * own[1].norm() * relative * FLOAT32_SQRT_EPS
    call, key = object(), ("layer", 0)
    unit = alignment._RowSummaries({id(call): key}, seed=13)
    unit(call, 0, own + torch.stack([torch.zeros_like(share), share, *torch.zeros_like(own[2:])]))

    def again(w):
        rows = w[:, None, None] * own
        rows[1] += w[0] * share
        summaries = alignment._RowSummaries({id(call): key}, seed=13, norms=False)
        summaries(call, 0, rows)
        return summaries.values

    failing = torch.zeros(1, 4, dtype=torch.bool)
    failing[0, 1] = True
    losses, ok = torch.zeros(4, dtype=torch.float32), torch.ones(4, dtype=torch.bool)
    return sum(int(alignment._rows_rechecked(failing, [(key, 0)], unit.values, losses, ok,
                                             torch.Generator().manual_seed(seed), again)[0, 1])
               for seed in range(draws))


def test_the_recheck_rescues_only_a_row_of_its_own_example():
    """What the recheck rescues (seeded draws): a row of its own example alone always (its part scales exactly by
    the power of two), one with another example's share of ``1.2 sqrt(eps)`` (which 8831465's recheck rescued in
    190 of 200 draws) or ``16 sqrt(eps)`` never."""
    assert _rescued(0.0, 50) == 50
    assert _rescued(1.2, 200) == 0
    assert _rescued(16.0, 200) == 0
