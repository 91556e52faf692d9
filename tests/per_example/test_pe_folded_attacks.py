"""Red-team review 66 (2026-11-30): attacks on the folded calls' halves (``engine._refuse_folded_mixing``, 08efe51).
Fixed: a recomputed input shorter than the step's is compared on the positions both hold (``engine._rows_seen``).
Fixed after it: a pre-existing false refusal of a tiny OPT batch holding a one-token sequence (the alignment check
rechecks a row that is its own rounding noise with its example's weight a power of two: ``alignment``'s
docstring); a row that also holds another example's part is still misaligned.

A folded call's recomputed input is compared only where it has ``n * k`` rows for the step's ``k``
(``engine._rows_seen``); otherwise the step's own rows are used (nothing compared). A model that trims its padding to
the batch's longest sequence (an ordinary efficiency step: each example's output unchanged) runs its folded ``Linear``
on ``[n * k', H]`` rows with ``k' < k`` on a half whose longest sequence is shorter than the batch's. A record that is
the batch's only longest sequence then leaves the half without it unchecked, and with a detached batch *sum*
(``alpha * h.sum(0)``: the record's half sees the same record, so its shift moves by the other half's small features
only) the review-64 null-space trick returns: the record's features at the batch-mates' positions lie in the null
space of the folded ``fc`` (module outputs within rounding), its last position (beyond every batch-mate's length)
carries large ordinary features so its own output row is large enough that its float32 rounding passes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lit_zodp.errors import PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine
from tests.per_example.test_pe_conv_tf32_attacks import _release, _released_or_refused

CLIP = 1.0
BATCH = 16
LENGTH = 4
WIDTH = 64
MODES = ["hooks", "ghost", "bookkeeping"]


class TrimmedSummedNet(nn.Module):
    """Sequences ``[B, L, 64]`` zero-padded at the end; trimmed to the batch's longest; a ``Linear``, ReLU, a detached
    batch sum (``alpha``) and a folded ``Linear`` on ``[B*L', 64]`` rows, summed over the valid positions."""

    def __init__(self, alpha: float, folded: bool = True, trim: bool = True):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.fc = nn.Linear(WIDTH, 2)
        self.alpha, self.folded, self.trim = alpha, folded, trim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x.abs().sum(-1) > 0
        length = int(mask.sum(1).max()) if self.trim else x.shape[1]
        x, mask = x[:, :length], mask[:, :length]
        h = F.relu(self.inp(x))
        h = h + self.alpha * h.sum(0, keepdim=True).detach()
        z = self.fc(h.reshape(-1, WIDTH)).reshape(len(x), length, 2) if self.folded else self.fc(h)
        return (z * mask[..., None]).sum(1)


def _problem(alpha: float, folded: bool = True, trim: bool = True):
    torch.manual_seed(0)
    model = TrimmedSummedNet(alpha, folded, trim).float()
    x = torch.randn(BATCH - 1, LENGTH, WIDTH, dtype=torch.float32)
    lengths = torch.randint(1, LENGTH, (BATCH - 1,))  # every honest sequence shorter than LENGTH
    x = x * (torch.arange(LENGTH)[None, :] < lengths[:, None])[..., None].float()
    y = torch.randint(0, 2, (BATCH - 1,))
    return model, x, y


def _record(model: TrimmedSummedNet, scale: float, tail: float) -> torch.Tensor:
    """Positions 0..L-2: features ``scale * h`` with ``h > 0`` in the null space of ``fc`` (``inp`` inverted);
    position L-1: an ordinary input times ``tail`` (a large output of the record's own)."""
    w = model.fc.weight.detach().double()
    a, b = model.inp.weight.detach().double(), model.inp.bias.detach().double()
    generator = torch.Generator().manual_seed(5)
    h = 1 + 0.5 * torch.rand(WIDTH, generator=generator, dtype=torch.float64)
    h = h - w.T @ torch.linalg.solve(w @ w.T, w @ h)
    assert bool((h > 0).all())
    h = h / h.norm() * scale
    x = torch.linalg.solve(a, h - b)
    record = torch.zeros(1, LENGTH, WIDTH, dtype=torch.float64)
    record[0, :LENGTH - 1] = x
    record[0, LENGTH - 1] = tail * torch.randn(WIDTH, generator=generator, dtype=torch.float64)
    return record.float()


@pytest.mark.parametrize("folded", [True, False], ids=["folded", "batch-first"])
@pytest.mark.parametrize("mode", MODES)
def test_a_record_that_alone_sets_the_trimmed_length_cannot_hide_a_layer_input(mode, folded):
    """4.90 C released at 08efe51 (every mode, 45 of 45 draws of the halves; folded ``fc`` on ``[B*L', 64]``, or the
    same ``fc`` on ``[B, L', 64]``: a rule layer's input of another per-example size is skipped the same way); the
    same model without the trimming is refused."""
    model, x, y = _problem(alpha=1e-6, folded=folded)
    honest = torch.zeros(1, LENGTH, WIDTH, dtype=torch.float32)
    honest[0, 0] = torch.randn(WIDTH, generator=torch.Generator().manual_seed(7))
    assert _released_or_refused(model, x, y, honest, mode) == pytest.approx(1.0, abs=1e-3)  # honest: passes
    record = _record(model, scale=3e7, tail=1e6)
    released = _released_or_refused(model, x, y, record, mode)
    assert released <= CLIP * (1 + 1e-3), f"one removal changed the released sum by {released:.3f} C"


@pytest.mark.parametrize("folded", [True, False], ids=["folded", "batch-first"])
@pytest.mark.parametrize("mode", MODES)
def test_the_same_record_without_the_trimming_is_refused(mode, folded):
    """The control: every half runs the step's length, the layer inputs are compared and the record is refused."""
    model, x, y = _problem(alpha=1e-6, folded=folded, trim=False)
    record = _record(model, scale=3e7, tail=1e6)
    with pytest.raises(PrivacyConfigError, match="depend on their batch-mates"):
        _release(model, torch.cat([x, record]), torch.cat([y, torch.zeros(1, dtype=torch.long)]), mode)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping"])
@pytest.mark.parametrize("lengths", [[1, 6], [6, 6, 6, 1]])
def test_a_tiny_opt_batch_with_a_one_token_sequence_is_not_refused(lengths, mode):
    """A false refusal seen in this review's OPT check, pre-existing (a370e14 refused it too): in train mode (dropout
    0), a batch holding a one-token sequence was refused with "no layer rule covers ...self_attn.k_proj.weight ...".
    The one-token row's softmax has one entry, so its ``q_proj``/``k_proj`` output gradient is exactly 0, but SDPA's
    backward leaves its own rounding noise there (6.9e-11 against 5.7e-4 for a six-token row), not linear in the
    loss's weight: the alignment check found the calls misaligned and sent them to the ``torch.func`` fallback,
    which cannot vmap OPT. The row's recheck with a power-of-two weight agrees exactly. Ghost mode's second backward
    refused it too (seeded ``f_i``, that noise did not scale by ``f_i``) until it was seeded as the first pass (stop
    57). The sums match the loop in every mode."""
    model, ids, mask, y = _tiny_opt(lengths)
    engine = PerExampleGradientEngine(model, mode=mode)
    clipped = engine.clipped_sum(lambda: F.cross_entropy(model({"input_ids": ids, "attention_mask": mask}), y,
                                                         reduction="none"), CLIP)
    assert not [name for name in engine.last_recomputed if "self_attn" in name]  # from the Linear rules
    expected = [torch.zeros_like(p) for p in engine.params]
    for r in range(len(lengths)):
        model.zero_grad()
        F.cross_entropy(model({"input_ids": ids[r:r + 1], "attention_mask": mask[r:r + 1]}), y[r:r + 1]).backward()
        grads = [p.grad.detach().clone() for p in engine.params]
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
        for total, g in zip(expected, grads):
            total += g * min(1.0, CLIP / float(norm))
    for name, got, want in zip(engine.names, clipped.grads, expected):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), name


