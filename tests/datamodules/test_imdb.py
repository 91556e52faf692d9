"""IMDB (aclImdb) with an Amazon Polarity public sample, word ids (PAZO Table 4), on fabricated files."""

from __future__ import annotations

import math
import tracemalloc

import pytest
import torch

from datamodules import IMDBDataModule
from datamodules.imdb import AMAZON_SEED_OFFSET, WordVocabulary, reservoir_sample, word_tokens
from imdb_files import TEST, TRAIN, amazon_text, write_amazon, write_imdb
from lit_zodp.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:`sampling_seed` is set")


def make(tmp_path, **kwargs):
    if not (tmp_path / "aclImdb").exists():
        write_imdb(tmp_path)
    if not (tmp_path / "amazon_review_polarity_csv").exists():
        write_amazon(tmp_path)
    options = dict(data_dir=str(tmp_path), public_samples=20, batch_size=2, sampling_seed=0) | kwargs
    dm = IMDBDataModule(**options)
    dm.setup("fit")
    return dm


def texts_of(dm, dataset):
    """The token strings of each row of a built split (pad dropped)."""
    words = dm.tokenizer.words
    return [[words[i] for i, m in zip(row["input_ids"].tolist(), row["attention_mask"].tolist()) if m]
            for row, _ in (dataset[k] for k in range(len(dataset)))]


def test_splits_and_labels(tmp_path):
    dm = make(tmp_path)
    assert dm.num_classes == 2 and dm.n_private == len(TRAIN) and len(dm.test_dataset) == len(TEST)
    private_labels = [int(dm.private_dataset[k][1]) for k in range(dm.n_private)]
    assert private_labels == [0, 0, 0, 1, 1, 1]  # (neg then pos, by file id)
    assert [int(dm.test_dataset[k][1]) for k in range(len(TEST))] == [label for _, label in TEST]
    texts, labels = dm.public_texts()
    assert len(dm.public_dataset) == len(texts) == 20
    for text, label in zip(texts, labels):  # file label 1 -> 0 (negative), 2 -> 1 (positive)
        assert label == (0 if "bad poor" in text else 1)
        assert text.startswith("Review ") and "\nSecond line" in text  # title and content joined


def test_inputs_are_word_ids_padded_to_the_longest_row_of_each_batch(tmp_path):
    dm = make(tmp_path, max_length=4, eval_batch_size=4)
    inputs, targets = next(iter(dm.test_dataloader()))
    assert set(inputs) == {"input_ids", "attention_mask"} and targets.tolist() == [0, 0, 1, 1]
    assert inputs["input_ids"].dtype == torch.long and inputs["input_ids"].shape == (4, 3)  # "Bad and boring"
    assert inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1]]
    fixed = make(tmp_path, max_length=4, eval_batch_size=4, pad_to_max_length=True)
    assert next(iter(fixed.test_dataloader()))[0]["input_ids"].shape == (4, 4)


def test_truncation_keeps_the_first_tokens(tmp_path):
    dm = make(tmp_path, max_length=3, vocab_source="file", vocab_path=str(vocab_file(tmp_path, ["a", "dull"])))
    assert texts_of(dm, dm.private_dataset)[0] == ["a", "dull", "<unk>"]  # "A dull film. ..." cut at 3


def test_tokenizer():
    assert word_tokens("Don't <br /><br />STOP!It's  the 90's<BR/>end.") == \
        ["don't", "stop", "!", "it's", "the", "90's", "end", "."]
    assert word_tokens("") == [] and word_tokens("café, naïve") == ["café", ",", "naïve"]


def test_vocabulary_is_built_from_public_text_only(tmp_path):
    dm = make(tmp_path)
    vocabulary = dm.tokenizer
    assert vocabulary.words[:2] == ["<pad>", "<unk>"] and "privateword" not in vocabulary.ids
    ids = dm.private_dataset[0][0]["input_ids"].tolist()
    assert vocabulary.unk_token_id in ids and "privateword" in TRAIN[0][0]
    # the same vocabulary whatever the private reviews say
    other = tmp_path / "other"
    write_imdb(other, train=[("privateword " * 50, 0), ("privateword again", 1)] * 2, test=TEST)
    write_amazon(other)
    assert make(other).tokenizer.words == vocabulary.words


def test_vocabulary_ranks_by_frequency_then_word_and_keeps_vocab_size_words():
    vocabulary = WordVocabulary.from_texts(["b a c", "a b", "d"], size=3)
    assert vocabulary.words == ["<pad>", "<unk>", "a", "b", "c"] and len(vocabulary) == 5
    assert vocabulary.convert_tokens_to_ids(["a", "zzz", "c"]) == [2, 1, 4]
    assert vocabulary.encode("A b! c d", max_length=3) == [2, 3, 1]


def vocab_file(tmp_path, words):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(words) + "\n", encoding="utf-8")
    return path


def test_vocabulary_from_a_file_or_the_unlabelled_reviews(tmp_path):
    path = vocab_file(tmp_path, ["film", "", "film", "<unk>", "bad", "good", "extra"])
    dm = make(tmp_path, vocab_source="file", vocab_path=str(path), vocab_size=3)
    assert dm.tokenizer.words == ["<pad>", "<unk>", "film", "bad", "good"]
    other = tmp_path / "unsup"
    write_imdb(other, unsup=["zeta zeta alpha", "alpha zeta beta"])
    dm = make(other, vocab_source="unlabelled", public_source=None)
    assert dm.tokenizer.words == ["<pad>", "<unk>", "zeta", "alpha", "beta"] and dm.public_dataset is None


