"""Red-team review 78: crafted records against the alignment check at the edges of the float range (stop 64).

e6c6fde compared rows failing by their own underflow again in passes where every loss was times ``2^S``: those passes
see the rows as exact arithmetic has them, while the engine credits the rows of the step's own backward, at scale 1.
Where a row's own part underflows to 0 at scale 1 (and only there), the two are different rows: the lifted comparison
found example ``r``'s own part dominant and agreed, while the credited row held only another example's part (finding 1,
1.95 C). The lifted comparison was withdrawn; the float64 norms and gap stay. Findings 2 and 4 predate it: 2 is open,
4 is closed since stop 65 (rule layers compared through what their rules credit); finding 3 (the coverage check's
float32 norms) is fixed.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_zodp.errors import PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine
from lit_zodp.per_example import engine as engine_module

MODES = ["hooks", "ghost", "bookkeeping"]

#: The record's row and the batch-mate ("victim") whose loss reaches it through the mix.
RECORD, VICTIM = 2, 3


class ZeroInitMixed(nn.Module):
    """A zero-initialised layer (LoRA's ``B``, a residual branch's output layer; bias-free), whose output a model mixes
    across the batch BY MISTAKE by ``1e-5`` (a shift of the batch, below the alignment tolerance ``2 sqrt(eps)`` of
    every honest row: the call passes as aligned), then per-example scales ``2^e`` taken from the input's last four
    columns (as :class:`tests.per_example.test_pe_alignment.Underflowing`): ``2^(e4 + e5 - e6)`` before the head,
    ``2^-e7`` after it. Honest examples have ``e = 0``. In float32."""

    def __init__(self, mix: float = 1e-5):
        super().__init__()
        self.lin, self.head, self.mix = nn.Linear(4, 8, bias=False), nn.Linear(8, 2), mix
        nn.init.zeros_(self.lin.weight)

    def forward(self, x):  # [B, 8]
        h = self.lin(x[:, :4])
        h = h + self.mix * h.roll(1, 0)
        h = h * torch.exp2(x[:, 4:5]) * torch.exp2(x[:, 5:6]) * torch.exp2(-x[:, 6:7])
        return self.head(h) * torch.exp2(-x[:, 7:8])


def _erasing_batch(size: int = 6):
    """Five honest examples and one record: features ``1e4`` (the zero-initialised layer's forward is 0 whatever
    they are), ``e = (100, 55, 10, 145)``. Its loss gradient at the head's output is ``2^-146`` (a float32 subnormal,
    whose rounding fails the first comparison and triggers the lift); at ``2^-157`` in the backward (the ``2^-10``
    step) it is 0 at scale 1, so its own part of its ``lin`` row is erased, while exactly it is ``2^-2`` times the
    head's weights: ``2^64`` lifts it into the normal range, where it dwarfs the victim's part (``1e-5`` of a row)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(size, 8, generator=g, dtype=torch.float32)
    x[:, 4:] = 0
    y = torch.randint(0, 2, (size,), generator=g)
    x[RECORD, :4] = 1e4 * torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=torch.float32)
    x[RECORD, 4:] = torch.tensor([100.0, 55.0, 10.0, 145.0], dtype=torch.float32)
    return x, y


def _model():
    torch.manual_seed(0)
    return ZeroInitMixed().float()  # (tests/per_example's default dtype is float64)


def _losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _sensitivity(model, x, y, mode, clip, engine=None, *, transform=None, losses=None):
    """``max_j ||S - S_{-j}|| / C`` over the removals of one example (a fresh engine per batch unless ``engine``,
    holding ``transform()`` if given; ``losses(model, x, y)``, default cross-entropy)."""
    losses = losses or _losses

    def clipped(rows):
        e = engine or PerExampleGradientEngine(model, mode=mode, transform=transform() if transform else None)
        return e.clipped_sum(lambda: losses(model, x[rows], y[rows]), clip)

    size = len(x)
    full = clipped(list(range(size)))
    worst = 0.0
    for j in range(size):
        less = clipped([i for i in range(size) if i != j])
        gap = torch.cat([(a - b).flatten() for a, b in zip(full.grads, less.grads)]).double().norm()
        worst = max(worst, float(gap) / clip)
    return worst


@pytest.mark.parametrize("mode", MODES)
def test_a_record_erasing_its_own_row_at_scale_one_is_not_credited_its_neighbours_part(monkeypatch, mode):
    """The record's ``lin`` row at scale 1 is the victim's part alone (``1e-5`` of the victim's row); lifted by
    ``2^64`` the record's own exact part dwarfs it, so the lifted comparison agrees and ``lin`` keeps its layer rule:
    the record's clipped gradient (its norm 0.059, clipped to ``C``) is the victim's. Measured: 1.946 C released on
    one removal (removing the victim), in every mode, at e6c6fde. Refused since the lifted comparison was withdrawn
    (as before it, at b936fd1: 10 of 10): the record's row fails, ``lin`` goes to the torch.func fallback, whose
    per-example gradients lack the victim's part, and the coverage check refuses the step. At a checked step of
    e6c6fde the gradient halves (patched off here, to measure the alignment check alone) refused 46 of 60 draws of
    their secret halves: 14 of 60 checked steps (23%) passed silently; at unchecked steps see finding 2."""
    monkeypatch.setattr(engine_module, "refuse_gradient_mixing", lambda *args, **kwargs: None)
    model, (x, y) = _model(), _erasing_batch()
    engine = PerExampleGradientEngine(model, mode=mode)
    try:
        assert _sensitivity(model, x, y, mode, 1e-3) <= 1 + 1e-6
        engine.clipped_sum(lambda: _losses(model, x, y), 1e-3)
        assert "lin.weight" in engine.last_recomputed
    except PrivacyConfigError:
        pass  # refused: safe


