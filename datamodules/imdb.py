"""IMDB sentiment (Maas et al. 2011) with Amazon Polarity (Zhang et al. 2015) as out-of-distribution public data,
tokenized into words for an LSTM trained from scratch: the data of PAZO's Table 4 (Gong & Li, App. C.1, after
adadps).

Files (read from disk; nothing is downloaded):

* ``<data_dir>/aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt``: the 25,000 labelled training reviews (the
  PRIVATE pool) and the 25,000 test reviews; ``aclImdb/train/unsup/*.txt`` (50,000 unlabelled reviews, disjoint from
  the labelled ones) only for ``vocab_source: "unlabelled"``.
* ``<public_data_dir>/amazon_review_polarity_csv/train.csv``: no header, columns ``label`` (1 negative, 2 positive),
  ``title``, ``content``; 3.6M rows, streamed: a uniform sample of ``public_samples`` rows is kept by reservoir
  sampling (:func:`reservoir_sample`) with a public seed (``data_seed`` + :data:`AMAZON_SEED_OFFSET`), never the whole
  file in memory. A row's text is its title and content joined by a space.

Labels: 0 negative, 1 positive, for both corpora.

Choices where the paper is silent (App. C.1; the notes' sections 3 and 5):

* Tokenization (:func:`word_tokens`): lower-case, HTML line breaks (``<br />``) to spaces, then words (runs of
  letters/digits with inner apostrophes: ``don't``) and single punctuation marks as tokens.
* Truncation keeps the FIRST ``max_length`` tokens (the end of a long review is dropped), as the loader of AdaDPS
  (Li et al. 2022), which the paper's IMDB setup follows, does (``imdb/data/load_imdb.py``:
  ``pad_sequences(..., maxlen=290, padding="post", truncating="post")``; its Keras ids also hold a start token, not
  kept here); no padding is stored beyond each batch's longest row (:class:`~datamodules.collate.PadToLongest`)
  unless ``pad_to_max_length``.
* Duplicate texts are dropped within the train reviews, within the test reviews and within the public sample (first
  occurrence kept, files in id order); a private review equal to a public text leaves the private set (the base
  class, through ids), so the public sample never depends on the private reviews.

DEVIATION (privacy; App. C.1): the paper builds the vocabulary on the top 10K tokens of the IMDB *training* set,
which here is the private set: which words are frequent in private reviews would be released (in the model's
input layer, in every checkpoint) outside any accounting. The vocabulary is built from public text only
(``vocab_source``): the public Amazon sample (default), the unlabelled IMDB reviews, or a word list file. A source
that would read the private reviews is refused.
"""

from __future__ import annotations

import csv
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from datamodules.base import DataSplits, PublicPrivateDataModule
from datamodules.collate import text_collate
from datamodules.datasets import TensorPairDataset, TextDataset, texts_and_labels
from lit_zodp.errors import ConfigError, check_bool, check_choice, check_positive_int

PUBLIC_SOURCES = ("amazon_polarity",)
VOCAB_SOURCES = ("public", "unlabelled", "file")
#: Names a user might give for a vocabulary built on the labelled IMDB reviews (the paper's): refused.
PRIVATE_VOCAB_SOURCES = ("train", "private", "imdb", "labelled", "labeled", "imdb_train")
#: Offset of the public Amazon sample's seed from ``data_seed`` (public randomness).
AMAZON_SEED_OFFSET = 4_000_037
PAD, UNK = "<pad>", "<unk>"
ACL_LAYOUT = "aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt (Maas et al.'s aclImdb_v1.tar.gz, unpacked)"
AMAZON_LAYOUT = ("amazon_review_polarity_csv/train.csv (Zhang et al. 2015's amazon_review_polarity_csv.tgz, "
                 "unpacked: no header, columns label (1 negative, 2 positive), title, content)")

_LINE_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)
_TOKEN = re.compile(r"\w+(?:'\w+)*|[^\w\s]")


