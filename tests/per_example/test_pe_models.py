"""Whole models: a timm ViT block and tiny ViT, a tiny Hugging Face BERT, against the torch.func
reference and Opacus; "ghost", "bookkeeping" and "vmap" modes against "hooks"."""

import pytest
import torch

from lit_zodp.per_example import PerExampleGradientEngine
from tests.per_example.helpers import (
    assert_grads_match,
    assert_rel_close,
    ce,
    engine_per_example,
    loop_reference,
    mlp,
    opacus_per_example,
    reference,
    tiny_bert,
    tiny_vit,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def vit_batch():
    torch.manual_seed(0)
    return torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 1])


@pytest.fixture
def bert_batch():
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (3, 6))
    mask = torch.ones_like(ids)
    ids[0, 4:], mask[0, 4:] = 0, 0  # padding
    return ids, mask, torch.tensor([0, 1, 1])


def test_timm_vit_block_matches_reference_and_opacus():
    from timm.models.vision_transformer import Block

    torch.manual_seed(0)
    block = Block(dim=8, num_heads=2, mlp_ratio=2.0).double()
    x, w = torch.randn(3, 5, 8), torch.randn(5, 8)
    expected = reference(block, lambda xi: (block(xi) * w).sum(), x)
    assert_grads_match(engine_per_example(block, lambda: (block(x) * w).sum((1, 2))), expected)
    assert_grads_match(opacus_per_example(block, lambda m: (m(x) * w).sum((1, 2))), expected)


def test_tiny_vit_matches_reference_and_opacus(vit_batch):
    """``cls_token`` and ``pos_embed`` belong to the ViT itself: the vmap fallback on the whole model."""
    model, (x, y) = tiny_vit(), vit_batch
    expected = reference(model, lambda xi, yi: ce(model(xi), yi).sum(), x, y)
    got = engine_per_example(model, lambda: ce(model(x), y), recomputed={"cls_token": "", "pos_embed": ""})
    assert_grads_match(got, expected)
    assert_grads_match(opacus_per_example(model, lambda m: ce(m(x), y)), expected)
    assert_grads_match(engine_per_example(model, lambda: ce(model(x), y), "vmap"), expected)


def test_tiny_bert_matches_reference_and_opacus():
    """Shared position ids ``[1, T]`` are expanded per example; Opacus needs them passed as ``[B, T]``."""
    model = tiny_bert()
    torch.manual_seed(0)
    ids, y = torch.randint(1, 50, (3, 6)), torch.tensor([0, 1, 1])
    expected = reference(model, lambda i, yi: ce(model(input_ids=i).logits, yi).sum(), ids, y)
    got = engine_per_example(model, lambda: ce(model(input_ids=ids).logits, y))
    assert_grads_match(got, expected)
    positions = torch.arange(6).expand(3, 6)
    theirs = opacus_per_example(model, lambda m: ce(m(input_ids=ids, position_ids=positions).logits, y))
    assert_grads_match(theirs, expected)


def test_tiny_bert_with_padding_mask_matches_per_example_backward(bert_batch):
    """With an attention mask HF's mask code is not vmap-able; the reference is one backward per example."""
    model, (ids, mask, y) = tiny_bert(), bert_batch
    expected = loop_reference(model, lambda i, m, yi: ce(model(input_ids=i, attention_mask=m).logits, yi).sum(),
                              ids, mask, y)
    got = engine_per_example(model, lambda: ce(model(input_ids=ids, attention_mask=mask).logits, y))
    assert_grads_match(got, expected)
    assert torch.count_nonzero(got["bert.embeddings.word_embeddings.weight"][:, 0]) == 0  # padding_idx


def _assert_same_clipped_sum(model, loss_fn, clip, modes=("ghost", "bookkeeping")):
    hooks = PerExampleGradientEngine(model).clipped_sum(loss_fn, clip)
    for mode in modes:
        other = PerExampleGradientEngine(model, mode=mode).clipped_sum(loss_fn, clip)
        assert_rel_close(other.norms, hooks.norms, name=f"{mode} norms")
        for g, h in zip(other.grads, hooks.grads):
            assert_rel_close(g, h, name=mode)


@pytest.mark.parametrize("clip", [0.3, float("inf")])
def test_ghost_and_vmap_modes_equal_hooks_on_mlp_vit_bert(clip, vit_batch, bert_batch):
    torch.manual_seed(0)
    model, x, y = mlp(), torch.randn(5, 6), torch.tensor([0, 1, 2, 1, 0])
    _assert_same_clipped_sum(model, lambda: ce(model(x), y), clip, modes=("ghost", "bookkeeping", "vmap"))
    vit, (images, labels) = tiny_vit(), vit_batch
    _assert_same_clipped_sum(vit, lambda: ce(vit(images), labels), clip, modes=("ghost", "bookkeeping", "vmap"))
    bert, (ids, mask, yb) = tiny_bert(), bert_batch
    _assert_same_clipped_sum(bert, lambda: ce(bert(input_ids=ids, attention_mask=mask).logits, yb), clip)