def _tiny_opt(lengths, mixing: float = 0.0):
    """A tiny OPT (train mode, dropout 0) and a right-padded batch of ``lengths``; with ``mixing``, layer 0's
    ``k_proj`` output row of example 0 also receives ``mixing`` times example 1's gradient of its own row
    (``k[1] + s (k[0] - k[0].detach())``: the forward is unchanged)."""
    from lit_zodp.backbones import HFSequenceClassifier

    torch.manual_seed(0)
    model = HFSequenceClassifier(config=dict(model_type="opt", vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                             num_attention_heads=2, ffn_dim=32, max_position_embeddings=16,
                                             word_embed_proj_dim=16, pad_token_id=1, dropout=0.0,
                                             attention_dropout=0.0), num_classes=2).float().train()
    if mixing:
        attention = model.model.model.decoder.layers[0].self_attn
        attention.k_proj = _GradientMixing(attention.k_proj, mixing)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 50, (len(lengths), 6), generator=generator)
    mask = (torch.arange(6)[None] < torch.tensor(lengths)[:, None]).long()
    ids = ids * mask + (1 - mask)
    y = torch.randint(0, 2, (len(lengths),), generator=generator)
    return model, ids, mask, y


class _GradientMixing(nn.Module):
    """``linear``, then row 1's output ``+ s (row 0 - row 0 detached)``: the same values, and row 0 of ``linear``'s
    output gets ``s`` times row 1's output gradient (example 1's) on top of example 0's own."""

    def __init__(self, linear: nn.Linear, scale: float):
        super().__init__()
        self.linear, self.scale = linear, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.linear(x)
        if len(k) < 2:
            return k
        shift = torch.cat([torch.zeros_like(k[:1]), (k[:1] - k[:1].detach()).expand_as(k[1:2]),
                           torch.zeros_like(k[2:])])
        return k + self.scale * shift


@pytest.mark.parametrize("scale", [1e-4, 1e-7, 1e-8])
def test_another_examples_part_in_a_one_token_row_is_still_misaligned(scale):
    """The recheck gives example 0 (one token: its own ``k_proj`` row is rounding noise, 6.9e-11) the weight
    ``+-4`` and example 1 a fresh ``+-[1, 2)``, so example 1's part ``c`` leaves ``(w_1 - w_0) c`` (``|.| >= 2``)
    against a tolerance relative to the row itself (``8 sqrt(eps) ||G_1[0]||``): a part far above the noise
    (``scale`` 1e-4: 4e-8), at it (1e-7: 4e-11) or well below it (1e-8: 4e-12) is still found, the call is sent to the
    ``torch.func`` fallback, which cannot vmap OPT, and the step is refused. Unmixed it passes (the test above)."""
    model, ids, mask, y = _tiny_opt([1, 6], mixing=scale)
    engine = PerExampleGradientEngine(model, mode="hooks")
    with pytest.raises(PrivacyConfigError, match=r"no layer rule covers .*layers\.0\.self_attn\.k_proj\.linear"):
        engine.clipped_sum(lambda: F.cross_entropy(model({"input_ids": ids, "attention_mask": mask}), y,
                                                   reduction="none"), CLIP)