def word_tokens(text: str) -> list[str]:
    """The word-level tokens of ``text``: lower-cased, ``<br />`` (any spelling of the HTML line break) replaced by a
    space, then runs of letters, digits or ``_`` with inner apostrophes (``don't``, ``90's``) and every other
    non-space character alone (punctuation: ``!``, ``.``)."""
    return _TOKEN.findall(_LINE_BREAK.sub(" ", text.lower()))


class WordVocabulary:
    """Word ids: ``<pad>`` 0, ``<unk>`` 1, then the words, most frequent first.

    Holds ``convert_tokens_to_ids`` and ``len()`` as a Hugging Face tokenizer does, which is how the modules see that
    the data are tokenized text and check that the backbone embeds every id.

    Args:
        words: the vocabulary's words, most frequent first (no duplicates, no special token).
    """

    pad_token_id, unk_token_id = 0, 1

    def __init__(self, words: Sequence[str]) -> None:
        self.words = [PAD, UNK, *words]
        self.ids = {word: i for i, word in enumerate(self.words)}
        if len(self.ids) != len(self.words):
            raise ValueError("WordVocabulary: repeated words (or a special token) in the word list")

    @classmethod
    def from_texts(cls, texts: Iterable[str], size: int) -> "WordVocabulary":
        """The ``size`` most frequent tokens of ``texts``; ties broken by the word (deterministic)."""
        counts: Counter = Counter()
        for text in texts:
            counts.update(word_tokens(text))
        counts.pop(PAD, None)
        counts.pop(UNK, None)
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        return cls([word for word, _ in ranked[:size]])

    @classmethod
    def from_file(cls, path: str, size: int) -> "WordVocabulary":
        """The first ``size`` words of a file with one word per line, most frequent first (blank lines, repeats and
        the special tokens skipped)."""
        words: list[str] = []
        seen = {PAD, UNK}
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                word = line.strip()
                if word and word not in seen:
                    seen.add(word)
                    words.append(word)
                    if len(words) == size:
                        break
        return cls(words)

    def __len__(self) -> int:
        return len(self.words)

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        """The id of a token (``<unk>``'s for an unknown one), or the ids of a list of tokens."""
        if isinstance(tokens, str):
            return self.ids.get(tokens, self.unk_token_id)
        return [self.ids.get(token, self.unk_token_id) for token in tokens]

    def encode(self, text: str, max_length: int) -> list[int]:
        """The ids of ``text``'s first ``max_length`` tokens (the end of a longer text is dropped)."""
        return self.convert_tokens_to_ids(word_tokens(text)[:max_length])


def encode_texts(vocabulary: WordVocabulary, texts: Sequence[str], labels: torch.Tensor,
                 max_length: int) -> TensorPairDataset:
    """Inputs ``{input_ids, attention_mask}`` ``[N, max_length]``, right-padded with ``<pad>`` (the collate cuts each
    batch to its longest row); an empty text keeps one ``<pad>`` column with mask 0."""
    ids = torch.zeros(len(texts), max_length, dtype=torch.long)
    mask = torch.zeros(len(texts), max_length, dtype=torch.long)
    for row, text in enumerate(texts):
        encoded = vocabulary.encode(text, max_length)
        ids[row, :len(encoded)] = torch.tensor(encoded, dtype=torch.long)
        mask[row, :len(encoded)] = 1
    return TensorPairDataset({"input_ids": ids, "attention_mask": mask}, labels)


def reservoir_sample(rows: Iterable[Any], size: int, seed: int) -> list[tuple[int, Any]]:
    """A uniform sample of ``size`` rows of a stream, without replacement, as ``(row number, row)`` in row order.

    Li's Algorithm L (1994): after the first ``size`` rows, the next row to enter the reservoir is drawn as a
    geometric skip, so only ``O(size log(n / size))`` random numbers are drawn and no more than ``size`` rows are
    held. Every ``size``-subset of the ``n`` rows is equally likely; a stream of ``n <= size`` rows is kept whole.
    The generator is numpy's PCG64 seeded with ``seed`` (public randomness).
    """
    rng = np.random.Generator(np.random.PCG64(seed))
    reservoir: list[tuple[int, Any]] = []
    weight = math.exp(math.log(rng.random()) / size)
    next_index = size + _skip(rng, weight)
    for index, row in enumerate(rows):
        if index < size:
            reservoir.append((index, row))
        elif index == next_index:
            reservoir[int(rng.integers(size))] = (index, row)
            weight *= math.exp(math.log(rng.random()) / size)
            next_index += 1 + _skip(rng, weight)
    return sorted(reservoir, key=lambda item: item[0])