@pytest.mark.xfail(strict=True, reason="open (review 78, finding 2, predates e6c6fde): a structure verified on an "
                                       "honest batch credits a later record's erased row at every unchecked step")
def test_a_record_at_an_unchecked_step_is_not_credited_its_neighbours_part():
    """The structure's first batches (``B = 6`` and ``B = 5``) are honest: the mix (``1e-5``) is within every row's
    tolerance and the verdict "aligned" is kept. The record then comes at an unchecked step (``recheck_probability =
    0``; by default 99 steps in 100), where neither the alignment check nor the gradient halves run: 1.946 C released
    on one removal (also on b936fd1, before e6c6fde: 10 of 10 steps credited). Safe behaviour: at most C."""
    model, (x, y) = _model(), _erasing_batch()
    engine = PerExampleGradientEngine(model, mode="hooks", recheck_probability=0.0)
    honest = x.clone()
    honest[RECORD, 4:] = 0
    honest[RECORD, :4] = torch.randn(4, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    for rows in (list(range(6)), list(range(5))):
        engine.clipped_sum(lambda: _losses(model, honest[rows], y[rows]), 1e-3)
    assert _sensitivity(model, x, y, "hooks", 1e-3, engine=engine) <= 1 + 1e-6


@pytest.mark.parametrize("scale", [1e20, 1e-25])
def test_the_coverage_check_sees_an_uncovered_third_at_any_float32_scale(scale):
    """``coverage.uncovered`` with a third of a float32 batch gradient not covered by the per-example sums: found at
    1e10 and 1e-20, missed until stop 64 at 1e20 (``full.norm()`` overflowed in float32: the parameter was skipped as
    if its gradient were not finite) and at 1e-25 (``difference_norm``'s float32 squares underflowed: a gap of 0);
    found since (:func:`~lit_zodp.per_example.coverage.wide_norm`, also in the ghost streaming comparison). Correctness,
    not privacy: the fallback and the rules release only per-example parts, each clipped, so no sensitivity above C
    was measured through it (a record with 1e20 features could have turned the refusal of an honest model with an
    uncovered use off: not measured end to end)."""
    from lit_zodp.per_example.coverage import uncovered
    torch.manual_seed(0)
    rows = scale * torch.randn(4, 10, dtype=torch.float32)
    total = rows.sum(0)
    norms = rows.double().norm(dim=1).float()
    assert uncovered([total], [norms], [1.5 * total], torch.device("cpu")) == [0]


class DeadPosition(nn.Module):
    """Two positions through a zero-initialised bias-free layer (``[B, 2, 4]``); the first position's outputs mixed
    across the batch BY MISTAKE by ``1e-5``; each position scaled by ``2^e`` (the position's last column) before a
    shared head. Honest examples have ``e = 0``. In float32."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(4, 8, bias=False), nn.Linear(8, 2)
        nn.init.zeros_(self.lin.weight)

    def forward(self, x):  # [B, 2, 5]
        h = self.lin(x[:, :, :4])
        first = h[:, 0] + 1e-5 * h[:, 0].roll(1, 0)
        return self.head(first * torch.exp2(x[:, 0, 4:]) + h[:, 1] * torch.exp2(x[:, 1, 4:]))


@pytest.mark.parametrize("mode", MODES)
def test_a_dead_position_does_not_widen_its_rows_tolerance(monkeypatch, mode):
    """The record's second position has zero features (a padding vector) and an output gradient ``2^60`` times the
    others': no parameter of ``lin`` is credited with it (its activation is 0), yet it sets ``||G_1[r]||``, so the
    tolerance ``2 sqrt(eps) |w_r| ||G_1[r]||`` admits any part of another example at the first position, which the
    record scales down by ``2^-30``: its credited row is the victim's (``1e-5`` of a row), features ``1e6``. Measured:
    2.26 C released on one removal (hooks, gradient halves patched off; the same on b936fd1: not from e6c6fde). The
    gradient halves refused 28 of 40 checked steps (12 passed silently); unchecked steps run no check. Safe
    behaviour: the step refused, or at most C released. (Finding 1 in another form: the comparison's scale, a whole
    row's norm, is not the scale of what is credited from that row, ``a_r^T G[r]``.) Closed in stop 65: a rule
    layer's calls are compared through the per-example gradients the rule credits (:mod:`.alignment`), where the dead
    position contributes nothing; ``lin`` goes to the fallback, and the step is refused (every mode)."""
    monkeypatch.setattr(engine_module, "refuse_gradient_mixing", lambda *args, **kwargs: None)
    model, x, y = dead_position_batch()
    try:
        assert _sensitivity(model, x, y, mode, 1e-3) <= 1 + 1e-6
    except PrivacyConfigError:
        pass  # refused: safe


def dead_position_batch():
    """:class:`DeadPosition` and six examples, the record's first position features ``1e6`` scaled by ``2^-30``, its
    second zero features scaled by ``2^60``."""
    torch.manual_seed(0)
    model = DeadPosition().float()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, 5, generator=g, dtype=torch.float32)
    x[:, :, 4] = 0
    y = torch.randint(0, 2, (6,), generator=g)
    x[RECORD, 0, :4] = 1e6 * torch.tensor([1.0, -1.0, 1.0, 1.0], dtype=torch.float32)
    x[RECORD, 0, 4], x[RECORD, 1, :4], x[RECORD, 1, 4] = -30.0, 0.0, 60.0
    return model, x, y
