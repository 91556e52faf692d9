"""Activation checkpointing: non-reentrant is exact, with dropout inside too; reentrant (which torch refuses under the
engine's ``autograd.grad``, from inside the backward) is refused first, in one line naming the fix."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lit_zodp.errors import PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine
from tests.per_example.helpers import ce, tiny_bert

MODES = ["hooks", "ghost", "bookkeeping"]


class _Block(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.a, self.b, self.dropout = nn.Linear(8, 16), nn.Linear(16, 8), dropout

    def forward(self, x):
        return self.b(F.dropout(torch.tanh(self.a(x)), self.dropout, self.training))


class _Checkpointed(nn.Module):
    def __init__(self, reentrant=None, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.blocks = nn.Linear(8, 8), nn.ModuleList([_Block(dropout), _Block(dropout)])
        self.head, self.reentrant = nn.Linear(8, 3), reentrant

    def forward(self, x):
        x = self.stem(x)  # the checkpointed blocks' input requires grad (else reentrant gives them none at all)
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x.mean(1))


def _clipped(model, mode, batches=1):
    """The clipped sums of ``batches`` batches on one engine: the first checks the new structure
    (alignment and coverage backwards, which also recompute the checkpointed blocks), the later not."""
    engine, results = PerExampleGradientEngine(model, mode=mode), []
    for b in range(batches):
        torch.manual_seed(1 + b)
        x, y = torch.randn(6, 5, 8), torch.randint(0, 3, (6,))
        results.append(engine.clipped_sum(lambda: ce(model(x), y), 0.1))
    return results if batches > 1 else results[0]


@pytest.mark.parametrize("mode", MODES)
def test_non_reentrant_checkpointing_gives_the_plain_clipped_sum(mode):
    plain, checkpointed = _clipped(_Checkpointed(), mode, 2), _clipped(_Checkpointed(reentrant=False), mode, 2)
    for mine, theirs in zip(checkpointed, plain):
        for a, b in zip(mine.grads, theirs.grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(mine.norms, theirs.norms)


@pytest.mark.parametrize("mode", MODES)
def test_non_reentrant_checkpointing_with_dropout_gives_the_plain_clipped_sum(mode):
    """Dropout 0.3 inside the checkpointed blocks: the plain twin draws the same masks (torch's checkpoint restores the
    generators' states in the backward), and the checks' runs draw as their forward did in their backward too (at
    the mean, or the step's masks again): refused as mixing at the first step before (red-team review 77, finding
    7)."""
    plain = _clipped(_Checkpointed(dropout=0.3), mode, 2)
    for mine, theirs in zip(_clipped(_Checkpointed(reentrant=False, dropout=0.3), mode, 2), plain):
        for a, b in zip(mine.grads, theirs.grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(mine.norms, theirs.norms)


@pytest.mark.parametrize("mode", MODES)
def test_reentrant_checkpointing_is_refused_in_one_line(mode):
    with pytest.raises(PrivacyConfigError, match="use_reentrant=False") as info:
        _clipped(_Checkpointed(reentrant=True), mode)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_hugging_face_gradient_checkpointing_gives_the_plain_clipped_sum(dropout):
    """``dropout``: the hidden and attention dropout of tiny BERT (0.1 refused at the first step before, red-team
    review 77, finding 7)."""
    ids, y = torch.randint(1, 50, (4, 5)), torch.tensor([0, 1, 1, 0])

    def clipped(model):
        torch.manual_seed(3)
        return PerExampleGradientEngine(model).clipped_sum(lambda: ce(model(input_ids=ids).logits, y), 0.1)

    plain, model = clipped(tiny_bert(dropout=dropout).train()), tiny_bert(dropout=dropout)
    model.gradient_checkpointing_enable()
    model.train()
    for a, b in zip(clipped(model).grads, plain.grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _recorded_calls(model, mode):
    """How many layer and module calls the tape records over two batches."""
    from lit_zodp.per_example import tape

    counts = {"layer": 0, "module": 0}

    def counting(cls, kind):
        class Counted(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                counts[kind] += 1
        return Counted

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tape, "LayerCall", counting(tape.LayerCall, "layer"))
        patch.setattr(tape, "ModuleCall", counting(tape.ModuleCall, "module"))
        _clipped(model, mode, 2)
    return counts


@pytest.mark.parametrize("mode", MODES)
def test_the_forward_checkpointing_runs_again_in_the_backward_is_not_recorded(mode):
    """Those calls get no gradient; recorded, they would hold their activations to the batch's end."""
    plain = _recorded_calls(_Checkpointed(), mode)
    assert plain == {"layer": 2 * 6, "module": 2}
    assert _recorded_calls(_Checkpointed(reentrant=False), mode) == plain


class _PositionBlock(nn.Module):
    """A checkpointed block holding a position embedding called with shared ``[1, T]`` ids."""

    def __init__(self):
        super().__init__()
        self.positions, self.mix = nn.Embedding(5, 8), nn.Linear(8, 8)

    def forward(self, x):
        ids = torch.arange(x.shape[1]).unsqueeze(0)
        return self.mix(torch.tanh(x + self.positions(ids)))


class _CheckpointedPositions(nn.Module):
    def __init__(self, checkpointed):
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.block, self.head = nn.Linear(8, 8), _PositionBlock(), nn.Linear(8, 3)
        self.checkpointed = checkpointed

    def forward(self, x):
        x = self.stem(x)
        x = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.head(x.mean(1))


@pytest.mark.parametrize("mode", MODES)
def test_a_checkpointed_shared_position_embedding_is_broadcast_again_when_run_again(mode):
    """The forward run again in the backward must save the ``[B, T]`` ids the first one saved."""
    plain = _clipped(_CheckpointedPositions(False), mode, 2)
    for mine, theirs in zip(_clipped(_CheckpointedPositions(True), mode, 2), plain):
        for a, b in zip(mine.grads, theirs.grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