def test_duplicates_are_dropped_and_private_rows_equal_to_a_public_text_leave(tmp_path):
    train = TRAIN + [(TRAIN[1][0], 0), (amazon_text(3), 1)]
    write_imdb(tmp_path, train=train, test=TEST + [TEST[0]])
    write_amazon(tmp_path, rows=20, extra=[("2", "Review 5", "A great good product, number r5.\nSecond line")])
    dm = make(tmp_path, public_samples=21)
    texts, _ = dm.public_texts()
    assert len(texts) == 20 and len(set(texts)) == 20 and amazon_text(3) in texts  # (row 21 repeats row 5)
    assert dm.n_private == len(TRAIN)  # the repeated review and the Amazon text left the private set
    assert len(dm.test_dataset) == len(TEST)


def test_the_public_sample_is_deterministic_given_data_seed_and_independent_of_the_private_data(tmp_path):
    write_amazon(tmp_path, rows=200)
    first = make(tmp_path, data_seed=3).public_texts()
    other = tmp_path / "other"
    write_imdb(other, train=[("something else entirely", 0), ("and more", 1)] * 2, test=TEST)
    (other / "amazon_review_polarity_csv").symlink_to(tmp_path / "amazon_review_polarity_csv")
    assert make(other, data_seed=3).public_texts() == first
    assert make(tmp_path, data_seed=4).public_texts() != first
    rows = [amazon_text(k) for k, _ in reservoir_sample(range(200), 20, 3 + AMAZON_SEED_OFFSET)]
    assert first[0] == rows


def test_the_reservoir_sample_is_uniform():
    """Each of n rows is kept with probability k / n: over R seeds, the counts' chi-square (scaled by the
    without-replacement factor 1 - k/n) stays within 5 standard deviations of its n - 1 degrees of freedom."""
    n, k, runs = 200, 20, 400
    counts = torch.zeros(n)
    for seed in range(runs):
        sample = reservoir_sample(range(n), k, seed)
        assert len(sample) == k and len({i for i, _ in sample}) == k and [i for i, _ in sample] == sorted(
            row for _, row in sample)
        counts[[i for i, _ in sample]] += 1
    expected = runs * k / n
    statistic = float(((counts - expected) ** 2 / expected).sum()) / (1 - k / n)
    assert statistic < (n - 1) + 5 * math.sqrt(2 * (n - 1))
    assert counts.min() > 0
    assert reservoir_sample(range(5), 10, 0) == [(i, i) for i in range(5)]


def test_the_reservoir_holds_k_rows_not_the_stream():
    rows = (bytearray(1000) for _ in range(50_000))  # 50 MB if kept
    tracemalloc.start()
    try:
        sample = reservoir_sample(rows, 10, 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(sample) == 10 and peak < 1_000_000


@pytest.mark.parametrize("options, message", [
    (dict(vocab_size=0), "`vocab_size` to be a positive int"),
    (dict(max_length=-3), "`max_length` to be a positive int"),
    (dict(public_samples=0), "`public_samples` to be a positive int"),
    (dict(public_source="yelp"), "Expected `public_source` in ['amazon_polarity']"),
    (dict(vocab_source="words"), "Expected `vocab_source` in ['public', 'unlabelled', 'file']"),
    (dict(vocab_source="train"), "the private set (App. C.1 does)"),
    (dict(public_source=None), "`public_source` is None"),
    (dict(vocab_source="file"), "`vocab_path` is read with `vocab_source`='file' only"),
    (dict(vocab_path="words.txt"), "`vocab_path` is read with `vocab_source`='file' only"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ConfigError) as caught:
        IMDBDataModule(**options)
    assert message in str(caught.value) and str(caught.value).count("\n") == 0


def test_missing_files_and_bad_rows_are_refused_naming_the_layout(tmp_path):
    with pytest.raises(ConfigError, match=r"no file .*amazon_review_polarity_csv/train.csv.*no header"):
        IMDBDataModule(data_dir=str(tmp_path)).setup("fit")
    write_amazon(tmp_path)
    with pytest.raises(ConfigError, match=r"no folder .*aclImdb/train/neg.*expected aclImdb/\{train,test\}"):
        IMDBDataModule(data_dir=str(tmp_path), public_samples=20).setup("fit")
    write_imdb(tmp_path)
    with pytest.raises(ConfigError, match=r"no folder .*train/unsup"):
        IMDBDataModule(data_dir=str(tmp_path), public_source=None, vocab_source="unlabelled").setup("fit")
    with pytest.raises(ConfigError, match=r"`data.init_args.vocab_path`: no file"):
        IMDBDataModule(data_dir=str(tmp_path), vocab_source="file", vocab_path=str(tmp_path / "x")).setup("fit")
    bad = write_amazon(tmp_path / "bad", rows=5, extra=[("3", "title", "content")])
    with pytest.raises(ConfigError, match=r"row 6 of .* is not label \(1 or 2\), title, content"):
        IMDBDataModule(data_dir=str(tmp_path), public_data_dir=str(bad), public_samples=10).setup("fit")
    small = write_amazon(tmp_path / "small", rows=5)
    with pytest.raises(ConfigError, match=r"`public_samples`=10 exceeds the 5 rows"):
        IMDBDataModule(data_dir=str(tmp_path), public_data_dir=str(small), public_samples=10).setup("fit")
