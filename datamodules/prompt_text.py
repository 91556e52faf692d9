"""``PromptTextDataModule``: the papers' language-model tasks, sampled as the papers do, rendered as prompts.

The task suite, file layouts and templates are in :mod:`datamodules.text_tasks`. This module samples the
training pool, renders the examples and builds the tensors of three prompt modes.

Sampling (all seeded by ``data_seed``; the same seed gives the same sets)
-------------------------------------------------------------------------
* ``k_shot``: ``k`` examples per class from the training file (LM-BFF / MeZO's RoBERTa setting, e.g.
  ``k_shot=512`` with seeds 13, 21, 42, 87, 100): the file is permuted once with ``data_seed`` and the
  first ``k`` examples of each class are kept (LM-BFF's ``generate_k_shot_data.py`` does the same with
  NumPy). A class with fewer examples keeps all of them (with a warning). With the ``lm-bff`` layout the
  folder ``<k_shot>-<data_seed>`` is already sampled and is read as is.
* ``num_train``: a random subset of that size (MeZO's OPT setting: 1,000).
* ``k_dev`` / ``num_dev``: a validation set drawn from the *remaining* training examples, disjoint from
  the training pool (MeZO appends ``num_dev`` = 500 examples to its training sample; LM-BFF draws ``k``
  per class). With the ``lm-bff`` layout the folder's ``dev`` file is the validation set (``num_dev`` /
  ``k_dev`` subsample it). Without any, the base class uses ``val_fraction`` or the test set.
* ``num_test``: a random subset of the test set, drawn with ``test_seed`` (``data_seed`` when
  ``None``; MeZO samples its 1,000 evaluation examples with the training seed). The test set is the
  original dev/validation file (see :mod:`datamodules.text_tasks`), as in LM-BFF and MeZO.

Duplicate training examples (same text fields) are dropped before sampling, keeping the first, so no
example can sit on both sides of the private/public split.

Prompt modes and batches
------------------------
``prompt="mlm"`` (masked LM, e.g. RoBERTa with :class:`lit_zodp.backbones.HFPromptClassifier`): inputs
``{input_ids [L], attention_mask [L]}`` of ``special prefix + template + special suffix``
(``<s> ... </s>`` for RoBERTa, ``[CLS] ... [SEP]`` for BERT), right-padded to ``L = max_length``, with
exactly one ``tokenizer.mask_token_id``. The template's parts are tokenized separately and concatenated
(LM-BFF); when too long, the text fields are cut from their end, longest first, never the template's
own words or the mask (a template that cannot fit raises). A mask token written inside the data
becomes ``unk``. ``datamodule.label_words`` lists the label word of each class (read with a leading
space: pass it to ``HFPromptClassifier(label_words=...)``).

``prompt="causal"`` (candidate scoring, e.g. OPT): inputs ``{input_ids [K, L], attention_mask [K, L],
candidate_mask [K, L]}`` (``torch.long``; batches ``[B, K, L]``), row ``k`` being the special prefix
(OPT's ``</s>`` BOS; none for GPT-2) + prompt + candidate ``k``, left-aligned and right-padded to
``L = max_length``; ``candidate_mask`` is 1 exactly on candidate ``k``'s tokens (the tokens to score).
The target is the index of the correct candidate; at least one token precedes the candidates (the
first candidate token is predicted from it). The prompt is tokenized as one string and the
candidate separately (the same tokens as MeZO's joint encoding, since candidates start at a word
boundary); a prompt too long for ``L - longest candidate`` loses its *first* tokens (MeZO's left
truncation), the same prompt for every row; candidates are never cut.

``prompt="none"``: plain sentence(-pair) tokenization ``{input_ids, attention_mask[, token_type_ids]}``
``[L]`` for a sequence-classification head (:class:`lit_zodp.backbones.HFSequenceClassifier`).

An empty Poisson batch collates to zero rows of the same trailing shape (``[0, L]`` or ``[0, K, L]``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset

from datamodules.base import PUBLIC_SEED_OFFSET, DataSplits, PublicPrivateDataModule
from datamodules.datasets import TensorPairDataset, items_and_labels
from datamodules.text_tasks import (
    DATA_FORMATS,
    MASK,
    PROMPT_MODES,
    TASK_NAMES,
    Field,
    TaskSpec,
    TaskSplit,
    describe,
    get_task,
    load_task,
    render_text,
)
from lit_zodp.errors import check_positive_int

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ----------------------------------------------------------------------------------- records


class PromptRecords(Dataset):
    """Normalized task examples ``(record, label)``: ``record`` maps the task's fields to strings."""

    def __init__(self, records: Sequence[Mapping[str, str]], labels: Sequence[int]) -> None:
        self.records = [dict(r) for r in records]
        self.labels = torch.as_tensor(list(labels), dtype=torch.long)
        if len(self.records) != len(self.labels):
            raise ValueError(f"{len(self.records)} records but {len(self.labels)} labels")

    @classmethod
    def from_split(cls, split: TaskSplit, indices: Optional[Sequence[int]] = None) -> "PromptRecords":
        indices = range(len(split)) if indices is None else indices
        return cls([split.records[i] for i in indices], [split.labels[i] for i in indices])

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int):
        return self.records[index], self.labels[index]


