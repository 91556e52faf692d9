"""Fabricated ``aclImdb/`` and ``amazon_review_polarity_csv/`` folders in the real datasets' layouts (tests only)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional, Sequence

#: (text, label) of the fabricated labelled reviews: 0 negative, 1 positive.
TRAIN = [
    ("A dull film.<br /><br />Boring plot, bad acting. privateword", 0),
    ("Terrible and boring, I hated it", 0),
    ("Awful movie: bad bad bad", 0),
    ("A great film, I loved it!", 1),
    ("Wonderful acting and a good plot", 1),
    ("Good fun, great cast", 1),
]
TEST = [("Bad and boring", 0), ("Dull film", 0), ("Great movie", 1), ("Loved the acting", 1)]


def write_reviews(folder: Path, reviews: Sequence[tuple[str, int]]) -> None:
    """``folder/{neg,pos}/<id>_<rating>.txt`` (rating 2 for negative, 9 for positive)."""
    for name in ("neg", "pos"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    for review_id, (text, label) in enumerate(reviews):
        name, rating = ("pos", 9) if label else ("neg", 2)
        (folder / name / f"{review_id}_{rating}.txt").write_text(text, encoding="utf-8")


def write_imdb(root: Path, train: Sequence[tuple[str, int]] = TRAIN, test: Sequence[tuple[str, int]] = TEST,
               unsup: Optional[Sequence[str]] = None) -> Path:
    """``root/aclImdb`` with the given reviews; ``unsup`` texts in ``train/unsup/<id>_0.txt``."""
    write_reviews(root / "aclImdb" / "train", train)
    write_reviews(root / "aclImdb" / "test", test)
    if unsup is not None:
        (root / "aclImdb" / "train" / "unsup").mkdir(parents=True)
        for review_id, text in enumerate(unsup):
            (root / "aclImdb" / "train" / "unsup" / f"{review_id}_0.txt").write_text(text, encoding="utf-8")
    return root


def amazon_row(k: int) -> tuple[str, str, str]:
    """Row ``k`` of the fabricated Amazon file: (file label, title, content); even rows negative."""
    label = "1" if k % 2 == 0 else "2"
    words = "bad poor product" if label == "1" else "great good product"
    return label, f"Review {k}", f"A {words}, number r{k}.\nSecond line"


def write_amazon(root: Path, rows: int = 60, extra: Sequence[tuple[str, str, str]] = ()) -> Path:
    """``root/amazon_review_polarity_csv/train.csv``: ``rows`` rows of :func:`amazon_row`, then ``extra``."""
    folder = root / "amazon_review_polarity_csv"
    folder.mkdir(parents=True)
    with open(folder / "train.csv", "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, quoting=csv.QUOTE_ALL)
        writer.writerows([amazon_row(k) for k in range(rows)] + list(extra))
    return root


def amazon_text(k: int) -> str:
    """The public text of :func:`amazon_row` ``k`` (title and content joined by a space)."""
    _, title, content = amazon_row(k)
    return f"{title} {content}"