def test_ghost_on_sequence_mlp_uses_ghost_norm_and_book_keeping():
    """Long enough sequences for both branches of the mixed rule (2 T^2 vs in * out)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    x, w = torch.randn(4, 9, 16), torch.randn(9, 2)
    _assert_same_clipped_sum(model, lambda: (model(x) * w).sum((1, 2)), 0.5)


def test_a_masked_lm_prompt_head_with_a_tied_bias_matches_per_example_backward():
    """BERT's and RoBERTa's MLM ``predictions.bias`` is the ``decoder``'s bias: owned by a module without a
    layer rule too, it went to the whole-model vmap, which Hugging Face's mask code cannot run, so every
    first-order fit of a prompt classifier (the DPZero paper's RoBERTa setting) was refused (2026-11-25)."""
    from lit_zodp.backbones import HFPromptClassifier

    torch.manual_seed(0)
    model = HFPromptClassifier(config=dict(model_type="bert", vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
                                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                               label_word_ids=[7, 9], mask_token_id=3).double()
    assert model.model.cls.predictions.bias is model.model.cls.predictions.decoder.bias
    ids = torch.tensor([[5, 6, 3, 0, 0], [8, 3, 10, 11, 12], [3, 4, 0, 0, 0]])
    mask, y = (ids != 0).long(), torch.tensor([0, 1, 1])

    def loss(i, m, yi):
        return ce(model({"input_ids": i, "attention_mask": m}), yi)

    expected = loop_reference(model, lambda i, m, yi: loss(i, m, yi).sum(), ids, mask, y)
    assert_grads_match(engine_per_example(model, lambda: loss(ids, mask, y)), expected)


class _ScaledHead(torch.nn.Module):
    """Holds its layer's bias as its own attribute too, and uses it outside the layer's call."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 3).double()
        self.bias = self.layer.bias

    def forward(self, x):
        return self.layer(x) + 0.5 * self.bias


def test_a_tied_parameter_also_used_outside_its_layers_call_is_still_found():
    """The layer rule alone would miss the ``+ 0.5 * bias`` use: it is recomputed on the whole module."""
    torch.manual_seed(0)
    model, x, y = _ScaledHead(), torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    expected = reference(model, lambda xi, yi: ce(model(xi), yi).sum(), x, y)
    assert_grads_match(engine_per_example(model, lambda: ce(model(x), y), recomputed={"bias": ""}), expected)


def test_opts_layers_on_flattened_batch_rows_match_per_example_backward():
    """OPT's decoder layers run ``final_layer_norm``, ``fc1`` and ``fc2`` on ``[B, L, H]`` flattened to
    ``[B*L, H]``: no rule could attribute the rows, and every first-order fit of OPT was refused
    (2026-11-25). The calls are now viewed as ``[B, L, H]``, the alignment check verifying each block."""
    from lit_zodp.backbones import HFSequenceClassifier

    torch.manual_seed(0)
    model = HFSequenceClassifier(config=dict(model_type="opt", vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, ffn_dim=32, max_position_embeddings=16,
                                             word_embed_proj_dim=16, pad_token_id=0, dropout=0.0,
                                             attention_dropout=0.0), num_classes=2).double()
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12], [13, 14, 0, 0, 0]])
    mask, y = (ids != 0).long(), torch.tensor([0, 1, 1])

    def loss(i, m, yi):
        return ce(model({"input_ids": i, "attention_mask": m}), yi)

    expected = loop_reference(model, lambda i, m, yi: loss(i, m, yi).sum(), ids, mask, y)
    positions = "model.model.decoder.embed_positions"  # positions from the mask: recomputed on that module
    got = engine_per_example(model, lambda: loss(ids, mask, y), recomputed={f"{positions}.weight": positions})
    assert_grads_match(got, expected)


class _SequenceFirstLinear(torch.nn.Module):
    """Flattens ``[B, T, H]`` sequence-first (``[T*B, H]``): row block ``b`` of the flat rows is NOT example ``b``."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 3).double()

    def forward(self, x):
        flat = x.transpose(0, 1).reshape(-1, x.shape[-1])
        return self.layer(flat).view(x.shape[1], x.shape[0], -1).transpose(0, 1).sum(1)


def test_flattened_rows_not_in_batch_order_are_found_misaligned_and_recomputed():
    """Viewing ``[T*B, H]`` as ``[B, T, H]`` would mix examples; the alignment check sends the layer to the
    fallback, which gives the true per-example gradients."""
    torch.manual_seed(0)
    model, x, y = _SequenceFirstLinear(), torch.randn(4, 3, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    expected = reference(model, lambda xi, yi: ce(model(xi), yi).sum(), x, y)
    assert_grads_match(engine_per_example(model, lambda: ce(model(x), y), recomputed={"layer.weight": "",
                                                                                        "layer.bias": ""}), expected)