def records_and_labels(dataset: Dataset) -> tuple[list[dict[str, str]], Tensor]:
    """Records and labels of a :class:`PromptRecords` or of (nested) subsets of one."""
    return items_and_labels(dataset, PromptRecords, "records")


def record_key(spec: TaskSpec, record: Mapping[str, str]) -> tuple[str, ...]:
    """Identity of an example: its text fields in the task's order."""
    return tuple(record[name] for name in spec.fields)


def dedupe(spec: TaskSpec, split: TaskSplit) -> TaskSplit:
    """Drop repeated examples (same text fields), keeping the first."""
    seen: set = set()
    keep = []
    for i, record in enumerate(split.records):
        key = record_key(spec, record)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    if len(keep) == len(split):
        return split
    return TaskSplit([split.records[i] for i in keep], [split.labels[i] for i in keep], split.path)


# ---------------------------------------------------------------------------------- sampling


def per_class_first(labels: Sequence[int], order: Sequence[int], k: int, num_classes: int, what: str = "") -> list[int]:
    """The first ``k`` indices of each class along ``order`` (warns for a class with fewer)."""
    counts = [0] * num_classes
    chosen = []
    for index in order:
        label = labels[index]
        if counts[label] < k:
            counts[label] += 1
            chosen.append(index)
    short = {c: n for c, n in enumerate(counts) if n < k}
    if short:
        warnings.warn(f"{what}: fewer than {k} examples for classes {short} (class: count); kept all of them")
    return chosen


def sample_pool(
    labels: Sequence[int],
    num_classes: int,
    seed: int,
    *,
    k_shot: Optional[int] = None,
    num_train: Optional[int] = None,
    k_dev: Optional[int] = None,
    num_dev: Optional[int] = None,
    what: str = "",
) -> tuple[list[int], list[int]]:
    """Sorted (train, dev) indices of a training file (see the module docs); disjoint by construction.

    Args:
        labels: label of each example of the file.
        num_classes: number of classes.
        seed: seed of the one permutation every draw reads.
        k_shot: examples per class of the training pool; or ``num_train`` examples; else all the
            examples not taken for dev.
        k_dev: examples per class of the dev set, or ``num_dev`` examples, from the examples not in the
            training pool.
    """
    n = len(labels)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    train: Optional[list[int]] = None
    if k_shot is not None:
        train = per_class_first(labels, order, k_shot, num_classes, what)
    elif num_train is not None:
        if num_train > n:
            warnings.warn(f"{what}: num_train={num_train} but the file holds {n} examples; kept all of them")
        train = order[:num_train]
    taken = set(train or ())
    rest = [i for i in order if i not in taken]
    dev: list[int] = []
    if k_dev is not None:
        dev = per_class_first(labels, rest, k_dev, num_classes, f"{what} (dev)")
    elif num_dev is not None:
        if num_dev > len(rest):
            warnings.warn(f"{what}: num_dev={num_dev} but only {len(rest)} examples are left for dev")
        dev = rest[:num_dev]
    if train is None:
        dev_set = set(dev)
        train = [i for i in range(n) if i not in dev_set]
    return sorted(train), sorted(dev)


def random_indices(size: int, num: Optional[int], seed: int) -> list[int]:
    """Sorted indices of a seeded random subset of ``num`` out of ``size`` (all when ``num`` is None)."""
    if num is None or num >= size:
        return list(range(size))
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed))
    return sorted(order[:num].tolist())


