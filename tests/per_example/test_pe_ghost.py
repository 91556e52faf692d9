"""Ghost norms (Li et al. 2022) equal the norms of the materialised per-example gradients."""

import dataclasses
from copy import deepcopy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lit_zodp.per_example import PerExampleGradientEngine, samplers
from lit_zodp.per_example.coverage import DIFFERENCE_CHUNK, difference_norm
from lit_zodp.per_example.ghost import embedding_norm_sq, gram_norm_sq, prefer_ghost
from tests.per_example.helpers import LargestTensor, LiveLarge, assert_rel_close


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 5), st.integers(1, 5))
def test_gram_norm_equals_materialised_norm(batch, positions, d_in, d_out):
    torch.manual_seed(batch * 100 + positions)
    a, g = torch.randn(batch, positions, d_in), torch.randn(batch, positions, d_out)
    materialised = torch.einsum("bto,bti->boi", g, a).flatten(1).pow(2).sum(1)
    assert_rel_close(gram_norm_sq(a, g), materialised, 1e-10)


def test_embedding_norm_equals_materialised_norm_with_padding():
    torch.manual_seed(0)
    idx, g = torch.randint(0, 4, (5, 7)), torch.randn(5, 7, 3)
    layer = nn.Embedding(4, 3, padding_idx=1)
    materialised = samplers._embedding_grads(layer, idx, g)["weight"].flatten(1).pow(2).sum(1)
    assert_rel_close(embedding_norm_sq(idx, g, 1), materialised, 1e-10)


def test_mixed_rule_prefers_the_cheaper_computation():
    assert prefer_ghost(1, 4) and prefer_ghost(10, 201)
    assert prefer_ghost(512, 768 * 768) and not prefer_ghost(10, 200) and not prefer_ghost(1024, 768 * 768)


@pytest.mark.parametrize("make", [
    lambda: (nn.Conv2d(2, 5, 3, padding=1), torch.randn(3, 2, 4, 4)),
    lambda: (nn.Conv1d(2, 8, 3, stride=2), torch.randn(3, 2, 9)),
    lambda: (nn.Conv1d(2, 2, 3), torch.randn(3, 2, 40)),  # 2 L^2 > weight size: materialised
    lambda: (nn.Embedding(30, 4), torch.randint(0, 30, (3, 4))),
    lambda: (nn.Linear(3, 4), torch.randn(3, 2, 3)),
])
def test_layer_norm_rules_equal_materialised_norms(make):
    torch.manual_seed(0)
    layer, x = make()
    out = layer(x)
    g = torch.randn_like(out)
    sampler = samplers.sampler_for(layer)
    ghost = sampler.norms_sq(layer, x, g)
    materialised = {n: t.flatten(1).pow(2).sum(1) for n, t in sampler.grads(layer, x, g).items()}
    assert set(ghost) == set(materialised)
    for name in ghost:
        assert_rel_close(ghost[name], materialised[name], 1e-10, name)
    summed = sampler.sum_over_examples(layer, x, g)
    for name, t in sampler.grads(layer, x, g).items():
        assert_rel_close(summed[name], t.sum(0), 1e-10, name)


def test_ghost_mode_never_materialises_linear_weights(monkeypatch):
    """Ghost mode only asks single-use Linear layers for norms and sums."""
    table = dict(samplers._SAMPLERS)

    def forbidden(layer, a, g):
        raise AssertionError("materialised")

    table[nn.Linear] = dataclasses.replace(table[nn.Linear], grads=forbidden)
    monkeypatch.setattr(samplers, "_SAMPLERS", table)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(4, 3, 8)
    for mode in ("ghost", "bookkeeping"):
        result = PerExampleGradientEngine(model, mode=mode).clipped_sum(lambda: model(x).pow(2).sum((1, 2)), 0.1)
        assert result.norms.shape == (4,)
    with pytest.raises(AssertionError, match="materialised"):
        PerExampleGradientEngine(model).clipped_sum(lambda: model(x).pow(2).sum((1, 2)), 0.1)


