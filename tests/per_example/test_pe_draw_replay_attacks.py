"""Red-team review 73 (2026-12-01): attacks on stop 60 (c85b596): at a step whose recomputations replaced a random
draw, the engine's forward check (``engine._refuse_mixing_through_draws``) and the gradient halves
(``gradient_halves._refuse_mixing_through_draws``) run again replaying the step's draws (``checks.Replay``) in the
batch's shape, each half's rows in place and the other half's positions holding copies of them. Measured as
``||S(D + record) - S(D)|| / C`` with the training randomness equal across the two runs (``removal_difference``), or
as refusal rates over re-checked steps with and without review 20's crafted record
(``tests/backbones/test_nfresnet_crafted.py``: a refusal only with it tells whether it was in the batch).

Fixed here:

1. A root module whose ``training`` flag is off (``model.eval()``, or a ``train()`` that leaves it off) that still
   draws in its forward: mixup ``lam x + (1 - lam) x[randperm(B)]`` drawn whatever the flag. The tape took the
   generators' states only for a root in training mode, so both replays had no state: the forward's returned at
   once, and the gradient halves' "replayed" runs took every draw at its stand-in (``randperm`` the identity) again,
   where nothing mixes, and said the runs drew alike. 2.33 C released on one removal through the engine without
   ``losses_of`` (``B = 16``, ``C = 0.1``, every mode, no warning; 2.90 C with other draws); through ``DPSGD``
   (which passes ``losses_of``, replayed from the loss's own state) it was refused. The tape now takes the states in
   either mode: refused by the forward's replay.
   The same missing state refused an honest model: review 20's standardised-convolution net in eval mode with only
   its dropout (0.1) in training (a frozen backbone, a live head's dropout), engine without ``losses_of``: the
   set-apart row's check (``_refuse_row_apart``) took the step's draws at their mean instead of replaying them, and
   refused the honest record at 7 of 8 re-checked steps, none of 8 without it (a refusal that tells membership);
   0 of 8 now.
2. Review 20's honest record beside padding rows (``fixed_forward_rows=16``, a Poisson batch of 12: four rows at
   weight 0), dropout 0.1: the gradient halves' replay sought a row rounding apart only where every row was in the
   sum (``len(in_sum) == size``), so the record's cancelling terms were refused as mixing at 10 of 12 re-checked
   steps, none of 12 without it (``DPSGD``, "hooks"; 0 of 12 with ``micro_batch_size=8`` or no option: no padding).
   The row is now sought among the rows in the sum, every run in the batch's shape with the others' positions
   holding copies of them at weight 0: 0 of 40 (none without the record; 0 of 40 with ``micro_batch_size=8`` and
   with no option).
3. The bisection that finds that row (``gradient_halves._one_row_certified``, every caller) went on in one half
   only; where zeroing either half passed (the record's rounding shows only beside one other row), it followed the
   half without the record half the time: with the same record and padding, 1 of 40 re-checked steps refused by the
   mean-draw halves ("the clip-weighted gradient ... differs from the sum of its two halves'"), and 1 of 12 with
   ``micro_batch_size=8``, none without it (at c85b596 too). Both halves are now searched where both pass: 0 of 40.
4. Mixing through a draw that moves one pair of rows: a ``per_example_loss`` negating each row's logits where the row
   ``randperm`` pairs it with is huge (norm 1e4, the record). The mean-draw runs pair each row with itself; the
   replay's one random split saw the pair only where it separated the record from its partner (about one split in
   two): 2.0 C released on one removal at 4 of 8 re-checked steps ("hooks"; 3 of 8 "ghost"), the others refused by
   ``gradient_halves._refuse_mixing_through_draws``. That check now runs on ``ceil(log2 B)`` splits by the bits of a
   secret random ranking of the rows (``gradient_halves.separating_splits``: every pair of rows lies apart in one),
   a row set apart on one at weight 0 on the later ones: none of 16 re-checked steps releases above ``C``, every
   mode. (Its cost at a checked step that drew: ``3 ceil(log2 B)`` replayed runs instead of 3. The engine's forward
   replay still takes one split; the gradient halves recompute the module's forward too.)

5. Fixed at stop 61 (it was a strict ``xfail``, warned): mixup inside the forward drawing from an explicit
   ``torch.Generator`` held by the model. ``MeanOfRandomDraws`` leaves such draws alone and ``Replay`` did not
   replay them, so the forward check fell back to eval mode and the step passed with a ``LitZodpWarning``: 3.77 C
   released on one removal (``B = 16``, ``C = 0.1``, every mode, ``DPSGD``); the same mixup in ``per_example_loss``
   2.83 C (stop 61's measurement). ``Replay`` now sets such a generator, at its first draw in each run, to where it
   stood at its first draw in the first run, and both replayed comparisons run before the eval-mode fallback: the
   forward's refuses the first, the gradient halves' the second; an honest model drawing noise and masks from its
   own generator is refused at none of its re-checked steps, and the engine no longer warns for it.

Commands: ``python -m pytest -q -p no:cacheprovider tests/per_example/test_pe_draw_replay_attacks.py`` (fixed ones
fail at c85b596: 2.33 C in every mode; 3 of 3 refused; the bisection picks the wrong half; 2.0 C released at
about half the steps).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from lit_zodp.backbones.base import Backbone
from lit_zodp.errors import PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine, gradient_halves
from tests.per_example.test_pe_dropout_replay_attacks import (MARGIN, MODES, _fixed_training_randomness, _InputMixup,
                                                              _LossMixup, _nfresnet_with_dropout, _rechecked_release,
                                                              _refusals)
from tests.per_example.test_pe_gradient_halves_attacks import removal_difference


def _mixup_batch():
    """Review 72's mixup batch (``B = 16``) and record."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(16, 8, generator=generator, dtype=torch.float32) * 3
    y = torch.randint(0, 2, (16,), generator=generator)
    record = torch.randn(1, 8, generator=generator, dtype=torch.float32) * 3
    return x, y, record