# --------------------------------------------------------------------------------- tokenizing


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Give a tokenizer without a padding token one (EOS, else UNK), as decoder LMs need."""
    if getattr(tokenizer, "pad_token", None) is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special tokens a tokenizer puts before and after one sequence.

    RoBERTa: ``([<s>], [</s>])``; BERT: ``([CLS], [SEP])``; OPT: ``([</s>], [])``; GPT-2: ``([], [])``.
    """
    probe = "hello world"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start]), list(full[start + len(plain) :])
    raise ValueError(f"cannot locate the text among the special tokens of {type(tokenizer).__name__}: {full}")


def _token_ids(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    if not texts:
        return []
    return list(tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"])


def fit_lengths(lengths: Sequence[int], budget: int) -> list[int]:
    """New lengths of truncatable spans with sum ``<= budget``: the longest spans are cut first
    (each span is cut to a common cap; spans shorter than the cap are kept whole)."""
    if budget < 0:
        raise ValueError(f"negative budget {budget}")
    if sum(lengths) <= budget:
        return list(lengths)
    low, high = 0, max(lengths)
    while low < high:  # largest cap with sum(min(l, cap)) <= budget
        cap = (low + high + 1) // 2
        if sum(min(n, cap) for n in lengths) <= budget:
            low = cap
        else:
            high = cap - 1
    new = [min(n, low) for n in lengths]
    left = budget - sum(new)
    for i, n in enumerate(lengths):  # hand the remainder out, first spans first
        if left == 0:
            break
        if n > new[i]:
            new[i] += 1
            left -= 1
    return new


def encode_mlm(
    tokenizer: Any, spec: TaskSpec, records: Sequence[Mapping[str, str]], max_length: int
) -> dict[str, Tensor]:
    """Masked-LM prompts ``{input_ids, attention_mask}`` ``[N, max_length]`` (see the module docs)."""
    if spec.mlm is None:
        raise ValueError(f"{spec.name} has no masked-LM template; prompt modes: {list(spec.prompt_modes)}")
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise ValueError(
            f"prompt='mlm' needs a tokenizer with a mask token; {type(tokenizer).__name__} has none "
            "(use prompt='causal' for decoder LMs)"
        )
    prefix, suffix = special_affixes(tokenizer)
    unk_id = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else tokenizer.pad_token_id
    pieces: list[tuple[str, Any]] = []  # ("mask", None) / ("fixed", ids) / ("text", ids per example)
    for part in spec.mlm:
        if part is MASK:
            pieces.append(("mask", None))
        elif isinstance(part, Field):
            ids = _token_ids(tokenizer, [part.render(r) for r in records])
            ids = [[unk_id if t == mask_id else t for t in row] for row in ids]
            pieces.append(("fixed_each" if part.fixed else "text", ids))
        else:
            pieces.append(("fixed", _token_ids(tokenizer, [part])[0]))
    n = len(records)
    input_ids = torch.full((n, max_length), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, max_length), dtype=torch.long)
    for i in range(n):
        spans = [
            [mask_id] if kind == "mask" else (ids if kind == "fixed" else ids[i]) for kind, ids in pieces
        ]
        cut = [kind == "text" for kind, _ in pieces]
        fixed_len = len(prefix) + len(suffix) + sum(len(s) for s, c in zip(spans, cut) if not c)
        if fixed_len > max_length:
            raise ValueError(
                f"{spec.name}: the masked-LM template needs {fixed_len} tokens without its text fields, "
                f"more than max_length={max_length}: the mask would be lost; raise max_length"
            )
        lengths = fit_lengths([len(s) for s, c in zip(spans, cut) if c], max_length - fixed_len)
        it = iter(lengths)
        row = list(prefix)
        for span, c in zip(spans, cut):
            row.extend(span[: next(it)] if c else span)
        row.extend(suffix)
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention[i, : len(row)] = 1
    counts = (input_ids == mask_id).sum(1)
    if n and not bool((counts == 1).all()):
        raise ValueError(f"{spec.name}: a prompt lost its mask or has several: counts {counts.tolist()}")
    return {"input_ids": input_ids, "attention_mask": attention}


def candidate_texts(spec: TaskSpec, record: Mapping[str, str]) -> list[str]:
    """The ``K`` candidate completions of one example, in label order."""
    if spec.candidates is None:
        raise ValueError(f"{spec.name} has no causal candidates; prompt modes: {list(spec.prompt_modes)}")
    return [c.render(record) if isinstance(c, Field) else c for c in spec.candidates]


def encode_causal(
    tokenizer: Any, spec: TaskSpec, records: Sequence[Mapping[str, str]], max_length: int
) -> dict[str, Tensor]:
    """Candidate-scoring inputs ``{input_ids, attention_mask, candidate_mask}`` ``[N, K, max_length]``."""
    if spec.causal is None:
        raise ValueError(f"{spec.name} has no causal template; prompt modes: {list(spec.prompt_modes)}")
    prefix, _ = special_affixes(tokenizer)
    prompts = _token_ids(tokenizer, [render_text(spec.causal, r) for r in records])
    k = spec.num_classes
    fixed = spec.fixed_candidates
    if fixed is not None:
        shared = _token_ids(tokenizer, fixed)
        candidates = [shared] * len(records)
    else:
        flat = _token_ids(tokenizer, [t for r in records for t in candidate_texts(spec, r)])
        candidates = [flat[i * k : (i + 1) * k] for i in range(len(records))]
    n = len(records)
    shape = (n, k, max_length)
    input_ids = torch.full(shape, tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long)
    candidate_mask = torch.zeros(shape, dtype=torch.long)
    for i in range(n):
        cands = candidates[i]
        if any(len(c) == 0 for c in cands):
            raise ValueError(f"{spec.name}: example {i} has an empty candidate: {candidate_texts(spec, records[i])}")
        room = max_length - len(prefix) - max(len(c) for c in cands)
        if room < 0:
            raise ValueError(
                f"{spec.name}: a candidate of {max(len(c) for c in cands)} tokens does not fit in "
                f"max_length={max_length}; raise max_length"
            )
        prompt = prompts[i][len(prompts[i]) - room :] if len(prompts[i]) > room else prompts[i]
        start = len(prefix) + len(prompt)
        if start == 0:
            raise ValueError(
                f"{spec.name}: example {i} leaves no token before its candidates (no BOS and an empty or fully "
                f"truncated prompt), so nothing predicts a candidate's first token; raise max_length"
            )
        for j, cand in enumerate(cands):
            row = prefix + prompt + cand
            input_ids[i, j, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention[i, j, : len(row)] = 1
            candidate_mask[i, j, start : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "candidate_mask": candidate_mask}


def encode_plain(
    tokenizer: Any, spec: TaskSpec, records: Sequence[Mapping[str, str]], max_length: int
) -> dict[str, Tensor]:
    """Sentence(-pair) inputs ``{input_ids, attention_mask[, token_type_ids]}`` ``[N, max_length]``."""
    if spec.pair is None:
        raise ValueError(f"{spec.name} has no plain (sentence-pair) form; prompt modes: {list(spec.prompt_modes)}")
    if not records:
        return {key: torch.zeros((0, max_length), dtype=torch.long) for key in ("input_ids", "attention_mask")}
    texts = [[render_text(parts, r) for r in records] for parts in spec.pair]
    encoded = tokenizer(
        *texts, truncation=True, max_length=max_length, padding="max_length", return_tensors="pt", verbose=False
    )
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in encoded]
    return {key: encoded[key].long() for key in keys}


ENCODERS = {"mlm": encode_mlm, "causal": encode_causal, "none": encode_plain}


def encode_records(
    tokenizer: Any, spec: TaskSpec, records: Sequence[Mapping[str, str]], prompt: str, max_length: int
) -> dict[str, Tensor]:
    """Tensors of ``records`` in a prompt mode (``"mlm"``, ``"causal"`` or ``"none"``)."""
    if prompt not in ENCODERS:
        raise ValueError(f"Unknown prompt mode {prompt!r}; expected one of {list(ENCODERS)}")
    return ENCODERS[prompt](tokenizer, spec, records, max_length)


# -------------------------------------------------------------------------------- data module


def _check_optional_positive(name: str, value: Any) -> Optional[str]:
    return None if value is None else check_positive_int(name, value)


class PromptTextDataModule(PublicPrivateDataModule):
    """One of the papers' language-model tasks, sampled as the papers do and rendered as prompts.

    Example (DPZero Table 2, RoBERTa-large on SST-2, seed 42)::

        dm = PromptTextDataModule("SST-2", "data/original", k_shot=512, num_test=1000, data_seed=42,
                                  prompt="mlm", tokenizer="roberta-large", batch_size=64)
        model = HFPromptClassifier("roberta-large", label_words=dm.label_words)

    and DPZero Table 4 (OPT on BoolQ): ``PromptTextDataModule("BoolQ", "data/superglue",
    num_train=1000, num_dev=500, num_test=1000, prompt="causal", tokenizer="facebook/opt-1.3b")``.

    Args:
        task: one of ``SST-2, SST-5, SNLI, MNLI, RTE, TREC, BoolQ, CB, WIC, WSC, COPA, MultiRC`` (any case).
        data_dir: folder holding the task folder (or the task folder; see :mod:`datamodules.text_tasks`),
            or with ``data_format="hf"`` a ``datasets`` name (``""`` for the task's default).
        data_format: ``auto``, ``glue`` (original full files), ``lm-bff`` (``<k>-<seed>`` folders),
            ``superglue`` (``*.jsonl``) or ``hf``.
        prompt: ``mlm`` (masked-LM template with one mask), ``causal`` (``K`` candidate completions) or
            ``none`` (plain sentence-pair tokenization); see the module docs for the batch formats.
        tokenizer: Hugging Face id or local path of the tokenizer (``"minilm"`` = the packaged MiniLM).
        max_length: tokens per sequence ``L`` (every row is padded to it).
        k_shot: training examples per class (LM-BFF / MeZO: 512 for RoBERTa; also picks the lm-bff folder).
        num_train: training examples (random subset; MeZO/OPT: 1000). Exclusive with ``k_shot``.
        k_dev: validation examples per class, drawn from the training examples not kept for training.
        num_dev: validation examples (random; MeZO/OPT: 500), from the same remainder. Exclusive with
            ``k_dev``.
        num_test: test examples (random subset of the test file; the papers: 1000).
        test_seed: seed of the ``num_test`` subset; ``None`` uses ``data_seed``.
        public_task: a task whose training file is a separate public source (PAZO: SNLI for MNLI); it
            must have the same classes and fields. Examples equal to a pool example are dropped.
        public_data_dir: folder of ``public_task`` (``data_dir`` when ``None``).
        public_data_format: layout of ``public_task``'s folder.
        public_k_shot: public examples per class (PAZO: 100); ``None`` keeps all (``max_public_samples``
            caps them).
        **kwargs: :class:`PublicPrivateDataModule` arguments (batch_size, data_seed, sampling, ...).

    Attributes:
        spec: the :class:`~datamodules.text_tasks.TaskSpec`.
        labels: class names in label order.
        label_words: the masked-LM label word of each class (``None`` for COPA).
        candidates: the causal candidate completions when the same for every example (``None`` for
            COPA, whose candidates are its two choices).
        template: readable template of the chosen prompt mode.
    """

    def __init__(
        self,
        task: str,
        data_dir: str,
        data_format: Literal["auto", "glue", "lm-bff", "superglue", "hf"] = "auto",
        prompt: Literal["mlm", "causal", "none"] = "mlm",
        tokenizer: str = "minilm",
        max_length: int = 128,
        k_shot: Optional[int] = None,
        num_train: Optional[int] = None,
        k_dev: Optional[int] = None,
        num_dev: Optional[int] = None,
        num_test: Optional[int] = None,
        test_seed: Optional[int] = None,
        public_task: Optional[str] = None,
        public_data_dir: Optional[str] = None,
        public_data_format: Literal["auto", "glue", "lm-bff", "superglue", "hf"] = "auto",
        public_k_shot: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        self.task = task
        self.data_dir = data_dir
        self.data_format = data_format
        self.prompt = prompt
        self.tokenizer_name = tokenizer
        self.max_length = max_length
        self.k_shot = k_shot
        self.num_train = num_train
        self.k_dev = k_dev
        self.num_dev = num_dev
        self.num_test = num_test
        self.test_seed = test_seed
        self.public_task = public_task
        self.public_data_dir = public_data_dir
        self.public_data_format = public_data_format
        self.public_k_shot = public_k_shot
        self.spec: Optional[TaskSpec] = _try_task(task)
        self.public_spec: Optional[TaskSpec] = _try_task(public_task) if public_task is not None else None
        self.known_num_classes = self.spec.num_classes if self.spec is not None else None
        self._tokenizer = None
        self.task_data = None
        super().__init__(**kwargs)

    # ------------------------------------------------------------------------------ checks
    def config_errors(self) -> list[Optional[str]]:
        errors = super().config_errors() + [
            check_positive_int("max_length", self.max_length),
            *(
                _check_optional_positive(name, getattr(self, name))
                for name in ("k_shot", "num_train", "k_dev", "num_dev", "num_test", "public_k_shot")
            ),
        ]
        if self.spec is None:
            errors.append(f"Unknown task {self.task!r}; expected one of {list(TASK_NAMES)}")
        for name in ("data_format", "public_data_format"):
            if getattr(self, name) not in DATA_FORMATS:
                errors.append(f"Expected `{name}` in {DATA_FORMATS}, but got {getattr(self, name)!r}")
        if self.prompt not in PROMPT_MODES:
            errors.append(f"Expected `prompt` in {PROMPT_MODES}, but got {self.prompt!r}")
        elif self.spec is not None and self.prompt not in self.spec.prompt_modes:
            errors.append(
                f"Task {self.spec.name} supports prompt modes {self.spec.prompt_modes}, not {self.prompt!r}"
            )
        if self.k_shot is not None and self.num_train is not None:
            errors.append("Give `k_shot` (examples per class) or `num_train` (examples), not both")
        if self.k_dev is not None and self.num_dev is not None:
            errors.append("Give `k_dev` (examples per class) or `num_dev` (examples), not both")
        if self.test_seed is not None and (isinstance(self.test_seed, bool) or not isinstance(self.test_seed, int)):
            errors.append(f"Expected `test_seed` to be an int or None, but got {self.test_seed!r}")
        if not isinstance(self.tokenizer_name, str) or not self.tokenizer_name.strip():
            errors.append(f"Expected `tokenizer` to be a model id or path, but got {self.tokenizer_name!r}")
        if self.public_task is not None:
            if self.public_spec is None:
                errors.append(f"Unknown public_task {self.public_task!r}; expected one of {list(TASK_NAMES)}")
            elif self.spec is not None and (
                self.public_spec.labels != self.spec.labels or self.public_spec.fields != self.spec.fields
            ):
                errors.append(
                    f"public_task {self.public_spec.name} must share the classes and fields of {self.spec.name}: "
                    f"{list(self.public_spec.labels)} / {list(self.public_spec.fields)} vs "
                    f"{list(self.spec.labels)} / {list(self.spec.fields)}"
                )
        elif self.public_k_shot is not None:
            errors.append("`public_k_shot` needs `public_task`")
        return errors

    # ------------------------------------------------------------------------- attributes
    @property
    def labels(self) -> list[str]:
        """Class names in label order."""
        return list(self.spec.labels)

    @property
    def label_words(self) -> Optional[list[str]]:
        """The masked-LM label word of each class, in label order (``None`` if the task has none)."""
        return None if self.spec.label_words is None else list(self.spec.label_words)

    @property
    def candidates(self) -> Optional[list[str]]:
        """The causal candidates when fixed for the task (``None`` when they come from the example)."""
        return self.spec.fixed_candidates

    @property
    def num_candidates(self) -> int:
        """``K``: candidates per example in causal mode (the number of classes)."""
        return self.spec.num_classes

    @property
    def template(self) -> str:
        """Readable template of the chosen prompt mode."""
        if self.prompt == "mlm":
            return describe(self.spec.mlm, getattr(self.tokenizer, "mask_token", None) or "<mask>")
        if self.prompt == "causal":
            return describe(self.spec.causal) + " + <candidate>"
        return " | ".join(describe(p) for p in self.spec.pair)

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (loaded on first use; given a pad token if it has none)."""
        if self._tokenizer is None:
            from lit_zodp.backbones.huggingface import load_tokenizer

            self._tokenizer = prepare_tokenizer(load_tokenizer(self.tokenizer_name))
        return self._tokenizer

    def label_word_ids(self) -> list[int]:
        """Token ids of the label words read with a leading space, as ``HFPromptClassifier`` does;
        raises if a word is not a single token of this tokenizer."""
        if self.label_words is None:
            raise ValueError(f"{self.spec.name} has no label words")
        ids = []
        for word in self.label_words:
            tokens = self.tokenizer(" " + word, add_special_tokens=False)["input_ids"]
            if len(tokens) != 1:
                raise ValueError(f"label word {word!r} is {len(tokens)} tokens for {self.tokenizer_name!r}")
            ids.append(tokens[0])
        return ids

    # ------------------------------------------------------------------------------ loading
    def load_splits(self) -> DataSplits:
        spec = self.spec
        data = load_task(spec, self.data_dir, self.data_format, self.k_shot, self.data_seed)
        self.task_data = data
        train = dedupe(spec, data.train)
        presampled = data.data_format == "lm-bff"
        what = f"{spec.name} ({data.train.path})"
        if presampled:  # the k-shot folder is the sample; num_train / num_dev may subsample it
            pool_idx = random_indices(len(train), self.num_train, self.data_seed)
            dev = None
            if data.dev is not None:
                dev_split = data.dev
                if self.k_dev is not None:
                    generator = torch.Generator().manual_seed(self.data_seed)
                    order = torch.randperm(len(dev_split), generator=generator).tolist()
                    dev_idx = sorted(per_class_first(dev_split.labels, order, self.k_dev, spec.num_classes, what))
                else:
                    dev_idx = random_indices(len(dev_split), self.num_dev, self.data_seed)
                dev = PromptRecords.from_split(dev_split, dev_idx)
        else:
            pool_idx, dev_idx = sample_pool(
                train.labels,
                spec.num_classes,
                self.data_seed,
                k_shot=self.k_shot,
                num_train=self.num_train,
                k_dev=self.k_dev,
                num_dev=self.num_dev,
                what=what,
            )
            dev = PromptRecords.from_split(train, dev_idx) if dev_idx else None
        pool = PromptRecords.from_split(train, pool_idx)
        test_seed = self.data_seed if self.test_seed is None else self.test_seed
        test = PromptRecords.from_split(data.test, random_indices(len(data.test), self.num_test, test_seed))
        pool_ids = [record_key(spec, r) for r in pool.records]
        splits = DataSplits(train=pool, val=dev, test=test, num_classes=spec.num_classes, train_ids=pool_ids)
        if self.public_task is not None:
            splits.public, splits.public_ids = self._load_public(set(pool_ids))
        return splits

    def _load_public(self, pool_ids: set) -> tuple[PromptRecords, list[Hashable]]:
        spec = self.public_spec
        seed = self.data_seed + PUBLIC_SEED_OFFSET
        folder = self.public_data_dir or self.data_dir
        data = load_task(spec, folder, self.public_data_format, self.public_k_shot, self.data_seed)
        train = dedupe(spec, data.train)
        keep = [i for i, r in enumerate(train.records) if record_key(self.spec, r) not in pool_ids]
        train = TaskSplit([train.records[i] for i in keep], [train.labels[i] for i in keep], train.path)
        if self.public_k_shot is not None and data.data_format != "lm-bff":
            what = f"public {spec.name}"
            index, _ = sample_pool(train.labels, spec.num_classes, seed, k_shot=self.public_k_shot, what=what)
        else:
            index = list(range(len(train)))
        public = PromptRecords.from_split(train, index)
        return public, [record_key(self.spec, r) for r in public.records]

    def materialize(self, dataset: Dataset) -> TensorPairDataset:
        """Render and tokenize a kept split in the chosen prompt mode."""
        records, labels = records_and_labels(dataset)
        inputs = encode_records(self.tokenizer, self.spec, records, self.prompt, self.max_length)
        return TensorPairDataset(inputs, labels)


def _try_task(name: Optional[str]) -> Optional[TaskSpec]:
    try:
        return get_task(name)
    except (ValueError, TypeError):
        return None


__all__ = [
    "PromptRecords",
    "PromptTextDataModule",
    "candidate_texts",
    "dedupe",
    "encode_causal",
    "encode_mlm",
    "encode_plain",
    "encode_records",
    "fit_lengths",
    "per_class_first",
    "prepare_tokenizer",
    "random_indices",
    "record_key",
    "records_and_labels",
    "sample_pool",
    "special_affixes",
]
