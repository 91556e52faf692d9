"""Red-team review 68 (2026-11-30): attacks on the gradient halves on the losses (5eb66f5: ``losses_of``, the
first-order modules' ``MicroBatch``, the retry that ties the rows in the sum to the step's own clipped sum), by one
crafted record, measured as ``||S(D) - S(D')|| / C`` for one removal (refusal: 0), each batch a first batch of its
structure (the harness of ``test_pe_gradient_halves_attacks.py``, and ``DPSGD.private_gradient`` for the module path).

Fixed here:

* The retry after a non-finite whole (``gradient_halves._retry_without_non_finite_rows``) compared the rows in the
  sum, recomputed without the non-finite row, with the step's own clipped sum to the tolerance of the step's rounding
  (``released_unit``): under a bfloat16 autocast of a float32 model that is ``u = sqrt(2^-7) = 0.088`` times
  ``sum_r c_r ||g_r|| + ||G|| + ||S||``, while the check itself runs in float32. A record with an infinite feature
  (its loss not finite: factor 0, and the first whole NaN) whose finite features set a batch statistic that scales
  every batch-mate's backward by 0.8 passed the retry: 2.90 C released at ``B = 16`` (every mode, with and without
  ``losses_of``; refused in float32). Such a retry is now refused where the step's rounding is coarser than the
  check's (the message says to drop non-finite inputs). An honest float32 model under an autocast with an infinite
  input in a batch is refused too at a checked step (it passed before 5eb66f5 too, compared without the row).
* A loss that reads the batch's row count passed the gradient halves given ``losses_of``: on the halves alone it is
  refused, but the re-measure with each half in the batch's shape (``_in_place``) has the whole's row count, and it
  replaced the first measure. ``loss / len(x)`` on the bare engine: 1.50 C (unclipped batch-mates, ``C = 0.075``,
  every mode). On the losses path a mismatch that the shape explains is now still refused where the halves alone
  moved most rows' losses beyond rounding (``gradient_halves._moves_rows_losses``, the forward checks' rule of
  ``checks._beyond_shape_rounding``: one row cannot). (A fit's module loss halves refuse it too at their first batch;
  at a later batch of a known structure neither check runs but for the OS's re-checks.)
* Not an attack, found running the neighbouring tests: the retry of ``clipped_parts`` summed the per-example
  gradients after GEP's split had emptied their list, so every checked GEP step with a non-finite row failed with a
  ``RuntimeError`` (``test_gep_attacks.py``'s nan and inf records, failing at 5eb66f5). Compared in the parts' space
  now (``engine._parts_of``).

Open (strict ``xfail``):

* (Closed at stop 60.) Mixing through the dropout draws themselves: every check recomputes with each Bernoulli draw
  at its mean (``MeanOfRandomDraws``), where ``dropout(x) - x`` is 0. A ``per_example_loss`` whose backward is divided
  by ``1 + 1e-6 mean_b ||dropout(x_b) - x_b||^2`` (0 in every recomputation, ``mean_b ||x_b||^2`` in the step at
  ``p = 0.5``) passes the forward halves, the loss halves and the gradient halves without a warning, and review 65's
  record (1e5 times an input) shrinks every batch-mate's clipped gradient: 3.73 C released through
  ``DPSGD.private_gradient`` (every mode). Any model that tells the checks' recomputations from the step (this probe of
  the mean draws, an autocast that the float32 check drops) can do the same. Since stop 60 the gradient halves run
  once more at a step that drew, every run replaying the step's draws in the batch's shape
  (``gradient_halves._refuse_mixing_through_draws``): refused.
* (Closed at stop 58.) A record that sends the gradient halves to eval mode: a ``per_example_loss`` that adds noise
  (``rand``) to its logits in training only when a row is huge, and scales its backward by a batch statistic only in
  training. With the record the train-mode check refuses, the losses do not reproduce, so the check runs again in
  eval mode, where nothing mixes: 3.73 C released (every mode), with the warning that training mode went unchecked
  (the same warning as an honest RReLU model's, on the record's steps only). Without the record the step passes
  silently. (Since the lead's change the same day, the checks take ``rand`` at its mean, so that model is refused;
  with a draw that has no mean, ``randint``, the break stayed open until stop 58 gave such draws fixed stand-ins.
  A draw from the model's own explicit generator still sends the checks to eval mode, with the warning.)
* (Closed at stop 58.) A backward scaled by a function of the batch's row count (an ``autograd.Function`` whose
  forward is the identity): the gradient halves re-measure a mismatch with each half run in the batch's shape
  (``_in_place``, for kernels whose rounding follows the shape, review 20), where the row count is the whole's, and
  that measure replaces the first; no loss moves, so neither the module's loss halves nor the rule fixed above see
  it, while one removal changes ``len(x)`` for every batch-mate. Switched off above 16 rows, through
  ``DPSGD.private_gradient`` (a fresh module per batch, its loss halves pending): the record's batch of 17 rows
  zeroes every batch-mate's gradient, 15.8 C (every mode). Stop 58 found the same through 7 of the 16 rows' losses
  (7.8 C: "most rows" did not move) and closed both: every halves check also compares the batch without one secret
  random row, and two rows moving with the shape are refused (``gradient_halves._refuse_row_count``,
  ``checks.beyond_one_row``; the tests at the end of this file).
* A bfloat16 model (parameters bfloat16, not a float32 model under an autocast, which review 67 closed by checking
  it in float32): the gradient halves run in bfloat16 with the unit ``min(sqrt(2^-7), 256 * 2^-7) = 0.088`` of the
  norms' term, and review 67's scaled backward with the aligned batch passes: 4.48 C at ``B = 16`` (record ``-3000
  mu``), 16.8 C at ``B = 64`` (``-6000 mu``, a script), with and without ``losses_of``.

Tried and refused (no test): a record with a NaN feature against review 65's scaled backward, and a scale that NaNs
only some batch-mates (the alignment check sees NaN gradients and falls back, or refuses); the same record as above
in float32 (the retry's comparison with the release refuses, 0 C at every scale tried); a record with the infinite
feature whose loss is finite but gradient not (same retry path).

No false refusal by the gradient halves (spied: ``gradient_halves._beyond``, every comparison's gap over its
tolerance): ``DPSGD`` and ``DPAdam`` (every mode; also ``micro_batch_size=3`` and ``fixed_forward_rows=4``) on tiny
BERT, RoBERTa, GPT-2, OPT and Llama (``HFSequenceClassifier(config=...)``, dropout 0.1 in train mode), seeds 0-1,
padded batches of 2, 5, 8 (360 steps): largest 9.4e-4 (Llama, ``micro_batch_size=3``, hooks, ``B = 2``); DP-GRAPE
(hooks, rank 4) and DPSGD under a CPU bfloat16 autocast (every mode, also ``fixed_forward_rows=6``), batches of 2, 7,
16 (210 steps, and BERT's 252 again): largest 8.9e-4; ``HFAnswerGenerator`` (tiny OPT saved offline, train mode,
every mode, also ``micro_batch_size=2``, 36 steps): 5.1e-4. Two of the 396 autocast steps were refused, both BERT in
"ghost" (B = 7), by the second pass's verification and the coverage fallback, not by this check: the same step
before 5eb66f5 (1accfbd) was refused 3 times in 80, after it 2 in 80 (pre-existing, left alone). One of the honest
models is kept below.
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
from lit_zodp.errors import PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine, checks, gradient_halves
from tests.per_example.test_pe_gradient_halves_attacks import (_aligned_batch, _released, _review65_batch,
                                                               removal_difference)
from tests.per_example.test_pe_layer_inputs_attacks import _BackwardScaledNet, _BatchScaledBackward

MODES = ["hooks", "ghost", "bookkeeping"]
MARGIN = 1 + 1e-3
CLIP = 0.1


class _FiniteFeatureStatistic(nn.Module):
    """One ``Linear`` whose backward is scaled by the batch's mean squared norm of the *finite* features (a record's
    infinite feature does not make the statistic infinite: its finite ones set it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stat = x.detach().float().nan_to_num(posinf=0.0, neginf=0.0).pow(2).sum(1).mean()
        return _BatchScaledBackward.apply(self.fc(x), stat, 1e-8)