def _skip(rng: np.random.Generator, weight: float) -> int:
    """Rows passed over before the next one enters the reservoir (Algorithm L's geometric skip)."""
    if weight >= 1.0:
        return 0
    if weight <= 0.0:
        return 2 ** 62
    return int(math.floor(math.log(rng.random()) / math.log1p(-weight)))


def amazon_rows(path: Path) -> Iterator[tuple[int, str]]:
    """``(label, text)`` of each row of an Amazon Polarity CSV, streamed: label 0 negative (file: 1), 1 positive
    (file: 2); text = title and content joined by a space. A row of another shape or label is refused in one line."""
    with open(path, encoding="utf-8", newline="") as handle:
        for number, row in enumerate(csv.reader(handle), start=1):
            if len(row) != 3 or row[0] not in ("1", "2"):
                raise ConfigError(f"`data.init_args.public_data_dir`: row {number} of {str(path)!r} is not "
                                  f"label (1 or 2), title, content; expected {AMAZON_LAYOUT}")
            yield int(row[0]) - 1, " ".join(part for part in (row[1].strip(), row[2].strip()) if part)


def read_reviews(folder: Path) -> tuple[list[str], list[int]]:
    """Texts and labels (0 neg, 1 pos) of ``folder/{neg,pos}/<id>_<rating>.txt``, in (label, id) order."""
    texts: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(("neg", "pos")):
        for path in sorted(_review_files(folder / name), key=_review_id):
            texts.append(path.read_text(encoding="utf-8"))
            labels.append(label)
    return texts, labels


def _review_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise ConfigError(f"`data.init_args.data_dir`: no folder {str(folder)!r}; expected {ACL_LAYOUT} under "
                          "`data_dir`")
    return list(folder.glob("*.txt"))


def _review_id(path: Path) -> tuple[int, str]:
    """``<id>_<rating>.txt`` sorts by its numeric id (then the name, for files of another pattern)."""
    head = path.stem.split("_", 1)[0]
    return (int(head) if head.isdigit() else -1, path.name)


def first_occurrences(texts: Sequence[str]) -> list[int]:
    """Indices of the first row of each distinct text, in order."""
    seen: set[str] = set()
    kept = []
    for i, text in enumerate(texts):
        if text not in seen:
            seen.add(text)
            kept.append(i)
    return kept


