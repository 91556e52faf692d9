"""Red-team review 67 (2026-11-30): attacks on the clipped gradients' halves (``per_example/gradient_halves.py``,
1a6d9aa) and on its interplay with the other checks, by one crafted record (the harness of
``test_pe_conv_tf32_attacks.py``: ``||S(D) - S(D')|| / C`` for one removal, each batch a first batch of its structure,
so every check runs on both). The model is review 65's: a user's ``autograd.Function`` whose forward is the identity
and whose backward divides the gradient by ``1 + 1e-6 * mean_b ||x_b||^2`` (a batch statistic), which only the new
check sees; a record of large norm shrinks every batch-mate's gradient.

Fixed here:

* A non-batch-first output of the engine's module (sequence-first ``[T, B, 2]``, or transposed ``[2, B]``):
  ``_cotangent`` returned ``None`` for it, so the check compared nothing and passed silently: 3.73 C released on
  one removal (every mode, ``B = 16``, ``C = 0.1``; 5.80 C with the model drawn in float32). The output gradient's
  batch dimension is now located (its only dimension of ``B``: ``_batch_dim``) and moved to the front in every run.
* Under a bfloat16 autocast the check recomputed in bfloat16 with a tolerance of ``sqrt(2^-7)`` of the norms (256
  times float32's): the scaled backward below, a record ``-2000 mu`` against 15 aligned batch-mates, released 2.41 C
  at ``B = 16`` (4.48 C at ``-3000 mu``). Every run of the check is its own (only the step's output gradients are
  reused, as weights), so for a model whose parameters, buffers and inputs are float32 or wider it now runs without
  the autocast, with float32's tolerance: refused. The honest models below under that autocast (BERT, RoBERTa,
  GPT-2, OPT, Llama, LSTM, 216 steps) pass the new check, largest gap 1.9e-4 of the float32 tolerance's norms' term
  (one BERT step, seed 1, ``B = 8``, "hooks", was refused once by the coverage check's fallback, pre-existing and
  not reproduced in 12 reruns).
* Fixed by the lead after the review (its unit now ``min(sqrt(eps), 256 eps)``, ``gradient_halves.tolerance_unit``:
  honest gaps measured 0.30-0.35 ``eps`` on the packaged MiniLM and a ViT-tiny at ``B = 32``): mixing below the
  tolerance ``sqrt(eps) (sum_r c_r ||g_r|| + ||G_whole|| + ||G_1|| + ||G_2||)``, which grows with
  ``B`` while the honest rounding gap stays near ``eps`` times the norms: the scaled backward, batch-mates whose
  gradients are aligned and unclipped, and a record ``-scale * mu`` whose clipped gradient points against theirs:
  1.07 C at ``B = 64`` (scale 600), 1.56 C at ``B = 256`` (scale 1500; 2.07 C at 2000 on every draw of the halves;
  2.83 C at 2500, refused on most draws), float32. On the honest models below the largest gap measured was 2.4e-4
  of ``sqrt(eps)`` times the norms' term (about ``0.7 eps`` of it): a tolerance nearer ``eps`` (with a margin for
  deep reductions) would close most of this.

Open (strict ``xfail``):

* A ``loss_fn`` that calls the module's children, never the module itself: no call of the engine's module is
  recorded, so neither the forward halves nor the gradient halves run at all. Review 64's detached batch mean
  (``alpha = 1e-4``) with a random record times 1e5: 6.54 C released (14.0 C at ``alpha = 1e-2``). Refusing such a
  step (tried after the review) refused the package's own ``HFAnswerGenerator`` and GEP's ``per_example_loss``
  path, whose losses call submodules or a method: in those fits only the modules' loss halves
  (``AlgorithmModule.run_independence_checks``) compare the batch.
* The same scale in ``loss_fn`` after the module: the check reuses the step's output gradients ``dL_r / d out_r``,
  which hold it, and the forward checks never see a backward: 3.73 C (every mode). Only a check that recomputes the
  losses' gradients on the halves (the first-order module's, whose ``per_example_loss`` can run on a half) can.
  (A backbone whose ``per_example_loss`` applies it fits DOPE-SGD, DP-Adam and DP-GRaPE without a refusal: the
  module's loss halves compare the losses, which the identity forward leaves alone.)
* A flattened output (``[2B]``, as an LM's ``logits.view(-1, V)``): no dimension of ``B``, not compared: 3.73 C.
* A record with an infinite feature: its loss is not finite (factor 0), its batch statistic (``inf``) scales every
  batch-mate's backward to 0, and the first attempt's whole-batch gradient is NaN (``0 * inf`` in a weight
  gradient), so the second attempt compares the other rows without it, whose gradients are then ordinary: 3.81 C
  (every mode). The step's own clipped sum of the finite rows is what the second attempt's whole would have to
  match (or a non-finite first attempt refused).

Known and warned then, fixed at stop 57: a forward random beyond dropout (``RReLU``) sent both halves checks to eval
mode, so a scale active only in training passed them (4.16 C, with the warning that training mode went unchecked).
The checks' recomputations now take RReLU's slopes (and Gaussian, uniform, exponential draws) at their means
(:class:`~lit_zodp.per_example.checks.MeanOfRandomDraws`), so they stay in training mode: refused below.

No false refusal by the new check: tiny BERT, RoBERTa, GPT-2, OPT and Llama (``HFSequenceClassifier(config=...)``,
dropout 0.1 in train mode) and the LSTM backbone, every mode, seeds 0-2, ``B`` 2, 3, 5, 8 (216 steps; 144 of them
again with ``keep_call_shape``), and a timm ViT (``TimmClassifier``, dropout 0.1 with ``cls_token``/``pos_embed``
frozen, and without dropout: 72 steps): largest gap 2.4e-4 of ``sqrt(eps)`` times the norms' term; one of them is
kept below. Review 66's fix (``engine._rows_seen``) re-read: positions a half's recomputed input lacks are padding for
every row of that half, which a masked model's gradients do not read; no break found.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_zodp.errors import PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine, gradient_halves
from tests.per_example import test_pe_conv_tf32_attacks as review64
from tests.per_example.test_pe_layer_inputs_attacks import _BackwardScaledNet, _BatchScaledBackward

MODES = ["hooks", "ghost", "bookkeeping"]
MARGIN = 1 + 1e-3
SCALE_F32, SCALE_BF16 = 1500.0, 2000.0


class _LaidOut(nn.Module):
    """Review 65's two-layer net (``scaled``: its output through the batch-scaled backward), its logits ``[B, 2]``
    returned as ``layout``: ``"seq"`` ``[4, B, 2]`` (sequence-first), ``"T"`` ``[2, B]``, ``"flat"`` ``[2B]``."""

    def __init__(self, layout: str, scaled: bool = True):
        super().__init__()
        self.net = _BackwardScaledNet() if scaled else None
        self.fc1, self.fc2 = (None, None) if scaled else (nn.Linear(8, 16), nn.Linear(16, 2))
        self.layout = layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.net(x) if self.net is not None else self.fc2(torch.relu(self.fc1(x)))
        layouts = {"seq": lambda: z[None].expand(4, -1, -1), "T": lambda: z.T, "flat": lambda: z.reshape(-1)}
        return layouts[self.layout]()


def _logits(out: torch.Tensor, layout: str, size: int) -> torch.Tensor:
    return {"seq": lambda: out.mean(0), "T": lambda: out.T, "flat": lambda: out.view(size, 2)}[layout]()


def _released(model: nn.Module, losses, mode: str, clip: float, x: torch.Tensor, y: torch.Tensor,
              record: torch.Tensor, label: int, *, losses_of: bool = False) -> float:
    """``||S(D) - S(D')|| / C`` (``losses(xs, ys)``: the per-example losses of ``loss_fn``; ``losses_of``: given to
    the engine too, as the package's modules do), 0 where refused."""
    def release(xs, ys):
        engine = PerExampleGradientEngine(model, mode=mode)
        rows_losses = (lambda rows: losses(xs[rows], ys[rows])) if losses_of else None
        clipped = engine.clipped_sum(lambda: losses(xs, ys), clip, losses_of=rows_losses)
        return torch.cat([g.flatten() for g in clipped.grads])

    return removal_difference(release, clip, x, y, record, label)


def removal_difference(release, clip: float, x: torch.Tensor, y: torch.Tensor, record: torch.Tensor,
                       label: int) -> float:
    """``||release(D + record) - release(D)|| / C`` (``release(xs, ys)``: the flat released sum), 0 where refused."""
    try:
        with_record = release(torch.cat([x, record]), torch.cat([y, torch.tensor([label], dtype=y.dtype)]))
        return float((with_record - release(x, y)).norm()) / clip
    except PrivacyConfigError:
        return 0.0


def _review65_batch():
    """Review 65's batch (15 inputs of norm ~8, ``C = 0.1``) and record (1e5 times an input's size)."""
    torch.manual_seed(0)
    x, y = torch.randn(15, 8, dtype=torch.float32) * 3, torch.randint(0, 2, (15,))
    record = torch.randn(1, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float32) * 1e5
    return x, y, record


def _laid_out_released(layout: str, mode: str) -> float:
    """Review 65's batch and record against the scaled backward behind an output laid out as ``layout``."""
    x, y, record = _review65_batch()
    torch.manual_seed(0)
    model = _LaidOut(layout).float()
    return _released(model, lambda xs, ys: F.cross_entropy(_logits(model(xs), layout, len(xs)), ys, reduction="none"),
                     mode, 0.1, x, y, record, 0)


@pytest.mark.parametrize("layout", ["seq", "T"])
@pytest.mark.parametrize("mode", MODES)
def test_a_backward_scale_behind_a_non_batch_first_output_is_refused(mode, layout):
    """3.73 C released at 1a6d9aa (the check skipped the output); honest models of these layouts pass."""
    x, y, record = _review65_batch()
    torch.manual_seed(0)
    honest = _LaidOut(layout, scaled=False).float()
    for size in (3, 5, 15):
        engine = PerExampleGradientEngine(honest, mode=mode)
        clipped = engine.clipped_sum(lambda: F.cross_entropy(_logits(honest(x[:size]), layout, size), y[:size],
                                                             reduction="none"), 0.1)
        assert all(torch.isfinite(g).all() for g in clipped.grads)
    released = _laid_out_released(layout, mode)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"


@pytest.mark.parametrize("losses_of", [False, True], ids=["refused-uncompared", "losses-recomputed"])
@pytest.mark.parametrize("mode", MODES)
def test_a_backward_scale_behind_a_flattened_output_is_refused(mode, losses_of):
    """3.73 C released at 1accfbd (an output ``[2B]`` has no dimension of ``B``: nothing compared, passed). Now such a
    step is refused as uncompared, or, given ``losses_of``, its losses are recomputed and the scale shows."""
    x, y, record = _review65_batch()
    torch.manual_seed(0)
    model = _LaidOut("flat").float()
    losses = lambda xs, ys: F.cross_entropy(_logits(model(xs), "flat", len(xs)), ys, reduction="none")  # noqa: E731
    if not losses_of:  # (any batch: nothing to compare)
        with pytest.raises(PrivacyConfigError, match="could not be checked"):
            PerExampleGradientEngine(model, mode=mode).clipped_sum(lambda: losses(x, y), 0.1)
    released = _released(model, losses, mode, 0.1, x, y, record, 0, losses_of=losses_of)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"


@pytest.mark.parametrize("mode", MODES)
def test_an_honest_flattened_output_passes_given_its_losses(mode):
    """The same layout without the scaled backward: the recomputed losses' halves agree (no false refusal)."""
    x, y, _ = _review65_batch()
    torch.manual_seed(0)
    model = _LaidOut("flat", scaled=False).float()
    losses = lambda xs, ys: F.cross_entropy(_logits(model(xs), "flat", len(xs)), ys, reduction="none")  # noqa: E731
    for size in (2, 5, 15):
        clipped = PerExampleGradientEngine(model, mode=mode).clipped_sum(
            lambda: losses(x[:size], y[:size]), 0.1, losses_of=lambda rows: losses(x[rows], y[rows]))
        assert clipped.batch_size == size and all(torch.isfinite(g).all() for g in clipped.grads)


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_scale_in_the_loss_after_the_module_is_refused_given_its_losses(mode):
    """3.73 C released at 1accfbd: the check weighted the module's recomputed outputs by the step's output gradients,
    which hold a scale applied in ``loss_fn`` after the module. Given ``losses_of`` the losses are recomputed. (A
    bare engine without it cannot see ``loss_fn``'s arithmetic after the module: the package's modules pass it.)"""
    x, y, record = _review65_batch()
    torch.manual_seed(0)
    model = _LaidOut("seq", scaled=False).float()

    def losses(xs, ys):
        logits = _logits(model(xs), "seq", len(xs))
        return F.cross_entropy(_BatchScaledBackward.apply(logits, xs.detach().pow(2).sum(1).mean()), ys,
                               reduction="none")

    released = _released(model, losses, mode, 0.1, x, y, record, 0, losses_of=True)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"


@pytest.mark.parametrize("losses_of", [False, True], ids=["refused-uncompared", "losses-recomputed"])
@pytest.mark.parametrize("mode", MODES)
def test_a_loss_that_calls_only_the_modules_children_is_checked(mode, losses_of):
    """Review 64's model (a detached batch mean, ``alpha = 1e-4``, refused when ``loss_fn`` calls it) run by a
    ``loss_fn`` that calls ``conv`` and ``fc`` itself: 6.54 C released at 1accfbd (no call of the module, no check).
    Now refused as uncompared, or, given ``losses_of``, by the recomputed losses' halves."""
    model, x, _ = review64._problem(alpha=1e-4)
    y = torch.zeros(len(x), dtype=torch.long)

    def losses(xs, ys):
        h = F.relu(model.conv(xs)).flatten(1)
        return F.cross_entropy(model.fc(h + model.alpha * h.mean(0, keepdim=True).detach()), ys, reduction="none")

    with pytest.raises(PrivacyConfigError, match="batch-mates"):  # the same model called as a whole: refused
        review64._removal_difference(model, x, y, review64._random_record() * 1e5, mode)
    released = _released(model, losses, mode, review64.CLIP, x, y, review64._random_record() * 1e5, 0,
                         losses_of=losses_of)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"


class _ScaledLinear(nn.Module):
    """One ``Linear`` whose output goes through the batch-scaled backward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BatchScaledBackward.apply(self.fc(x), x.detach().pow(2).sum(1).mean())


def _aligned_batch(size: int):
    """``size - 1`` inputs near one direction ``mu`` (norm ~1), all labelled with the class ``-mu`` does not lean
    to: unclipped gradients (``C = 1``) that point alike; the record, ``-scale * mu`` with that label, has a clipped
    gradient pointing against theirs. Returns the model, the batch, ``-mu`` and the label."""
    torch.manual_seed(0)
    model = _ScaledLinear().float()
    mu = torch.randn(8, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    mu = mu / mu.norm()
    label = 1 - int((model.fc.weight.detach() @ -mu).argmax())
    x = mu + 0.3 * torch.randn(size - 1, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    return model, x, torch.full((size - 1,), label, dtype=torch.long), -mu[None], label


@pytest.mark.parametrize("size,scale", [(64, 600.0), (256, SCALE_F32), (256, 2000.0)])
@pytest.mark.parametrize("mode", MODES)
def test_mixing_below_the_tolerance_of_a_large_batch_is_refused(mode, size, scale):
    """1.07 C at B = 64, 1.56 C and 2.07 C at B = 256 with the tolerance's unit sqrt(eps) (f1d8dba); 256 eps now."""
    model, x, y, direction, label = _aligned_batch(size)
    released = _released(model, lambda xs, ys: F.cross_entropy(model(xs), ys, reduction="none"), mode, 1.0, x, y,
                         direction * scale, label)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"


@pytest.mark.parametrize("mode", MODES)
def test_mixing_under_a_bfloat16_autocast_is_refused(mode):
    """2.41 C released at 1a6d9aa (the check recomputed under the forward's bfloat16 autocast, its tolerance
    ``sqrt(2^-7)`` of the norms); a float32 model's check now runs in float32."""
    model, x, y, direction, label = _aligned_batch(16)

    def losses(xs, ys):
        return F.cross_entropy(model(xs).float(), ys, reduction="none")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        released = _released(model, losses, mode, 1.0, x, y, direction * SCALE_BF16, label)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bfloat16-autocast"])
@pytest.mark.parametrize("mode", MODES)
def test_a_tiny_gpt2_with_dropout_is_not_refused(mode, autocast):
    """One of the honest models of this review's sweep (no false refusal of the new check): GPT-2 in train mode,
    dropout 0.1, padded batches of 2, 3, 5 and 8, in float32 and under a CPU bfloat16 autocast."""
    from lit_zodp.backbones import HFSequenceClassifier

    torch.manual_seed(0)
    model = HFSequenceClassifier(config=dict(model_type="gpt2", vocab_size=50, n_embd=16, n_layer=2, n_head=2,
                                             n_positions=16, pad_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1,
                                             attn_pdrop=0.1), num_classes=2).float().train()
    for size in (2, 3, 5, 8):
        generator = torch.Generator().manual_seed(size)
        lengths = torch.randint(2, 7, (size,), generator=generator)
        mask = (torch.arange(6)[None] < lengths[:, None]).long()
        ids = torch.randint(2, 50, (size, 6), generator=generator) * mask
        y = torch.randint(0, 2, (size,), generator=generator)
        engine = PerExampleGradientEngine(model, mode=mode)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            clipped = engine.clipped_sum(lambda: F.cross_entropy(model({"input_ids": ids, "attention_mask": mask})
                                                                 .float(), y, reduction="none"), 1.0)
        assert all(torch.isfinite(g).all() for g in clipped.grads)


@pytest.mark.parametrize("mode", MODES)
def test_a_record_that_spoils_the_first_attempt_is_not_dropped_unchecked(mode):
    """A record with one infinite feature: its loss is not finite (factor 0), the batch statistic ``inf`` scales
    every batch-mate's backward to 0, and the first attempt's whole-batch gradient is NaN (``0 * inf`` in the weight
    gradient). The second attempt compares the 15 honest rows without the record, whose gradients then are ordinary:
    it passes, and one removal changes the released sum by the batch-mates' whole clipped sum."""
    x, y, _ = _review65_batch()
    torch.manual_seed(0)
    model = _BackwardScaledNet().float()
    record = torch.zeros(1, 8, dtype=torch.float32)
    record[0, 0] = float("inf")
    released = _released(model, lambda xs, ys: F.cross_entropy(model(xs), ys, reduction="none"), mode, 0.1, x, y,
                         record, 0)
    assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"


class _RReLUTrainingScaled(nn.Module):
    """Review 65's two-layer net with RReLU (random slopes in training) whose backward is scaled by a batch
    statistic only in training."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(8, 16), nn.Linear(16, 2), nn.RReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.fc2(self.act(self.fc1(x)))
        return _BatchScaledBackward.apply(logits, x.detach().pow(2).sum(1).mean()) if self.training else logits


@pytest.mark.parametrize("mode", MODES)
def test_a_training_only_scale_behind_rrelu_is_refused(mode, monkeypatch):
    """4.16 C released at 1accfbd: RReLU's random slopes sent the halves checks to eval mode (warned), where the
    scale is off. With the slopes at their mean the checks stay in training mode. Without that (RReLU's draws left
    random, as before) and without the comparisons replaying the step's draws before eval mode (stop 61: they refuse
    it where a split happens to draw as many slopes in every run), the same record releases more than C: the attack
    is real."""
    from lit_zodp.per_example import checks

    x, y, record = _review65_batch()
    torch.manual_seed(0)
    model = _RReLUTrainingScaled().float().train()
    losses = lambda xs, ys: F.cross_entropy(model(xs), ys, reduction="none")  # noqa: E731
    for losses_of in (False, True):
        released = _released(model, losses, mode, 0.1, x, y, record, 0, losses_of=losses_of)
        assert released <= MARGIN, f"one removal changed the released sum by {released:.3f} C"
    monkeypatch.delitem(checks._MEANS, torch.ops.aten.rrelu_with_noise)
    monkeypatch.setattr(PerExampleGradientEngine, "_refuse_mixing_through_draws", lambda *args, **kwargs: False)
    monkeypatch.setattr(gradient_halves, "_refuse_mixing_through_draws", lambda *args, **kwargs: False)
    with pytest.warns(UserWarning, match="compared it in eval mode"):
        assert _released(model, losses, mode, 0.1, x, y, record, 0) > 2