class _EvalFlagMixup(_InputMixup):
    """Mixup inside the forward drawn whatever the ``training`` flag, which its ``train()`` leaves off."""

    def train(self, mode: bool = True):
        super().train(mode)
        self.training = False
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lam = torch.distributions.Beta(2.0, 2.0).sample()
        x = lam * x + (1 - lam) * x[torch.randperm(len(x))]
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("mode", MODES)
def test_a_root_with_its_training_flag_off_cannot_mix_through_its_draws(mode):
    """Finding 1: 2.33 C released before (the engine without ``losses_of``, no warning); refused now."""
    x, y, record = _mixup_batch()
    torch.manual_seed(0)
    model = _EvalFlagMixup().float().train()
    engine = PerExampleGradientEngine(model, mode=mode)

    def released(xs, ys):
        torch.manual_seed(5)  # (the same draws in both runs)
        engine.recheck_next = True
        clipped = engine.clipped_sum(lambda: F.cross_entropy(model(xs), ys, reduction="none"), 0.1)
        return torch.cat([g.flatten() for g in clipped.grads])

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a check that warns its way past is not a pass)
        moved = removal_difference(released, 0.1, x, y, record, 1)
    assert moved <= MARGIN, f"one removal changed the released sum by {moved:.3f} C"


def test_review_20s_record_is_not_refused_by_a_root_in_eval_mode_with_dropout_in_training():
    """Finding 1, the honest side: 7 of 8 re-checked steps refused before with the record (none without it)."""
    def losses(model, x, y):
        return F.cross_entropy(model(x), y, reduction="none")

    def frozen_with_live_dropout():
        model = _nfresnet_with_dropout(0.1).eval()
        model.drop.train()
        return model

    assert _refusals(frozen_with_live_dropout(), losses, with_record=False, steps=3, losses_of=False) == (0, 0)
    refused, apart = _refusals(frozen_with_live_dropout(), losses, with_record=True, steps=3, losses_of=False)
    assert (refused, apart) == (0, 3)


class _StdConvDropout(Backbone):
    """Review 20's standardised-convolution net with dropout 0.1 before the head, as a backbone."""

    num_classes = 3

    def __init__(self):
        super().__init__()
        self.net = _nfresnet_with_dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _padded_refusals(with_record: bool, steps: int = 3) -> int:
    """Refusals of ``steps`` re-checked ``DPSGD`` steps (``fixed_forward_rows=16``, 12 rows: 4 padding rows at weight
    0, "hooks") after an honest first batch, with review 20's record first in the batch or an honest row there."""
    from lit_zodp.algorithms import DPSGD
    from tests.backbones.test_nfresnet_crafted import honest, null_space_record

    torch.manual_seed(0)
    module = DPSGD(_StdConvDropout().float(), lr=1e-3, clip=1e-3, noise_multiplier=1.0, delta=1e-5, grad_mode="hooks",
                   fixed_forward_rows=16).train()
    x, y = honest(12)
    refused = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(noise|sampling)_seed.*")
        module.private_gradient(x, y)  # (the structure's first, checked, batch: honest)
        first = null_space_record(1e10, 100.0) if with_record else 0.5 * x[:1]
        x = torch.cat([first, x[1:]])
        for _ in range(steps):
            module._pending_checks, module._recheck_pending = {"halves"}, True
            try:
                module.private_gradient(x, y)
            except PrivacyConfigError:
                refused += 1
    return refused


def test_review_20s_record_beside_padding_rows_is_not_refused_with_dropout():
    """Finding 2: refused at 10 of 12 re-checked steps before (none without the record); at 3 steps, 3 of 3."""
    assert _padded_refusals(with_record=False) == 0
    assert _padded_refusals(with_record=True) == 0


def test_the_bisection_searches_both_halves_where_both_pass():
    """Finding 3: a mismatch that shows only where row 5 and row 2 are both weighted (zeroing either passes), and
    only row 5 certified (its own runs agree: :func:`gradient_halves._among_copies`, row 5 alone weighted in the
    first): the search followed whichever half it split first, half the time the one without row 5 (each of 40
    searches finds it now)."""
    def zeroed(out: torch.Tensor) -> float:
        return 0.0 if bool(((out == 5) | (out == 2)).any()) else 10.0

    def ratio_of(parts) -> float:
        return 0.0 if parts[0][1].nonzero().flatten().tolist() == [5] else 10.0

    rows, weights = torch.arange(8), torch.ones(8, dtype=torch.float64)
    found = [gradient_halves._one_row_certified(ratio_of, zeroed, rows, weights, beside=False) for _ in range(40)]
    assert found == [5] * 40