def test_ghost_check_holds_at_most_two_copies_of_an_embedding_table():
    """On a checked batch "ghost" mode compares each parameter's unit sum with its batch gradient
    while the graph is retained. For an embedding table (MiniLM's word embeddings: 45 MiB) both are
    full-size; their difference must not be a third copy (it was the 45 MiB that put MiniLM's
    checked step above Opacus' ghost clipping): :func:`difference_norm` forms it slice by slice."""
    torch.manual_seed(0)
    vocab, dim = 2 * DIFFERENCE_CHUNK // 16 + 7, 16
    model = nn.Sequential(nn.Embedding(vocab, dim), nn.Flatten(1), nn.Linear(3 * dim, 2))
    ids, y = torch.randint(0, vocab, (4, 3)), torch.tensor([0, 1, 1, 0])
    engine = PerExampleGradientEngine(model, mode="ghost")
    with LiveLarge(vocab * dim) as probe:
        checked = engine.clipped_sum(lambda: nn.functional.cross_entropy(model(ids), y, reduction="none"), 0.5)
    assert len(probe.most) <= 2, probe.most
    again = engine.clipped_sum(lambda: nn.functional.cross_entropy(model(ids), y, reduction="none"), 0.5)
    for a, b in zip(checked.grads, again.grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("shape", [(3,), (5, 7), (DIFFERENCE_CHUNK // 8 + 3, 8)])
def test_difference_norm_is_the_norm_of_the_difference_without_a_full_size_temporary(shape):
    torch.manual_seed(0)
    a, b = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float32)
    with LargestTensor() as probe:
        gap = difference_norm(a, b)
    assert_rel_close(gap, torch.linalg.vector_norm(a.to(b.dtype) - b, dtype=torch.float64), 1e-12)
    assert gap.dtype == torch.float64  # (a float32 sum of squares is 0 below 1e-22, inf above 1e19: review 78)
    assert probe.largest <= DIFFERENCE_CHUNK


# ------------------------------------------------------------- cancellation (second audit, F2)


class _Sequence(nn.Module):
    def __init__(self, conv: bool):
        super().__init__()
        self.conv = conv
        self.layer = nn.Conv1d(16, 16, 1) if conv else nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):  # [B, T, 16]
        h = self.layer(x.transpose(1, 2)).transpose(1, 2) if self.conv else self.layer(x)
        return self.head(torch.tanh(h.mean(1)))


def _cancelling_record(magnitude: float, seed: int) -> torch.Tensor:
    """``x_1 = M u + d_1``, ``x_2 = -M u + d_2``: Gram terms ~``M^2``, the norm ~``|d|^2``."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(16, generator=g, dtype=torch.float32)
    d = 10 * torch.randn(2, 16, generator=g, dtype=torch.float32)
    return torch.stack([magnitude * u / u.norm() + d[0], -magnitude * u / u.norm() + d[1]])[None]


@pytest.mark.parametrize("mode", ["ghost", "bookkeeping"])
@pytest.mark.parametrize("conv", [False, True])
def test_a_record_built_to_cancel_in_the_gram_norm_is_still_clipped_to_c(mode, conv):
    """B = 1, so the released sum is the record's contribution: at most C. With the float32 Gram
    norm this reached 3.4 C (Linear) and 2.1 C (Conv1d) for M in [1e4, 1e6]."""
    torch.manual_seed(0)
    model = _Sequence(conv).float()
    engine = PerExampleGradientEngine(model, mode=mode)
    worst = 0.0
    for k, magnitude in enumerate([1e4, 3e4, 1e5, 3e5, 1e6] * 4):
        x = _cancelling_record(magnitude, seed=k)
        result = engine.clipped_sum(lambda: nn.functional.cross_entropy(model(x), torch.tensor([0]),
                                                                        reduction="none"), 1.0)
        worst = max(worst, float(torch.cat([g.double().flatten() for g in result.grads]).norm()))
    assert worst <= 1.0 + 1e-6


def test_the_guard_costs_ordinary_float32_examples_almost_nothing():
    """``S_i ~ sqrt(T) ||G_i||`` for random rows: the bound is within 1e-4 of the materialised norm at T = 64."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 64, 32, generator=g, dtype=torch.float32)
    grad = torch.randn(8, 64, 48, generator=g, dtype=torch.float32)
    materialised = torch.einsum("bto,bti->boi", grad.double(), a.double()).flatten(1).pow(2).sum(1)
    ratio = (gram_norm_sq(a, grad) / materialised).sqrt()
    assert bool((ratio >= 1).all()) and float(ratio.max()) < 1 + 1e-4


def test_ghost_norms_formed_in_chunks_of_examples_equal_the_whole(monkeypatch):
    from lit_zodp.per_example import ghost

    torch.manual_seed(0)
    a, grad, idx = torch.randn(37, 9, 5), torch.randn(37, 9, 4), torch.randint(0, 5, (37, 9))
    whole = ghost.gram_norm_sq(a, grad), ghost.embedding_norm_sq(idx, grad, 0)
    monkeypatch.setattr(ghost, "GHOST_CHUNK", 100)  # 100 // (9 * 9) = 1 example per chunk
    for got, expected in zip((ghost.gram_norm_sq(a, grad), ghost.embedding_norm_sq(idx, grad, 0)), whole):
        assert_rel_close(got, expected, 1e-14)


def test_the_guard_follows_the_float32_matmul_setting(monkeypatch):
    """TF32 operands (``fp32_precision = "tf32"``) move a share by up to ``2^-9 S_i``: the guard grows to match."""
    from lit_zodp.per_example import rounding

    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 8, 4, generator=g, dtype=torch.float32)
    grad = torch.randn(2, 8, 3, generator=g, dtype=torch.float32)
    monkeypatch.setattr(rounding, "float32_matmul_setting", lambda device_type: "ieee")
    tight, tight64 = gram_norm_sq(a, grad), gram_norm_sq(a.double(), grad.double())
    monkeypatch.setattr(rounding, "float32_matmul_setting", lambda device_type: "tf32")
    assert bool((gram_norm_sq(a, grad) > tight * (1 + 1e-3)).all())
    assert torch.equal(gram_norm_sq(a.double(), grad.double()), tight64)  # float64 sums: no TF32

def test_a_parameter_whose_exact_gradient_is_zero_passes_ghost_modes_checked_step():
    """An attention key bias shifts every score of a query equally, so softmax cancels it: its computed
    gradient is rounding noise. The coverage tolerance's whole-gradient term covers it, but ghost mode
    dropped the parameters found covered on arrival from that term, so every checked step of a BERT
    sentence encoder was refused (DPSGD on the packaged MiniLM, 2026-11-25)."""
    from lit_zodp.backbones import SentenceEncoderClassifier
    from lit_zodp.backbones.base import per_example_loss
    from lit_zodp.backbones.huggingface import tiny_bert_config

    torch.manual_seed(0)
    model = SentenceEncoderClassifier(config=tiny_bert_config(vocab_size=64), num_classes=2).float()  # float32, dropout
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(8, 12, dtype=torch.long)
    for row, length in enumerate(torch.randint(2, 12, (8,), generator=g).tolist()):
        ids[row, :length] = torch.randint(1, 64, (length,), generator=g)
    inputs, y = {"input_ids": ids, "attention_mask": (ids != 0).long()}, torch.randint(0, 2, (8,), generator=g)
    sums = {}
    for mode in ("ghost", "hooks"):  # one engine per model: an engine's hooks stay on the model it was built on
        copy = deepcopy(model)
        torch.manual_seed(1)  # the same dropout masks in both
        sums[mode] = PerExampleGradientEngine(copy, mode=mode).clipped_sum(
            lambda copy=copy: per_example_loss(copy, inputs, y).float(), 1.0).grads
    for a, b in zip(sums["ghost"], sums["hooks"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_ghost_modes_second_pass_check_passes_a_float64_model_with_float32_losses():
    """The modules take ``per_example_loss(...).float()``: the second backward's seeds are the clip factors
    rounded to float32 (2^-24), beyond a float64 tolerance (1.5e-8) when compared with the float64 factors,
    so every checked step of a float64 BERT was refused (2026-11-25)."""
    from lit_zodp.backbones import SentenceEncoderClassifier
    from lit_zodp.backbones.base import per_example_loss
    from lit_zodp.backbones.huggingface import tiny_bert_config

    torch.manual_seed(0)
    model = SentenceEncoderClassifier(config=tiny_bert_config(vocab_size=64), num_classes=2).double()
    ids = torch.randint(1, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    ids[::2, 6:] = 0
    inputs, y = {"input_ids": ids, "attention_mask": (ids != 0).long()}, torch.tensor([0, 1] * 4)
    engine = PerExampleGradientEngine(model, mode="ghost")
    for _ in range(3):  # every ghost step verifies its second pass, with its own secret projections
        engine.clipped_sum(lambda: per_example_loss(model, inputs, y).float(), 0.1)