def _retry_problem(scale: float = 2e4):
    """15 aligned batch-mates (norm 0.8, unclipped at ``C = 1``, all pulled the same way) and the record: an infinite
    feature (its loss is not finite, so the whole batch's recomputed gradient is NaN) and a finite one of ``scale``,
    which sets the statistic so that every batch-mate's backward is scaled by ``1 / (1 + 1e-8 scale^2 / 16)``: 0.8."""
    torch.manual_seed(0)
    model = _FiniteFeatureStatistic().float()
    mu = torch.randn(8, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    mu = mu / mu.norm()
    label = 1 - int((model.fc.weight.detach() @ mu).argmax())
    x = 0.8 * mu + 0.05 * torch.randn(15, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    record = torch.zeros(1, 8, dtype=torch.float32)
    record[0, 0], record[0, 1] = float("inf"), scale
    return model, x, torch.full((15,), label), record


@pytest.mark.parametrize("losses_of", [False, True], ids=["calls", "losses"])
@pytest.mark.parametrize("mode", MODES)
def test_a_retry_under_a_bfloat16_autocast_is_refused(mode, losses_of):
    """2.90 C released at 5eb66f5 under the autocast (the retry's comparison with the step's sum had bfloat16's
    tolerance); refused in float32 then and now."""
    model, x, y, record = _retry_problem()

    def losses(xs, ys):
        return F.cross_entropy(model(xs).float(), ys, reduction="none")

    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            released = _released(model, losses, mode, 1.0, x, y, record, 0, losses_of=losses_of)
        assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C (autocast {autocast})"


def test_the_retry_under_an_autocast_is_refused_not_the_step_without_the_record():
    """What the fix refuses: the step with the record, as not comparable; the batch without it still passes."""
    model, x, y, record = _retry_problem()
    engine = PerExampleGradientEngine(model, mode="hooks")
    xs, ys = torch.cat([x, record]), torch.cat([y, y[:1]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(PrivacyConfigError, match="half-precision autocast"):
            engine.clipped_sum(lambda: F.cross_entropy(model(xs).float(), ys, reduction="none"), 1.0)
        clipped = PerExampleGradientEngine(model, mode="hooks").clipped_sum(
            lambda: F.cross_entropy(model(x).float(), y, reduction="none"), 1.0)
    assert clipped.batch_size == 15 and all(torch.isfinite(g).all() for g in clipped.grads)


def test_the_retry_of_separately_clipped_parts_under_an_autocast_is_refused():
    """GEP's path (``clipped_parts``, each example's smallest factor as the check's weight) takes the same retry."""
    model, x, y, record = _retry_problem()
    xs, ys = torch.cat([x, record]), torch.cat([y, y[:1]])

    def split(grads):
        flat = torch.cat([g.flatten(1) for g in grads], 1)
        return [flat[:, :8], flat[:, 8:]]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(PrivacyConfigError, match="half-precision autocast"):
            PerExampleGradientEngine(model, mode="hooks").clipped_parts(
                lambda: F.cross_entropy(model(xs).float(), ys, reduction="none"), split, [1.0, 1.0])


def _emptying_split(grads):
    """Two parts of the flattened per-example gradients, the list emptied as GEP's ``flatten_rows`` empties it."""
    flat = torch.cat([g.flatten(1) for g in grads], 1)
    grads.clear()
    return [flat[:, :8], flat[:, 8:]]


@pytest.mark.parametrize("scaled", [False, True], ids=["honest", "scaled-backward"])
def test_a_retry_of_parts_whose_split_empties_the_gradients(scaled):
    """At 5eb66f5 the retry of ``clipped_parts`` summed the step's per-example gradients after the split had emptied
    their list (GEP's): a list of no sums, and ``RuntimeError: stack expects a non-empty TensorList`` at every checked
    step with a non-finite row (``tests/algorithms/test_gep_attacks.py``'s nan and inf records, 6 cases). The step's
    sums are now compared in the parts' space (the recomputed gradient split as one row): an honest model with the
    infinite record passes, review 67's record against the scaled backward (3.81 C) is refused."""
    x, y, _ = _review65_batch()
    torch.manual_seed(0)
    model = (_BackwardScaledNet() if scaled else nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))).float()
    record = torch.zeros(1, 8, dtype=torch.float32)
    record[0, 0] = float("inf")
    xs, ys = torch.cat([x, record]), torch.cat([y, y[:1]])

    def parts():
        return PerExampleGradientEngine(model, mode="hooks").clipped_parts(
            lambda: F.cross_entropy(model(xs), ys, reduction="none"), _emptying_split, [0.1, 0.1])

    if scaled:
        with pytest.raises(PrivacyConfigError, match="could not be checked"):
            parts()
    else:
        clipped = parts()
        assert clipped.batch_size == 16 and all(torch.isfinite(s).all() and s.abs().sum() > 0 for s in clipped.sums)


class _TellsTheChecksApart(Backbone):
    """Review 65's two-layer net whose ``per_example_loss`` scales its backward by a batch statistic: ``"dropout"``,
    ``1 + 1e-6 mean_b ||dropout(x_b) - x_b||^2`` (0 where the draws are at their mean); ``"eval"``, review 65's
    statistic in training only, and logits noised in training only when a row is huge (the record's step's losses do
    not reproduce)."""

    num_classes = 2

    def __init__(self, variant: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 2)
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def per_example_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, features = self(x), x.detach()
        if self.variant == "dropout":
            stat = (F.dropout(features, 0.5, training=self.training) - features).pow(2).sum(1).mean()
            logits = _BatchScaledBackward.apply(logits, stat)
        elif self.training:
            logits = _BatchScaledBackward.apply(logits, features.pow(2).sum(1).mean())
            noise = torch.rand_like(logits) if self.variant == "eval" else torch.randint_like(logits, 0, 2)
            logits = logits + (features.abs().amax() > 1e4) * noise
        return F.cross_entropy(logits, targets, reduction="none")


def _module_released(variant: str, mode: str) -> float:
    """Review 65's batch and record (1e5 times an input's size) through ``DPSGD.private_gradient``, train mode,
    float32."""
    def released(xs, ys):
        torch.manual_seed(0)
        module = DPSGD(_TellsTheChecksApart(variant).float(), clip=CLIP, noise_multiplier=1.0, delta=1e-5, lr=1e-3,
                       grad_mode=mode).train()
        return torch.cat([g.flatten() for g in module.private_gradient(xs, ys).grads])

    torch.manual_seed(0)
    x, y = torch.randn(15, 8, dtype=torch.float32) * 3, torch.randint(0, 2, (15,))
    record = torch.randn(1, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float32) * 1e5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return removal_difference(released, CLIP, x, y, record, 0)


@pytest.mark.parametrize("mode", MODES)
def test_mixing_through_the_dropout_draws_is_refused(mode, monkeypatch):
    """3.73 C released before stop 60 (a strict ``xfail``): every check took the draws at their mean, where the
    statistic is 0. The gradient halves replaying the step's draws refuse it; without them it passes again."""
    released = _module_released("dropout", mode)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"
    monkeypatch.setattr(gradient_halves, "_refuse_mixing_through_draws", lambda *args, **kwargs: None)
    assert _module_released("dropout", mode) > 3


@pytest.mark.parametrize("mode", MODES)
def test_a_record_cannot_send_the_check_to_eval_mode_with_a_draw_that_has_a_mean(mode):
    """3.73 C released at 5eb66f5 (``rand``); the checks take it at its mean since: the losses reproduce, refused."""
    released = _module_released("eval", mode)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"


@pytest.mark.parametrize("mode", MODES)
def test_a_record_cannot_send_the_check_to_eval_mode(mode, monkeypatch):
    """3.73 C released at stop 57 (a strict ``xfail``, warned): ``randint`` has no mean, so the record's losses did
    not reproduce and the gradient halves ran in eval mode, where the train-only statistic is off. The checks take
    it at the middle of its range since stop 58 (``checks._middle_of_range``): refused in training mode. Without
    that stand-in, the comparison replaying the step's draws, which runs before eval mode since stop 61, refuses it
    too."""
    released = _module_released("eval-randint", mode)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"
    monkeypatch.delitem(checks._MEANS, torch.ops.aten.randint_like)  # (as at stop 57)
    released = _module_released("eval-randint", mode)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"
    monkeypatch.setattr(gradient_halves, "_refuse_mixing_through_draws", lambda *args, **kwargs: False)
    assert _module_released("eval-randint", mode) > 3


@pytest.mark.parametrize("mode", MODES)
def test_a_tiny_bert_through_dpsgd_is_not_refused(mode):
    """One of the sweep's honest models: DPSGD on a tiny BERT, dropout 0.1 in train mode, fixed-shape chunks of 4 and
    micro-batches, padded batches of 2, 5 and 8, each a first (checked) batch of its structure."""
    from lit_zodp.backbones import HFSequenceClassifier
    from lit_zodp.backbones.huggingface import tiny_bert_config

    config = tiny_bert_config(vocab_size=50, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    for options in (dict(fixed_forward_rows=4), dict(micro_batch_size=3)):
        torch.manual_seed(0)
        module = DPSGD(HFSequenceClassifier(config=config, num_classes=2).float(), lr=1e-3, clip=0.5,
                       noise_multiplier=1.0, delta=1e-5, grad_mode=mode, **options).train()
        for size in (2, 5, 8):
            generator = torch.Generator().manual_seed(size)
            lengths = torch.randint(2, 9, (size,), generator=generator)
            mask = (torch.arange(8)[None] < lengths[:, None]).long()
            ids = torch.randint(2, 50, (size, 8), generator=generator) * mask
            y = torch.randint(0, 2, (size,), generator=generator)
            clipped = module.private_gradient({"input_ids": ids, "attention_mask": mask}, y)
            assert clipped.batch_size == size and all(torch.isfinite(g).all() for g in clipped.grads)


class _RowCountBackward(torch.autograd.Function):
    """Identity forward; the backward multiplied by ``of_rows(len(y))`` (the batch's row count)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, of_rows) -> torch.Tensor:
        ctx.scale = of_rows(len(y))
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _RowCountLoss(Backbone):
    """One ``Linear`` whose ``per_example_loss`` multiplies every loss (``backward_only``: every loss's gradient) by
    ``of_rows(len(x))``, a function of the batch's row count: ``1 / len(x)`` (a mean's convention), or 1 up to 16
    rows and 0 beyond. ``above``: only the rows whose first feature is above it (7 of the 16 batch-mates at
    :data:`SOME_ROWS`)."""

    num_classes = 2

    def __init__(self, of_rows, backward_only: bool = False, above: float = -math.inf):
        super().__init__()
        self.fc = nn.Linear(8, 2)
        self.of_rows, self.backward_only, self.above = of_rows, backward_only, above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    def per_example_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        some = (x[:, 0] > self.above)[:, None]
        logits = self(x)
        if self.backward_only:
            logits = torch.where(some, _RowCountBackward.apply(logits, self.of_rows), logits)
            return F.cross_entropy(logits, targets, reduction="none")
        return F.cross_entropy(logits, targets, reduction="none") * torch.where(some[:, 0], self.of_rows(len(x)), 1.0)


def _row_count_batch():
    """16 aligned inputs (norm 0.9) labelled against the class they lean to, and a record of the same input labelled
    the other way (its gradient points against theirs)."""
    torch.manual_seed(0)
    model = _RowCountLoss(None).float()
    mu = torch.randn(8, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    mu = mu / mu.norm()
    label = 1 - int((model.fc.weight.detach() @ mu).argmax())
    x = 0.9 * mu + 0.05 * torch.randn(16, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    return x, torch.full((16,), label), 0.9 * mu[None], 1 - label


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_divided_by_the_row_count_is_refused_by_the_gradient_halves(mode):
    """1.50 C released at 5eb66f5: the bare engine given ``losses_of``; ``loss / len(x)`` halves every gradient on a
    half alone (refused there), but each half run in the batch's shape (``_in_place``) has the whole's row count,
    and that measure replaced the first. Unclipped batch-mates (``C = 0.075``): removing the record scales each of
    their terms by 17/16. Now refused: most rows' losses (two or more suffice since stop 58) moved on the halves
    alone (``_moves_rows_losses``)."""
    x, y, record, label = _row_count_batch()
    torch.manual_seed(0)
    model = _RowCountLoss(lambda rows: 1.0 / rows).float()
    with pytest.raises(PrivacyConfigError, match="row count"):
        PerExampleGradientEngine(model, mode=mode).clipped_sum(lambda: model.per_example_loss(x, y), 0.075,
                                                               losses_of=lambda r: model.per_example_loss(x[r], y[r]))
    released = _released(model, lambda xs, ys: model.per_example_loss(xs, ys), mode, 0.075, x, y, record, label,
                         losses_of=True)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"


def _row_count_released(mode: str, of_rows, clip: float, backward_only: bool = True,
                        above: float = -math.inf) -> float:
    """Through ``DPSGD.private_gradient``, a fresh module per batch with the module's loss halves pending (a fit's
    first batch: every check runs on both)."""
    x, y, record, label = _row_count_batch()

    def released(xs, ys):
        torch.manual_seed(0)
        module = DPSGD(_RowCountLoss(of_rows, backward_only=backward_only, above=above).float(), clip=clip,
                       noise_multiplier=1.0, delta=1e-5, lr=1e-3, grad_mode=mode).train()
        module._pending_checks = {"halves"}
        return torch.cat([g.flatten() for g in module.private_gradient(xs, ys).grads])

    return removal_difference(released, clip, x, y, record, label)


def _switched_off_above_16(rows: int) -> float:
    return float(rows <= 16)


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_scaled_by_the_row_count_is_refused(mode):
    """15.8 C released at stop 57 (a strict ``xfail``): the gradient alone switched off above 16 rows (the losses
    untouched: the module's loss halves and the losses' row count rule see nothing), and the record's batch of 17
    rows zeroed every batch-mate's gradient. The gradient halves now also run the rows without one alone
    (:func:`gradient_halves._refuse_row_count`), and name the row count."""
    x, y, record, label = _row_count_batch()
    x, y = torch.cat([x, record]), torch.cat([y, torch.tensor([label])])
    torch.manual_seed(0)
    model = _RowCountLoss(_switched_off_above_16, backward_only=True).float()
    with pytest.raises(PrivacyConfigError, match="depend on the batch's row count"):
        PerExampleGradientEngine(model, mode=mode).clipped_sum(
            lambda: model.per_example_loss(x, y), 1.0, losses_of=lambda r: model.per_example_loss(x[r], y[r]))
    released = _row_count_released(mode, _switched_off_above_16, 1.0)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"


#: The first feature above which 7 of the 16 batch-mates of :func:`_row_count_batch` lie.
SOME_ROWS = float(_row_count_batch()[0][:, 0].sort().values[8])


def _stop57_rules(monkeypatch):
    """The rules of stop 57: no rows without one, and a shape-explained mismatch refused where most rows moved."""
    def most_rows(ratio):
        moved = int((ratio > 1.0).sum())
        return float(ratio.max()) if moved >= 2 and 2 * moved > len(ratio) else min(float(ratio.max()), 1.0)

    monkeypatch.setattr(checks, "_beyond_one_removal", lambda *args, **kwargs: 0.0)
    monkeypatch.setattr(checks, "beyond_one_row", most_rows)
    monkeypatch.setattr(gradient_halves, "beyond_one_row", most_rows)
    monkeypatch.setattr(gradient_halves, "_refuse_row_count", lambda *args: None)


@pytest.mark.parametrize("backward_only", [False, True], ids=["loss", "backward"])
@pytest.mark.parametrize("mode", MODES)
def test_a_row_count_read_by_some_rows_only_is_refused(mode, backward_only, monkeypatch):
    """Stop 58: the loss (or its backward alone) of 7 of the 16 batch-mates switched off above 16 rows. Under the
    rule "refused where most rows move" (the forward checks', and the losses' in the gradient halves) every check
    passed it: the same record released 7.8 C. Now two rows moving with the shape are refused, and every check
    compares the rows without one (the neighbouring row count)."""
    released = _row_count_released(mode, _switched_off_above_16, 1.0, backward_only, SOME_ROWS)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"
    _stop57_rules(monkeypatch)
    assert _row_count_released(mode, _switched_off_above_16, 1.0, backward_only, SOME_ROWS) > 7


def _off_at_16_rows(rows: int) -> float:
    return float(rows != 16)


@pytest.mark.parametrize("backward_only", [False, True], ids=["loss", "backward"])
@pytest.mark.parametrize("mode", MODES)
def test_a_row_count_read_only_at_the_neighbours_count_is_refused_at_the_records_batch(mode, backward_only,
                                                                                        monkeypatch):
    """A scale equal at the halves' row counts (8 and 9) and at the record's batch (17), changed at 16 rows: the
    halves of the record's batch agree, so only the rows without one (16) show it. Every batch-mate's gradient
    switched off without the record: under stop 57's rules the record's batch passed, and the backward alone
    released 15.0 C on the removal (the scaled loss was refused at the neighbour's batch, whose halves moved every
    row: a refusal that tells the record was missing)."""
    x, y, record, label = _row_count_batch()
    x, y = torch.cat([x, record]), torch.cat([y, torch.tensor([label])])
    torch.manual_seed(0)
    module = DPSGD(_RowCountLoss(_off_at_16_rows, backward_only=backward_only).float(), clip=1.0,
                   noise_multiplier=1.0, delta=1e-5, lr=1e-3, grad_mode=mode).train()
    module._pending_checks = {"halves"}
    with pytest.raises(PrivacyConfigError, match="depend on (their batch-mates|the batch's row count)"):
        module.private_gradient(x, y)
    if backward_only:
        assert _row_count_released(mode, _off_at_16_rows, 1.0) <= MARGIN
        _stop57_rules(monkeypatch)
        assert _row_count_released(mode, _off_at_16_rows, 1.0) > 14


@pytest.mark.xfail(strict=True, reason="open: a bfloat16 model's gradient halves run in bfloat16 with a tolerance of "
                                       "sqrt(2^-7) of the norms' term (4.48 C at B = 16)")
@pytest.mark.parametrize("losses_of", [False, True], ids=["calls", "losses"])
def test_mixing_below_a_bfloat16_models_tolerance_is_refused(losses_of, monkeypatch):
    """Review 67's scaled backward and aligned batch (its autocast attack, closed for float32 models by checking them
    in float32) on a model whose parameters are bfloat16: the check cannot drop to float32, and its unit is
    ``min(sqrt(eps), 256 eps) = 0.088``: a record ``-3000 mu`` releases 4.48 C at ``B = 16`` (16.8 C at ``B = 64``,
    ``-6000 mu``). (Since stop 58 the rows without one secret row refuse it when that row is the record's, one draw
    in 17: the test leaves out a batch-mate, as 16 draws in 17 do.)"""
    monkeypatch.setattr(gradient_halves, "secret_row", lambda size: torch.tensor([0]))
    model, x, y, direction, label = _aligned_batch(16)
    model = model.to(torch.bfloat16)
    released = _released(model, lambda xs, ys: F.cross_entropy(model(xs).float(), ys, reduction="none"), "hooks", 1.0,
                         x.to(torch.bfloat16), y, (direction * 3000.0).to(torch.bfloat16), label, losses_of=losses_of)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"