class _ExplicitGeneratorMixup(_InputMixup):
    """:class:`_InputMixup` drawing ``lam`` and the permutation from a ``torch.Generator`` of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            generator = self.__dict__.setdefault("generator", torch.Generator().manual_seed(7))
            lam = torch.rand((), generator=generator) * 0.5 + 0.25
            x = lam * x + (1 - lam) * x[torch.randperm(len(x), generator=generator)]
        return self.fc2(torch.tanh(self.fc1(x)))


class _ExplicitGeneratorLossMixup(_LossMixup):
    """:class:`_LossMixup` drawing ``lam`` and the permutation from a ``torch.Generator`` of its own."""

    def per_example_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(x)
        if self.training:
            generator = self.__dict__.setdefault("generator", torch.Generator().manual_seed(7))
            lam = torch.rand((), generator=generator)
            logits = logits + 30 * (1 - lam) * logits[torch.randperm(len(x), generator=generator)].detach()
        return F.cross_entropy(logits, targets, reduction="none")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make, refusal", [(_ExplicitGeneratorMixup, "forward's random draws"),
                                           (_ExplicitGeneratorLossMixup, "step's random draws")])
def test_mixup_from_an_explicit_generator_is_refused(make, refusal, mode, monkeypatch):
    """Finding 5: 3.77 C (forward) and 2.83 C (loss) released on one removal before stop 61, with a warning."""
    from lit_zodp.algorithms import first_order

    monkeypatch.setattr(first_order, "secret_training_randomness", _fixed_training_randomness)
    x, y, record = _mixup_batch()
    release = _rechecked_release(make, 0.1, mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PrivacyConfigError, match=refusal):
            release(torch.cat([x, record]), torch.cat([y, torch.tensor([1])]))
        assert removal_difference(release, 0.1, x, y, record, 1) <= MARGIN


class _OwnGeneratorNoise(_InputMixup):
    """Honest: input noise and a dropout mask per row, drawn from a ``torch.Generator`` of the model's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            generator = self.__dict__.setdefault("generator", torch.Generator().manual_seed(7))
            x = x + 0.1 * torch.randn(x.shape, generator=generator, dtype=x.dtype)
            x = x * (torch.rand(x.shape, generator=generator, dtype=x.dtype) > 0.1) / 0.9
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("mode", MODES)
def test_an_honest_model_drawing_from_its_own_generator_is_checked_in_training_without_a_warning(mode):
    """Finding 5's honest side: replayed alike, the engine's checks give a verdict in training mode (no warning
    that its training mode went unchecked), at a first check and at re-checks."""
    x, y, _ = _mixup_batch()
    torch.manual_seed(0)
    model = _OwnGeneratorNoise().float().train()
    engine = PerExampleGradientEngine(model, mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a warning that training mode went unchecked fails it)
        for step in range(3):
            engine.recheck_next = True
            engine.clipped_sum(lambda: F.cross_entropy(model(x + 0.01 * step), y, reduction="none"), 0.1)


class _PairFlip(_LossMixup):
    """Each row's logits negated where the row ``randperm`` pairs it with has a norm above 1000 (the record)."""

    def per_example_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(x)
        if self.training:
            huge = (x.detach().norm(dim=1) > 1000).to(logits.dtype)
            logits = logits * (1 - 2 * huge[torch.randperm(len(x))])[:, None]
        return F.cross_entropy(logits, targets, reduction="none")


@pytest.mark.parametrize("mode", MODES)
def test_mixing_of_one_pair_through_a_draw_is_refused_at_every_checked_step(mode, monkeypatch):
    """Finding 4: 16 re-checked steps, each one removal, all refused (2.0 C at about one in two before)."""
    from lit_zodp.algorithms import first_order

    monkeypatch.setattr(first_order, "secret_training_randomness", _fixed_training_randomness)
    x, y, record = _mixup_batch()
    record = record / record.norm() * 1e4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moved = [removal_difference(_rechecked_release(_PairFlip, 0.1, mode), 0.1, x, y, record, 1)
                 for _ in range(16)]
    assert max(moved) <= MARGIN, f"released {max(moved):.2f} C at {sum(m > MARGIN for m in moved)} of 16 steps"


def test_the_separating_splits_set_every_pair_of_rows_apart():
    for size in (2, 3, 5, 16, 17, 33):
        splits = gradient_halves.separating_splits(size)
        assert len(splits) == max(1, (size - 1).bit_length())
        apart = torch.zeros(size, size, dtype=torch.bool)
        for first, second in splits:
            assert len(first) and len(second) and sorted([*first.tolist(), *second.tolist()]) == list(range(size))
            apart[first[:, None], second[None, :]] = True
        assert bool((apart | apart.T | torch.eye(size, dtype=torch.bool)).all())
