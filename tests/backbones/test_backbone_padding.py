"""Left padding: a row's loss must not depend on how long its batch-mates are (audit 5).

BERT, GPT-2 (and DistilBERT, Llama...) number positions ``0..L-1`` whatever the attention mask, so a
left-padded row's positions shifted with the batch's longest row. Every text backbone rotates leading
padding to the end first (:func:`~lit_zodp.backbones.huggingface.right_padded`).
"""

from __future__ import annotations

import pytest
import torch

from lit_zodp.backbones import HFCandidateScorer, HFPromptClassifier, HFSequenceClassifier, SentenceEncoderClassifier
from lit_zodp.backbones.huggingface import right_padded, tiny_bert_config

TINY_GPT2 = dict(model_type="gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                 pad_token_id=0, bos_token_id=1, eos_token_id=1)
TINY_BERT = tiny_bert_config(vocab_size=64)
MASK_ID = 5


def left_padded(rows: list[list[int]], **extra: list[list[int]]) -> dict[str, torch.Tensor]:
    """Rows of token ids (and other per-token entries) left-padded with 0 to the longest row."""
    length = max(len(r) for r in rows)
    batch = {"input_ids": [[0] * (length - len(r)) + r for r in rows],
             "attention_mask": [[0] * (length - len(r)) + [1] * len(r) for r in rows]}
    batch.update({key: [[0] * (length - len(v)) + v for v in values] for key, values in extra.items()})
    return {key: torch.tensor(value) for key, value in batch.items()}


def test_leading_padding_moves_to_the_end_and_nothing_else_moves():
    batch = {
        "input_ids": torch.tensor([[0, 0, 7, 8], [7, 8, 9, 0], [7, 0, 8, 0], [0, 0, 0, 0]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]]),
        "position_ids": torch.arange(4).unsqueeze(0),                       # [1, L]: broadcast rows
        "inputs_embeds": torch.arange(16.0).view(1, 4, 4).expand(4, 4, 4),  # [B, L, H]
    }
    out = right_padded(batch)
    assert out["input_ids"].tolist() == [[7, 8, 0, 0], [7, 8, 9, 0], [7, 0, 8, 0], [0, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[2, 3, 0, 1], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert torch.equal(out["inputs_embeds"][0], batch["inputs_embeds"][0][[2, 3, 0, 1]])
    assert torch.equal(out["inputs_embeds"][1:], batch["inputs_embeds"][1:])
    assert right_padded({"input_ids": batch["input_ids"]}) == {"input_ids": batch["input_ids"]}


def _sequence_classifier(config):
    return lambda: HFSequenceClassifier(config=config, num_classes=2)


def _cls_encoder():
    return SentenceEncoderClassifier(config=TINY_BERT, pooling="cls", num_classes=2)


def _masked_prompt():
    return HFPromptClassifier(config=TINY_BERT, lm_type="mlm", label_word_ids=[10, 11], mask_token_id=MASK_ID)


def _causal_prompt():
    return HFPromptClassifier(config=TINY_GPT2, lm_type="causal", label_word_ids=[10, 11])


@pytest.mark.parametrize("build", [_sequence_classifier(TINY_GPT2), _sequence_classifier(TINY_BERT),
                                   _cls_encoder, _masked_prompt, _causal_prompt],
                         ids=["gpt2-classifier", "bert-classifier", "cls-encoder", "mlm-prompt", "causal-prompt"])
def test_a_left_padded_loss_equals_the_loss_alone(build):
    """Without the rotation: GPT-2 classifier logits moved by 0.07 beside a longer row."""
    torch.manual_seed(0)
    model = build().eval()
    short, long = [2, 12, MASK_ID, 13], [2, 20, 21, 22, 23, MASK_ID, 24, 25, 26]
    targets = torch.tensor([0, 1])
    with torch.no_grad():
        alone = model.per_example_loss({k: v[:1] for k, v in left_padded([short]).items()}, targets[:1])
        beside = model.per_example_loss(left_padded([short, long]), targets)[:1]
    torch.testing.assert_close(beside, alone, rtol=0, atol=2e-6)


def test_a_left_padded_candidate_score_equals_the_score_alone():
    torch.manual_seed(0)
    scorer = HFCandidateScorer(config=TINY_GPT2, num_classes=2).eval()
    prompts, candidates = ([1, 12, 13], [1, 20, 21, 22, 23, 24, 25]), ([30], [31, 32])

    def example(prompt):
        rows = [prompt + c for c in candidates]
        return rows, [[0] * len(prompt) + [1] * len(c) for c in candidates]

    rows, marks = zip(*(example(p) for p in prompts))
    batch = left_padded([r for pair in rows for r in pair], candidate_mask=[m for pair in marks for m in pair])
    batch = {k: v.view(2, 2, -1) for k, v in batch.items()}
    alone = left_padded(list(rows[0]), candidate_mask=list(marks[0]))
    alone = {k: v.unsqueeze(0) for k, v in alone.items()}
    with torch.no_grad():
        torch.testing.assert_close(scorer(batch)[:1], scorer(alone), rtol=0, atol=2e-6)