class IMDBDataModule(PublicPrivateDataModule):
    """IMDB reviews (private) with an Amazon Polarity sample (public), word ids for an LSTM (PAZO Table 4).

    Inputs ``{input_ids, attention_mask}`` ``[L]`` (``L <= max_length``), labels 0 negative, 1 positive. Private pool:
    the 25,000 labelled training reviews; test: the 25,000 test reviews (cap evaluation with ``max_eval_samples``;
    App. C.1's code evaluates 2,000 of them). See the module docstring for the files, the tokenizer and the
    vocabulary's deviation from the paper.

    Args:
        data_dir: the folder holding ``aclImdb/``.
        public_source: ``"amazon_polarity"`` (the paper's out-of-distribution public data) or ``None``.
        public_data_dir: the folder holding ``amazon_review_polarity_csv/``; ``None`` uses ``data_dir``.
        public_samples: Amazon rows kept (App. C.1: 4% of the IMDB training size, 2,000; the authors' code uses
            1,000), before duplicate texts are dropped.
        vocab_source: the vocabulary's text, public only: ``"public"`` (the public split's texts), ``"unlabelled"``
            (``aclImdb/train/unsup``) or ``"file"`` (``vocab_path``).
        vocab_path: a word list (one word per line, most frequent first) for ``vocab_source: "file"``.
        vocab_size: words in the vocabulary (App. C.1: 10,000); the ids are ``vocab_size + 2`` (``<pad>``, ``<unk>``)
            at most.
        max_length: tokens per review at most (the notes: 290); the first ones are kept.
        pad_to_max_length: pad every batch to ``max_length`` instead of its longest row.
        **kwargs: :class:`PublicPrivateDataModule` arguments (``batch_size``: App. C.1's b = 64).
    """

    known_num_classes = 2

    def __init__(
        self,
        data_dir: str = "data",
        public_source: Optional[Literal["amazon_polarity"]] = "amazon_polarity",
        public_data_dir: Optional[str] = None,
        public_samples: int = 2000,
        vocab_source: Literal["public", "unlabelled", "file"] = "public",
        vocab_path: Optional[str] = None,
        vocab_size: int = 10_000,
        max_length: int = 290,
        pad_to_max_length: bool = False,
        **kwargs: Any,
    ) -> None:
        self.data_dir = data_dir
        self.public_source = public_source
        self.public_data_dir = public_data_dir
        self.public_samples = public_samples
        self.vocab_source = vocab_source
        self.vocab_path = vocab_path
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.pad_to_max_length = pad_to_max_length
        self._public_texts: Optional[tuple[list[str], list[int]]] = None
        self._vocabulary: Optional[WordVocabulary] = None
        super().__init__(**kwargs)

    def config_errors(self) -> list[Optional[str]]:
        return super().config_errors() + [
            check_positive_int("vocab_size", self.vocab_size),
            check_positive_int("max_length", self.max_length),
            check_positive_int("public_samples", self.public_samples),
            None if self.public_source is None else check_choice("public_source", self.public_source, PUBLIC_SOURCES),
            check_bool("pad_to_max_length", self.pad_to_max_length),
            *self._vocabulary_errors(),
        ]

    def _vocabulary_errors(self) -> list[Optional[str]]:
        source = self.vocab_source
        if source in PRIVATE_VOCAB_SOURCES:
            return [f"`vocab_source`={source!r} would build the vocabulary on the labelled IMDB training reviews, "
                    "the private set (App. C.1 does): which words are frequent in them would be released outside the "
                    f"privacy accounting; use one of {list(VOCAB_SOURCES)} (public text only)"]
        errors = [check_choice("vocab_source", source, VOCAB_SOURCES)]
        if source == "public" and self.public_source is None:
            errors.append("`vocab_source`='public' builds the vocabulary on the public texts, but `public_source` is "
                          "None: set `public_source: amazon_polarity` or `vocab_source: unlabelled` or `file`")
        if (source == "file") != (self.vocab_path is not None):
            errors.append("`vocab_path` is read with `vocab_source`='file' only, and that source needs it: set both "
                          f"or neither (got vocab_source={source!r}, vocab_path={self.vocab_path!r})")
        return errors

    # ------------------------------------------------------------------------------------------ files
    @property
    def imdb_dir(self) -> Path:
        return Path(self.data_dir) / "aclImdb"

    @property
    def amazon_csv(self) -> Path:
        return Path(self.public_data_dir or self.data_dir) / "amazon_review_polarity_csv" / "train.csv"

    def public_texts(self) -> Optional[tuple[list[str], list[int]]]:
        """The public sample's texts and labels (duplicates dropped), read once; ``None`` without a public source.
        A function of the Amazon file and ``data_seed`` alone."""
        if self.public_source is None:
            return None
        if self._public_texts is None:
            path = self.amazon_csv
            if not path.is_file():
                raise ConfigError(f"`data.init_args.public_data_dir`: no file {str(path)!r}; expected {AMAZON_LAYOUT} "
                                  "under `public_data_dir` (or `data_dir`)")
            sample = [row for _, row in reservoir_sample(amazon_rows(path), self.public_samples,
                                                         self.data_seed + AMAZON_SEED_OFFSET)]
            if len(sample) < self.public_samples:
                raise ConfigError(f"`public_samples`={self.public_samples} exceeds the {len(sample)} rows of "
                                  f"{str(path)!r}")
            self._public_texts = _deduplicated([text for _, text in sample], [label for label, _ in sample])
        return self._public_texts

    @property
    def tokenizer(self) -> WordVocabulary:
        """The vocabulary (built on first use from public text only; see the module docstring)."""
        if self._vocabulary is None:
            self._vocabulary = self._build_vocabulary()
        return self._vocabulary

    vocabulary = tokenizer

    def _build_vocabulary(self) -> WordVocabulary:
        if self.vocab_source == "file":
            if not Path(self.vocab_path).is_file():
                raise ConfigError(f"`data.init_args.vocab_path`: no file {self.vocab_path!r} (one word per line, "
                                  "most frequent first)")
            return WordVocabulary.from_file(self.vocab_path, self.vocab_size)
        if self.vocab_source == "unlabelled":
            files = sorted(_review_files(self.imdb_dir / "train" / "unsup"), key=_review_id)
            return WordVocabulary.from_texts((path.read_text(encoding="utf-8") for path in files), self.vocab_size)
        return WordVocabulary.from_texts(self.public_texts()[0], self.vocab_size)

    # ------------------------------------------------------------------------------------------ splits
    def load_splits(self) -> DataSplits:
        self.tokenizer  # (public files first: a missing one is said before the private reviews are read)
        train_texts, train_labels = _deduplicated(*read_reviews(self.imdb_dir / "train"))
        test_texts, test_labels = _deduplicated(*read_reviews(self.imdb_dir / "test"))
        splits = DataSplits(
            train=TextDataset(train_texts, torch.tensor(train_labels, dtype=torch.long)),
            test=TextDataset(test_texts, torch.tensor(test_labels, dtype=torch.long)),
            num_classes=2,
            train_ids=train_texts,
            deduplicated=True,
        )
        public = self.public_texts()
        if public is not None:
            splits.public = TextDataset(public[0], torch.tensor(public[1], dtype=torch.long))
            splits.public_ids = public[0]
        return splits

    def materialize(self, dataset: Dataset) -> TensorPairDataset:
        """Word ids of a kept split (:func:`encode_texts`)."""
        texts, labels = texts_and_labels(dataset)
        return encode_texts(self.tokenizer, texts, labels, self.max_length)

    def batch_collate(self) -> Optional[Callable[[list], Any]]:
        """Pad each batch to its longest review, unless ``pad_to_max_length``."""
        return text_collate(self.pad_to_max_length)

    def model_mismatch(self, model: Any) -> Optional[str]:
        """A pretrained transformer backbone (its embedding table is another vocabulary's: these word ids would index
        it as nonsense), or a backbone that declares which token ids it embeds (``token_ids_mismatch``: the
        :class:`~lit_zodp.backbones.lstm.LSTMClassifier`) and cannot embed this vocabulary's (``<pad>``, ``<unk>``
        and the words): one line at setup, before a forward indexes past its table."""
        backbone = getattr(model, "backbone", None)
        if any(hasattr(getattr(backbone, name, None), "get_input_embeddings") for name in ("model", "encoder")):
            return (f"Model/data mismatch: IMDBDataModule gives word ids of its own vocabulary, which the pretrained "
                    f"{type(backbone).__name__} does not read: use LSTMClassifier, or MovieReviewsDataModule (IMDB "
                    "with the model's tokenizer)")
        check = getattr(backbone, "token_ids_mismatch", None)
        if not callable(check):
            return None
        error = check(len(self.tokenizer))
        return None if error is None else f"Model/data mismatch: {error} (the data's `vocab_size` {self.vocab_size} " \
                                          "words, <pad> and <unk>)"


def _deduplicated(texts: list[str], labels: list[int]) -> tuple[list[str], list[int]]:
    kept = first_occurrences(texts)
    return [texts[i] for i in kept], [labels[i] for i in kept]


__all__ = [
    "AMAZON_SEED_OFFSET",
    "IMDBDataModule",
    "WordVocabulary",
    "amazon_rows",
    "encode_texts",
    "read_reviews",
    "reservoir_sample",
    "word_tokens",
]
