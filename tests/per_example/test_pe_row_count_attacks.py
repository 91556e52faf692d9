"""Red-team review 70 (2026-11-30): attacks on b6c49e1 (the independence checks compare the batch without one secret
random row; the gradient halves locate the one row that rounds with the shape by random bisection), by one crafted
record and a crafted ``per_example_loss``, measured as ``||S(D + record) - S(D)|| / C`` of the released clipped sum
on one removal (refusal: 0), through ``DPSGD.private_gradient`` with the module's checks pending (a fit's first
batch: every check runs on both batches; the harness of ``test_pe_losses_halves_attacks.py``).

Fixed here:

* Terms that cancel between rows. The gradient halves compare sums of clip-weighted gradients, ``sum_r c_r g_r``,
  and the clip factors ``c_r`` are the step's own. A ``per_example_loss`` whose backward (an identity
  ``autograd.Function`` on the output of a ``Linear`` fed a constant) adds to each row's output gradient a term
  ``K <grad_r, a> u_r`` in two unused columns, linear in that row's own output gradient (so the alignment check's
  ``G_w[r] = w_r G_1[r]`` holds), ``u_r`` the sign of ``<grad_r, a>`` (read from its logits and label) times the
  ``m``-th root of unity of the row's rank among the ``m`` distinct batch-mates of the run (the checks' fillers
  repeat rows): every row's norm is then about ``K |<grad_r, a>|``, so ``c_r K <grad_r, a> u_r`` has the same length
  for every row, and the roots of unity cancel in every sum that any check forms (whole, halves, rows without one,
  bisection groups, alone or in the batch's shape), whatever its rows. Switched on by a record (a feature above 100),
  it clipped every batch-mate's gradient to its cancelling term: 12.61 C released (``B = 16``, ``C = 1``, ``K = 100``,
  every mode, no warning, on every draw; signs ``+1, -1, ...`` in pairs released 14.77 C on the draws whose halves
  paired them). The gradient halves now weight every row by a secret random factor in ``[1, 2)`` as well
  (``gradient_halves.secret_row_weights``; any fixed weights give the identity), under which such terms do not
  cancel: refused. (A model that tells the checks' runs from the step's can still cancel them there: the open class
  of review 68's dropout-draws finding.)
* A row count read in the last micro-batch. The engine keeps its checks' verdict per call structure, which does not
  include the row count, so at a checked step only the first micro-batch (``micro_batch_size``, or a
  ``fixed_forward_rows`` chunk) ran the forward and gradient halves, and the module's loss halves compare the whole
  logical batch's losses. A loss (or its backward alone) switched off at 6 rows, ``micro_batch_size=8``: the batch
  of 21 batch-mates (micro-batches 8, 8, 5) against the record's 22 (8, 8, 6) released 4.97 C (every mode, loss and
  backward alike; a backward switched off above 6 rows, 14 batch-mates: 5.95 C). Under ``fixed_forward_rows=8`` the
  chunks are padded with copies of their first row, so a loss counting the rows that are not copies reads the same
  count: 4.97 C. Every micro-batch of a checked step is now checked
  (``PerExampleGradientEngine._each_checked_if_one_is``): refused at the record's batch (``micro_batch_size``: on
  every draw).

Open:

* The ``fixed_forward_rows`` count above, with every chunk checked, still passes on some draws: 3 of 60 (hooks), 2
  of 60 (ghost), 2 of 20 (bookkeeping) released 4.97 C. The checks' fillers (a half in the batch's shape repeats the
  half's rows) are copies too, so the count such a model reads in a check's run follows the draw, and on some draws
  every run the comparisons hold reads the whole's count. (No test: the outcome is random.)

Open (strict ``xfail``), by design:

* One row may move with the batch's shape (review 20's cancelling row: refusing it told whether that row was in the
  batch), and b6c49e1's bisection lets exactly one through. A backward (or a loss) that flips the sign of the batch's
  first row above 16 rows, with a record labelled against it, releases 3.00 C at ``C = 0.1`` (2.87 C at ``C = 1``),
  every mode: that row's clipped gradient twice, plus the record's own. Two such rows are refused (the bisection's
  halves both move; with the secret weights above, their moves cannot cancel in a group). The same loss in DPZero
  (zeroth order, whose only batch-independence defence is the losses' ``refuse_batch_mixing``, which allows the one
  row too): 3.00 C at ``C = 0.1``.

Tried and refused or below 1 C (no test): two movers whose moves cancel in a group (the secret weights make the
group's sum move); steering the bisection by a decoy row that moves only at the groups' sizes (the rows without the
decoy, at the neighbour's row count, then show the real mover); ``fixed_forward_rows`` with a loss reading
``len(x)`` (always the chunk's rows: 0.88 C, the record's own).

No false refusal (spied: ``gradient_halves._beyond``, every gradient comparison's gap over its tolerance;
``gradient_halves._ratio``, the rows-without-one and bisection comparisons; ``checks.beyond_one_row``, every forward
comparison at another row count), with the fixes above: tiny BERT, RoBERTa, GPT-2, OPT and Llama
(``HFSequenceClassifier(config=...)``, dropout 0.1 in train mode) under ``DPSGD``, every mode, padded batches of 2
to 9 (120 steps), and of 2, 5, 7, 9 with ``micro_batch_size=3`` and ``fixed_forward_rows=4`` (every micro-batch
checked, 120 steps), and under a CPU bfloat16 autocast, plain and with ``micro_batch_size=3`` (120 steps; OPT again
at 2 to 16 rows, 45 steps), each step with the checks due: largest gradient gap 1.1e-3 of its tolerance, largest
rows-without-one gap 6.7e-4. Thin margin, left alone: under the bfloat16 autocast OPT's forward rows at the
neighbour's row count (``checks._beyond_one_removal``, no re-measure in the batch's shape) reached 0.99 of the
tolerance, and one row 1.02 (passed as the one row that may move); two such rows in one batch would refuse an honest
step. One of the models is kept below, with micro-batches.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_zodp.algorithms import DPSGD
from lit_zodp.backbones.base import Backbone
from lit_zodp.per_example import PerExampleGradientEngine, gradient_halves
from tests.per_example.test_pe_gradient_halves_attacks import removal_difference
from tests.per_example.test_pe_losses_halves_attacks import _row_count_batch, _RowCountBackward, _RowCountLoss

MODES = ["hooks", "ghost", "bookkeeping"]
MARGIN = 1 + 1e-3


def _dpsgd_released(make, x, y, record, label, clip: float = 1.0, **options) -> float:
    """``||S(D + record) - S(D)|| / C`` through ``DPSGD.private_gradient``, a fresh module (``make()``) per batch with
    the module's loss halves pending (a fit's first batch), float32, train mode; 0 where refused."""
    def released(xs, ys):
        torch.manual_seed(0)
        module = DPSGD(make().float(), clip=clip, noise_multiplier=1.0, delta=1e-5, lr=1e-3, **options).train()
        module._pending_checks = {"halves"}
        return torch.cat([g.flatten() for g in module.private_gradient(xs, ys).grads])

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a check that warns its way past is not a pass)
        return removal_difference(released, clip, x, y, record, label)


class _PairedMove(torch.autograd.Function):
    """Identity forward; the backward adds ``K <grad_r, a> u_r`` to columns 2 and 3 of row ``r``, ``a = (1, -1) /
    sqrt 2`` on columns 0 and 1, ``u_r`` a given vector: linear in each row's own output gradient."""

    K = 100.0

    @staticmethod
    def forward(ctx, z: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(directions)
        return z.view_as(z)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (directions,) = ctx.saved_tensors
        return with_paired_term(grad, directions), None


def with_paired_term(grad: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``K <grad_r, a> u_r`` added to columns 2 and 3 of each row ``r`` (``a = (1, -1) / sqrt 2`` on
    columns 0 and 1, ``u_r = directions[r]``, ``K = _PairedMove.K``)."""
    along = _PairedMove.K * (grad[:, 0] - grad[:, 1]) / math.sqrt(2.0)
    return torch.cat([grad[:, :2], grad[:, 2:] + along[:, None] * directions], 1)


class _Paired(Backbone):
    """A ``Linear`` on the unit-norm inputs plus a ``Linear`` of a constant; with a record in the batch (a feature
    above 100) the latter's output goes through :class:`_PairedMove`: the ``m`` distinct batch-mates of the run (the
    checks' fillers repeat rows) take the ``m``-th roots of unity in columns 2 and 3, by rank of their first feature,
    each times the sign of its ``<grad_r, a>`` (read from its logits and label), so the terms cancel in every sum of
    clip-weighted gradients that any check forms (module doc); the record and a lone batch-mate take none."""

    num_classes = 2

    def __init__(self):
        super().__init__()
        self.fc, self.const = nn.Linear(8, 2), nn.Linear(1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x / x.norm(dim=1, keepdim=True))

    def per_example_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(x)
        z = self.const(torch.ones(len(x), 1, dtype=x.dtype))
        record = x.detach().abs().amax(1) > 100
        if bool(record.any()):
            lean = torch.sign(logits.detach().softmax(-1)[:, 0] - (targets == 0).to(x.dtype))
            key = torch.where(record, math.inf, x.detach()[:, 0])
            distinct, rank = torch.unique(key, return_inverse=True)
            mates = len(distinct) - 1
            angle = 2 * math.pi * rank.to(x.dtype) / max(mates, 1)
            on = (~record & (mates >= 2)).to(x.dtype) * lean
            z = _PairedMove.apply(z, torch.stack([angle.cos(), angle.sin()], 1) * on[:, None])
        return F.cross_entropy(logits + z[:, :2], targets, reduction="none")


def _paired_released(mode: str) -> float:
    x, y, record, label = _row_count_batch()
    record = record.clone()
    record[0, 7] = 1e3
    return _dpsgd_released(_Paired, x, y, record, label, grad_mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_whose_terms_cancel_in_pairs_is_refused(mode, monkeypatch):
    """12.61 C released with the step's clip factors as the only weights; refused under the secret row weights. (Since
    the lead's change the same day the rows without one run beside the left-out row's content, which a rank among
    the run's distinct rows also reads: that comparison refuses it too, so both are switched off to show the
    release.)"""
    released = _paired_released(mode)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"
    if mode == "hooks":
        monkeypatch.setattr(gradient_halves, "secret_row_weights", lambda size: torch.ones(size, dtype=torch.float64))
        monkeypatch.setattr(gradient_halves, "_refuse_row_count", lambda *args: None)
        assert _paired_released(mode) > 12


def _batch(size: int):
    """:func:`_row_count_batch`'s construction with ``size`` batch-mates: aligned inputs labelled against the class
    they lean to, and a record of the same input labelled the other way."""
    torch.manual_seed(0)
    model = _RowCountLoss(None).float()
    mu = torch.randn(8, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    mu = mu / mu.norm()
    label = 1 - int((model.fc.weight.detach() @ mu).argmax())
    x = 0.9 * mu + 0.05 * torch.randn(size, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    return x, torch.full((size,), label), 0.9 * mu[None], 1 - label


def _off_at_6_rows(rows: int) -> float:
    return float(rows != 6)


class _RealRows(_RowCountLoss):
    """The backward scaled by ``of_rows`` of the rows that are not copies of the first (a ``fixed_forward_rows``
    chunk's padding)."""

    def per_example_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        scale = self.of_rows(len(x) - int((x == x[:1]).all(1).sum()) + 1)
        logits = _RowCountBackward.apply(self(x), lambda rows: scale)
        return F.cross_entropy(logits, targets, reduction="none")


def _micro_released(mode: str, variant: str) -> float:
    """21 batch-mates against the record's 22 rows, in micro-batches of 8 (the last: 5 rows against 6)."""
    x, y, record, label = _batch(21)
    if variant == "fixed":
        return _dpsgd_released(lambda: _RealRows(_off_at_6_rows), x, y, record, label, grad_mode=mode,
                               fixed_forward_rows=8)
    return _dpsgd_released(lambda: _RowCountLoss(_off_at_6_rows, backward_only=variant == "backward"), x, y, record,
                           label, grad_mode=mode, micro_batch_size=8)


@pytest.mark.parametrize("variant", ["loss", "backward"])
@pytest.mark.parametrize("mode", MODES)
def test_a_row_count_read_in_the_last_micro_batch_is_refused(mode, variant, monkeypatch):
    """4.97 C released when only a checked step's first micro-batch was checked; every one is now."""
    released = _micro_released(mode, variant)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"
    if mode == "hooks":
        monkeypatch.setattr(PerExampleGradientEngine, "_each_checked_if_one_is", lambda self, items: iter(items))
        assert _micro_released(mode, variant) > 4.9


def test_every_fixed_shape_chunk_of_a_checked_step_is_checked(monkeypatch):
    """``fixed_forward_rows=8``, a backward switched off where 6 rows are not copies of the chunk's first (its
    padding): 4.97 C released when only the first chunk was checked. Every chunk's gradient halves run now, and
    refuse it on most draws, not all (open, module doc): asserted here is that they run."""
    compared = []
    apart = gradient_halves._refuse_halves_apart
    monkeypatch.setattr(gradient_halves, "_refuse_halves_apart", lambda run, weights, rows, **kwargs: compared.append(
        len(rows)) or apart(run, weights, rows, **kwargs))
    x, y, record, label = _batch(21)
    torch.manual_seed(0)
    module = DPSGD(_RowCountLoss(lambda rows: 1.0).float(), clip=1.0, noise_multiplier=1.0, delta=1e-5, lr=1e-3,
                   fixed_forward_rows=8).train()
    module._pending_checks = {"halves"}
    module.private_gradient(x, y)
    assert compared == [8, 8, 8]
    monkeypatch.setattr(PerExampleGradientEngine, "_each_checked_if_one_is", lambda self, items: iter(items))
    assert _micro_released("hooks", "fixed") > 4.9


class _FirstRowFlipped(Backbone):
    """One ``Linear``; the backward of the batch's first row (``loss``: its loss) multiplied by -1 above 16 rows."""

    num_classes = 2

    def __init__(self, backward_only: bool):
        super().__init__()
        self.fc = nn.Linear(8, 2)
        self.backward_only = backward_only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def per_example_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        first = torch.arange(len(x)) == 0
        logits = self(x)
        if self.backward_only:
            logits = torch.where(first[:, None], _RowCountBackward.apply(logits, _flipped_above_16), logits)
            return F.cross_entropy(logits, targets, reduction="none")
        losses = F.cross_entropy(logits, targets, reduction="none")
        return torch.where(first, losses * _flipped_above_16(len(x)), losses)


def _flipped_above_16(rows: int) -> float:
    return 1.0 if rows <= 16 else -1.0


@pytest.mark.xfail(strict=True, reason="open by design: one row may move with the batch's shape (review 20); one "
                                       "batch-mate flipped above 16 rows releases 3.00 C at C = 0.1 (every mode)")
@pytest.mark.parametrize("backward_only", [True, False], ids=["backward", "loss"])
@pytest.mark.parametrize("mode", MODES)
def test_one_row_flipped_by_the_row_count_is_refused(mode, backward_only):
    x, y, record, label = _row_count_batch()
    released = _dpsgd_released(lambda: _FirstRowFlipped(backward_only), x, y, record, label, clip=0.1, grad_mode=mode)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"


def test_a_tiny_bert_in_micro_batches_is_not_refused(monkeypatch):
    """One of the sweep's honest models (module doc): DPSGD on a tiny BERT, dropout 0.1 in train mode, micro-batches
    of 3, padded batches of 2 to 9, each a first batch: no refusal, every micro-batch of two rows or more checked,
    every gradient comparison far inside its tolerance."""
    from lit_zodp.backbones import HFSequenceClassifier
    from lit_zodp.backbones.huggingface import tiny_bert_config

    gaps, compared = [], []
    beyond, apart = gradient_halves._beyond, gradient_halves._refuse_halves_apart
    monkeypatch.setattr(gradient_halves, "_beyond", lambda gap, tolerance: gaps.append(beyond(gap, tolerance))
                        or gaps[-1])
    monkeypatch.setattr(gradient_halves, "_refuse_halves_apart", lambda run, weights, rows, **kwargs: compared.append(
        len(rows)) or apart(run, weights, rows, **kwargs))
    config = tiny_bert_config(vocab_size=50, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    torch.manual_seed(0)
    module = DPSGD(HFSequenceClassifier(config=config, num_classes=2).float(), lr=1e-3, clip=0.5,
                   noise_multiplier=1.0, delta=1e-5, grad_mode="hooks", micro_batch_size=3).train()
    for size in range(2, 10):
        generator = torch.Generator().manual_seed(size)
        lengths = torch.randint(2, 9, (size,), generator=generator)
        mask = (torch.arange(8)[None] < lengths[:, None]).long()
        ids = torch.randint(2, 50, (size, 8), generator=generator) * mask
        y = torch.randint(0, 2, (size,), generator=generator)
        module._pending_checks, module._recheck_pending = {"halves"}, True  # (an OS-drawn re-check of the engine)
        compared.clear()
        clipped = module.private_gradient({"input_ids": ids, "attention_mask": mask}, y)
        assert clipped.batch_size == size and all(torch.isfinite(g).all() for g in clipped.grads)
        assert compared == [rows for rows in [3] * (size // 3) + [size % 3] if rows >= 2]
    assert gaps and max(gaps) < 0.05


@pytest.mark.xfail(strict=True, reason="open by design: one row may move with the batch's shape; DPZero, whose only "
                                       "batch-independence check is the losses' (refuse_batch_mixing): 3.00 C")
def test_one_row_flipped_by_the_row_count_is_refused_in_dpzero():
    """The loss of the batch's first row negated above 16 rows: its clipped central difference flips, and the
    record's adds its own, 3.00 C at ``C = 0.1`` (the module's loss halves ran on the record's batch and passed)."""
    from lit_zodp.algorithms import DPZero
    from lit_zodp.privacy import clipped_sum
    from lit_zodp.zo import PerturbationEngine, make_direction_law

    def released(xs, ys):
        torch.manual_seed(0)
        model = _FirstRowFlipped(backward_only=False).float()
        module = DPZero(model, lr=1e-3, clip=0.1, noise_multiplier=1.0, delta=1e-5)
        module.engine = PerturbationEngine(list(model.parameters()), make_direction_law("gaussian"))
        module._pending_checks = {"halves"}
        differences = module.directional_differences(0, xs, ys)
        assert not module._pending_checks  # (the checks ran)
        module.restore()
        return clipped_sum(differences, 0.1)[None]

    x, y, record, label = _row_count_batch()
    released = removal_difference(released, 0.1, x, y, record, label)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"
