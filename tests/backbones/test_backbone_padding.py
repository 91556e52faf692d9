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


# ------------------------------------------------------------------ state that follows the longest row (review 23)
TINY_LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, max_position_embeddings=32, pad_token_id=0)
DYNAMIC_ROPE = dict(TINY_LLAMA, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
LONGROPE = dict(TINY_LLAMA, model_type="phi3", max_position_embeddings=64, original_max_position_embeddings=32,
                rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                 "rope_theta": 1e4, "original_max_position_embeddings": 32})
NYSTROMFORMER = dict(TINY_LLAMA, model_type="nystromformer", max_position_embeddings=64)
BLOCK_SPARSE = dict(TINY_LLAMA, model_type="big_bird", max_position_embeddings=64, attention_type="block_sparse",
                    block_size=2, num_random_blocks=1)


def _short_rows_loader():
    """Poisson batches of 6-token rows: nothing that follows the longest row rebuilds while a fit runs."""
    from torch.utils.data import DataLoader

    from lit_zodp.privacy import PoissonBatchSampler

    rows = torch.randint(3, 64, (8, 6))

    def collate(indices):
        ids = rows[list(indices)] if indices else torch.zeros(0, 6, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.zeros(len(indices), dtype=torch.long)
    return DataLoader(list(range(8)), batch_sampler=PoissonBatchSampler(8, 0.5), collate_fn=collate)


def _fit_private(config, max_length=None, padded=None):
    import warnings

    import lightning.pytorch as pl

    from lit_zodp.algorithms import DPZero
    from tests.conftest import quiet_trainer

    torch.manual_seed(0)
    module = DPZero(HFSequenceClassifier(config=config, num_classes=2), lr=1e-3, clip=1.0, noise_multiplier=1.0,
                    delta=1e-5)
    trainer = quiet_trainer(max_steps=3)
    datamodule = pl.LightningDataModule.from_datasets()  # (only `max_length` is read before the first step)
    datamodule.max_length, datamodule.train_dataloader = max_length, _short_rows_loader
    datamodule.pad_to_max_length = padded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=datamodule)
    return trainer


@pytest.mark.parametrize("config, named", [(DYNAMIC_ROPE, "`rope_type: dynamic`"), (LONGROPE, "`rope_type: longrope`"),
                                           (BLOCK_SPARSE, "`attention_type: block_sparse`"),
                                           (NYSTROMFORMER, "`pad_to_max_length: true`")],
                         ids=["dynamic-rope", "longrope", "bigbird-block-sparse", "nystromformer"])
def test_layers_whose_state_follows_the_longest_row_are_refused_before_the_first_step_whatever_the_rows(config, named):
    """Review 23. A dynamic RoPE rebuilt ``inv_freq`` from the batch's padded length and was refused at the first Poisson
    batch holding a row beyond 32 tokens (DPZero stopped after 1-7 of 20 steps with one 40-token row, ran all 20
    without it); BigBird switched to full attention at the first all-short batch, printing its length. Now refused
    at setup in one line, here on rows that would not trigger them (before: the dynamic RoPE ran its 3 steps; longrope,
    which rewrites its buffer in every forward, and BigBird on all-short rows were refused at the first private step,
    as a buffer write or a registration). Nystromformer's loss moved by 3e-4 of itself beside a longer row, which the
    padding check passed (400 times below its tolerance): it ran."""
    from lit_zodp.errors import PrivacyConfigError

    with pytest.raises(PrivacyConfigError) as excinfo:
        _fit_private(config)
    message = str(excinfo.value)
    assert named in message and "\n" not in message


def test_a_dynamic_rope_within_its_pretraining_length_and_nystromformer_padded_to_max_length_train():
    """With the data's ``max_length`` within ``max_position_embeddings`` a dynamic RoPE never rebuilds, and rows padded
    to ``max_length`` give Nystromformer one padding whatever the batch: both train."""
    assert _fit_private(DYNAMIC_ROPE, max_length=32).global_step == 3
    assert _fit_private(NYSTROMFORMER, max_length=6, padded=True).global_step == 3
