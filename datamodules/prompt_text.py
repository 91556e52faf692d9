"""``PromptTextDataModule``: the papers' language-model tasks, sampled as the papers do, rendered as prompts.

The task suite, file layouts and templates are in :mod:`datamodules.text_tasks`. This module samples the
training pool, renders the examples and builds the tensors of three prompt modes.

Sampling: the references' NumPy draws, reproduced row for row
-------------------------------------------------------------
Every draw permutes the *rows* of a file with ``np.random.RandomState(seed).permutation`` (what
``np.random.seed(seed); np.random.shuffle(lines)`` and MeZO's ``np.random.permutation`` under
``temp_seed(seed)`` do), rows that hold no example included, so each example lands where the
reference puts it (:func:`numpy_permutation`, :func:`shuffled_examples`).

* ``k_shot`` (LM-BFF's ``tools/generate_k_shot_data.py``, used unchanged by MeZO and DPZero for
  RoBERTa with ``k = 512`` and seeds 13, 21, 42, 87, 100): the training file's rows are shuffled with
  ``data_seed`` and grouped by label, the groups in the order their first example appears; the first
  ``k`` of each group are the training pool, the next ``k_dev`` (LM-BFF: ``k``) the dev set
  (:func:`k_shot_draw`). The same procedure for every task (SNLI, MNLI, SST-5, TREC included; only the
  file reader differs). A class with fewer examples keeps all of them (with a warning). With the
  ``lm-bff`` layout the folder ``<k_shot>-<data_seed>`` is already sampled and is read as is.
* ``num_train`` / ``num_dev`` (MeZO's ``sample_train_sets`` for OPT: 1,000 / 500): the first
  ``num_train + num_dev`` examples of the shuffled file, the last ``num_dev`` of them for dev. A file
  shorter than that keeps its ``num_dev`` dev examples and trains on the rest, as MeZO does (CB, 250
  examples, at MeZO's 1,000 / 100: 150 train, 100 dev; COPA, 400: 300 / 100), with a warning.
* ``num_test``: the examples on the first ``num_test`` rows of the test file shuffled with the test
  seed (all of them, in file order, when the file is not longer) (:func:`row_subset`). With
  ``k_shot`` the seed is 42 for every data seed, as in MeZO/DPZero's ``k-shot-1k-test`` generator
  (``np.random.seed(42)`` before shuffling a GLUE dev file, ``DataFrame.sample(n=1000,
  random_state=42)`` for SST-5/TREC: the same rows); otherwise ``data_seed`` (MeZO's ``num_eval``).
  The test set is the original dev/validation file (see :mod:`datamodules.text_tasks`).

The references keep repeated examples (GLUE's SST-2, for one, repeats phrases); so does the
default here. ``dedupe=True`` skips the repeats of an earlier row (they stay in the permutation, so the
other examples keep their places); set it when part of the pool becomes public (``public_fraction``),
where a repeat could otherwise sit on both sides. A separate public source (``public_task``) drops its
own repeats only, so it depends on its file alone; the private rows equal to one of its examples are
dropped from the private set instead (which is then defined after that filter; ``n_private`` counts
the rows left).

Prompt modes and batches
------------------------
``prompt="mlm"`` (masked LM, e.g. RoBERTa with :class:`lit_zodp.backbones.HFPromptClassifier`): inputs
``{input_ids [L], attention_mask [L]}`` of ``special prefix + template + special suffix`` (``<s> ...
</s>`` for RoBERTa, ``[CLS] ... [SEP]`` for BERT), right-padded, with exactly one
``tokenizer.mask_token_id``. The template's parts are tokenized separately and concatenated (LM-BFF);
when too long, the text fields are cut from their end, longest first, never the template's own words or
the mask (a template that cannot fit raises); ``truncation="tail"`` (the default of ``faithful=True``)
instead cuts the whole sequence at ``max_length`` as LM-BFF does, after ``first_sent_limit`` (LM-BFF's
option) has cut the first text field. ``faithful=True`` renders LM-BFF's templates token for token
(values as read; ``*sent-_0*`` drops the last character whatever it is); the default strips the values
and drops only final punctuation. A mask token written inside the data becomes ``unk``.
``datamodule.label_words`` lists the label word of each class (read with a leading space: pass it to
``HFPromptClassifier(label_words=...)``).

``prompt="causal"`` (candidate scoring, e.g. OPT): inputs ``{input_ids [K, L], attention_mask [K, L],
candidate_mask [K, L]}`` (``torch.long``; batches ``[B, K, L]``), row ``k`` being the special prefix
(OPT's ``</s>`` BOS; none for GPT-2) + prompt + candidate ``k``, left-aligned and right-padded;
``candidate_mask`` is 1 exactly on candidate ``k``'s tokens (the tokens to score).
The target is the index of the correct candidate; at least one token precedes the candidates (the
first candidate token is predicted from it). The prompt is tokenized as one string and the
candidate separately (the same tokens as MeZO's joint encoding, since candidates start at a word
boundary); a prompt too long for ``L - longest candidate`` loses its *first* tokens (MeZO's left
truncation), the same prompt for every row; candidates are never cut.

``prompt="none"``: plain sentence(-pair) tokenization ``{input_ids, attention_mask[, token_type_ids]}``
``[L]`` for a sequence-classification head (:class:`lit_zodp.backbones.HFSequenceClassifier`).

Padding: every row is stored padded to ``max_length``; a batch is cut to its longest row (dynamic
padding, the default: only columns that are padding in every row go, so mask positions and candidate
spans are unchanged), or kept at ``L = max_length`` with ``pad_to_max_length=True``. An empty Poisson
batch collates to zero rows of the same trailing shape (``[0, L]`` or ``[0, K, L]``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any, Callable, Literal, Optional, Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from datamodules.base import PUBLIC_SEED_OFFSET, DataSplits, PublicPrivateDataModule
from datamodules.collate import text_collate
from datamodules.datasets import TensorPairDataset, items_and_labels
from datamodules.text_tasks import (
    DATA_FORMATS,
    MASK,
    PROMPT_MODES,
    TASK_NAMES,
    VARYING_TASK_NAMES,
    Field,
    TaskData,
    TaskSpec,
    TaskSplit,
    describe,
    get_task,
    load_task,
    readable_parts,
    render_text,
    source_warning,
)
from lit_zodp.errors import ConfigError, LitZodpWarning, check_bool, check_positive_int

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The seed of the 1,000-example test subsets of MeZO/DPZero's ``k-shot-1k-test`` data (any data seed).
LMBFF_TEST_SEED = 42


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
    """Identity of an example: its text fields in the task's order (surrounding whitespace ignored)."""
    return tuple(record[name].strip() for name in spec.fields)


def record_groups(spec: TaskSpec, records: Sequence[Mapping[str, str]]) -> Optional[list[str]]:
    """The group (``spec.group_field``, e.g. MultiRC's paragraph) of each record, or ``None``."""
    if spec.group_field is None:
        return None
    return [record[spec.group_field].strip() for record in records]


def repeated_examples(spec: TaskSpec, split: TaskSplit) -> set[int]:
    """Indices of the examples whose text repeats an earlier example of the split."""
    known: set[tuple[str, ...]] = set()
    repeats = set()
    for i, record in enumerate(split.records):
        key = record_key(spec, record)
        if key in known:
            repeats.add(i)
        known.add(key)
    return repeats


# ---------------------------------------------------------------------------------- sampling


def numpy_permutation(n: int, seed: int) -> list[int]:
    """``np.random.RandomState(seed).permutation(n)``: where the seeded NumPy draws of the references put
    ``n`` rows. LM-BFF's generator (``np.random.seed(seed); np.random.shuffle(lines)``), MeZO's
    ``sample_subset`` (``np.random.permutation`` under ``temp_seed``) and pandas'
    ``sample(n, random_state=seed)`` all draw this order (position ``j`` holds row ``perm[j]``)."""
    return np.random.RandomState(seed).permutation(n).tolist()


def shuffled_examples(split: TaskSplit, seed: int, exclude: Collection[int] = ()) -> list[int]:
    """Example indices in the order of the split's *rows* shuffled with ``seed`` (:func:`numpy_permutation`).

    Rows that hold no example (a ``.tsv``'s blank or unlabelled lines, which LM-BFF shuffles too) and
    the ``exclude``d examples are skipped, so every other example lands where the reference puts it.
    """
    where = split.row_to_example()
    order = (where.get(row) for row in numpy_permutation(split.row_count, seed))
    return [i for i in order if i is not None and i not in exclude]


def k_shot_draw(
    labels: Sequence[int], order: Sequence[int], k: int, k_dev: Optional[int] = None, what: str = ""
) -> tuple[list[int], list[int]]:
    """LM-BFF's ``generate_k_shot_data.py``: ``order`` grouped by label, the groups in the order their
    first example appears; train = the first ``k`` of each group, dev = the next ``k_dev`` (LM-BFF:
    ``k``). Both lists in the order LM-BFF writes its ``train``/``dev`` files (warns for short groups)."""
    groups: dict[int, list[int]] = {}
    for index in order:
        groups.setdefault(labels[index], []).append(index)
    train = [i for group in groups.values() for i in group[:k]]
    dev = [i for group in groups.values() for i in group[k : k + (k_dev or 0)]]
    short = [c for c, g in sorted(groups.items()) if len(g) < k + (k_dev or 0)]
    if short:
        need = k if not k_dev else f"{k} + {k_dev} (dev)"
        warnings.warn(f"{what}: fewer than {need} examples for classes {short}; kept all of them: lower `k_shot`/"
                      "`k_dev` (`public_k_shot` for a public task) for the same number in every class", LitZodpWarning)
    return train, dev


def sample_pool(
    labels: Sequence[int],
    order: Sequence[int],
    *,
    k_shot: Optional[int] = None,
    num_train: Optional[int] = None,
    k_dev: Optional[int] = None,
    num_dev: Optional[int] = None,
    what: str = "",
) -> tuple[list[int], list[int]]:
    """(train, dev) indices of a training file, drawn from its shuffled ``order`` (see the module docs).

    Args:
        labels: label of each example of the file.
        order: the eligible examples in shuffled order (:func:`shuffled_examples`).
        k_shot: ``k`` examples per class (LM-BFF, with ``k_dev`` the next examples of each class);
            else ``num_train`` examples followed by ``num_dev`` (MeZO: the first ``num_train +
            num_dev`` of the order, dev last); else all examples of ``order`` not taken for dev.
    Returns:
        Disjoint lists, in the references' order (the file order when all examples are kept).
    """
    if k_shot is not None:
        if num_dev is not None:
            train, _ = k_shot_draw(labels, order, k_shot, None, what)
            taken = set(train)
            return train, [i for i in order if i not in taken][:num_dev]
        return k_shot_draw(labels, order, k_shot, k_dev, what)
    # what is printed names the file's size (public), never len(order): with ``dedupe`` that counts the file's
    # repeats, so a warning's text (or whether it fires) told whether one private row repeats another
    size = len(labels)
    if num_train is not None and num_dev is not None and k_dev is None:
        # MeZO's sample_train_sets and run.py: the first num_train + num_dev of the order, dev the LAST num_dev of
        # them, so a short file keeps its dev set and trains on fewer (CB: 250 -> 150 train + 100 dev at 1000 / 100)
        if num_train + num_dev > size:
            warnings.warn(f"{what}: num_train + num_dev = {num_train + num_dev} but the file holds {size} examples; "
                          f"as MeZO, dev is the last {min(num_dev, size)} of them (shuffled) and training the rest "
                          f"(at most {max(size - num_dev, 0)})", LitZodpWarning)
        taken = list(order[: num_train + num_dev])
        cut = max(len(taken) - num_dev, 0)
        return taken[:cut], taken[cut:]
    if num_train is not None:
        if num_train > size:
            warnings.warn(f"{what}: num_train={num_train} but the file holds {size} examples; kept all of them",
                          LitZodpWarning)
        train, rest = list(order[:num_train]), list(order[num_train:])
    else:
        train, rest = None, list(order)
    dev: list[int] = []
    if k_dev is not None:
        _, dev = k_shot_draw(labels, rest, 0, k_dev, f"{what} (dev)")
    elif num_dev is not None:
        if num_dev > size:  # num_train is None here: rest is the whole order
            warnings.warn(f"{what}: num_dev={num_dev} but the file holds {size} examples; all of them are dev",
                          LitZodpWarning)
        dev = rest[:num_dev]
    if train is None:
        taken = set(dev)
        train = sorted(i for i in order if i not in taken)
    return train, dev


def row_subset(split: TaskSplit, num: Optional[int], seed: int) -> list[int]:
    """Examples on the first ``num`` rows of the split's rows shuffled with ``seed``; all examples, in
    file order, when ``num`` is ``None`` or covers the file (LM-BFF's 1,000-example test files; MeZO's
    ``num_eval`` subset; pandas' ``sample(n=num, random_state=seed)``)."""
    if num is None or num >= split.row_count:
        return list(range(len(split)))
    where = split.row_to_example()
    rows = numpy_permutation(split.row_count, seed)[:num]
    return [where[row] for row in rows if row in where]


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


def bos_token_id_error(value: Any) -> Optional[str]:
    """The one-line error of a ``bos_token_id`` option that is not ``None`` or a token id, else ``None``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        return f"`bos_token_id` must be a token id (an integer >= 0) or null, got {value!r}"
    return None


def start_rows_with(inputs: dict[str, Tensor], tokenizer: Any, bos_token_id: Optional[int], tokenizer_name: str
                    ) -> dict[str, Tensor]:
    """Every row's first token set to ``bos_token_id`` in place of the tokenizer's own special prefix (``None``:
    unchanged). MeZO's and DPZero's OPT code sets ``tokenizer.bos_token_id = 0`` ("HF tokenizer bug fix") on the
    slow tokenizer, whose rows then start with ``<s>`` (0) where OPT's tokenizer puts ``</s>`` (2); the paper
    configs of OPT set 0 as they ran. Rows are right-padded, so column 0 is each row's first token."""
    if bos_token_id is None:
        return inputs
    if len(special_affixes(tokenizer)[0]) != 1:
        raise ConfigError(f"`data.init_args.bos_token_id`: the tokenizer {tokenizer_name!r} starts a row with no "
                          "single special token to replace; set bos_token_id: null")
    if bos_token_id >= len(tokenizer):
        raise ConfigError(f"`data.init_args.bos_token_id`: {bos_token_id} is not in the vocabulary of "
                          f"{tokenizer_name!r} ({len(tokenizer)} tokens)")
    inputs["input_ids"][..., 0] = bos_token_id
    return inputs


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


TRUNCATIONS = ("fields", "tail")


def resolve_truncation(truncation: Optional[str], faithful: bool) -> str:
    """``truncation`` as given, else LM-BFF's ``"tail"`` in faithful mode and ``"fields"`` otherwise."""
    if truncation is not None:
        return truncation
    return "tail" if faithful else "fields"


def encode_mlm(
    tokenizer: Any,
    spec: TaskSpec,
    records: Sequence[Mapping[str, str]],
    max_length: int,
    *,
    first_sent_limit: Optional[int] = None,
    truncation: Optional[str] = None,
    faithful: bool = False,
) -> dict[str, Tensor]:
    """Masked-LM prompts ``{input_ids, attention_mask}`` ``[N, max_length]`` (see the module docs).

    Args:
        first_sent_limit: LM-BFF's ``--first_sent_limit``: the tokens of the task's first text field
            (``spec.fields[0]``) are cut to this many before anything else.
        truncation: ``"fields"`` (text fields cut from their end, longest first, the template kept) or
            ``"tail"`` (LM-BFF: the whole sequence cut at ``max_length``, end-of-sequence token
            included). A row whose mask tail truncation would cut, where LM-BFF's assertion stops the run, is
            cut by fields instead, and nothing is said: a refusal, or a warning, on one row's length
            would tell whoever reads the output about that row (red-team review 18). ``None``: ``"tail"``
            when ``faithful``, else ``"fields"``.
        faithful: render LM-BFF's templates token for token as its ``tokenize_multipart_input`` does
            (values as read, GLUE SST-2's trailing space included; ``*sent-_0*`` drops the premise's
            last character whatever it is); ``False`` strips the values and drops only final punctuation
            (:func:`datamodules.text_tasks.readable_parts`).
    """
    truncation = resolve_truncation(truncation, faithful)
    if truncation not in TRUNCATIONS:
        raise ValueError(f"Unknown truncation {truncation!r}; expected one of {list(TRUNCATIONS)}")
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
    for part in spec.mlm if faithful else readable_parts(spec.mlm):
        if part is MASK:
            pieces.append(("mask", None))
        elif isinstance(part, Field):
            ids = _token_ids(tokenizer, [part.render(r) for r in records])
            ids = [[unk_id if t == mask_id else t for t in row] for row in ids]
            if first_sent_limit is not None and part.name == spec.fields[0]:
                ids = [row[:first_sent_limit] for row in ids]
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
        row = [*prefix, *(t for span in spans for t in span), *suffix][:max_length] if truncation == "tail" else None
        if row is None or mask_id not in row:  # (tail truncation cut the mask, where LM-BFF asserts: cut by fields)
            row = _fit_fields(spec, spans, [kind for kind, _ in pieces], prefix, suffix, max_length)
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention[i, : len(row)] = 1
    counts = (input_ids == mask_id).sum(1)
    if n and not bool((counts == 1).all()):
        raise ValueError(f"{spec.name}: a prompt lost its mask or has several")  # no count of private rows
    return {"input_ids": input_ids, "attention_mask": attention}


def _fit_fields(
    spec: TaskSpec, spans: list[list[int]], kinds: list[str], prefix: list[int], suffix: list[int], max_length: int
) -> list[int]:
    """``prefix + spans + suffix`` fit to ``max_length``: the text spans (kind ``"text"``) are shortened first
    (:func:`fit_lengths`), then, where a row's own fixed fields (``"fixed_each"``: WSC's span, WiC's word) alone leave
    no room, those too. Only the template's own tokens and the mask, the same in every row, can refuse: a refusal, or
    its count, on one row's length would tell whoever reads the output about that row (review 19)."""
    template_len = len(prefix) + len(suffix) + sum(len(s) for s, k in zip(spans, kinds) if k in ("fixed", "mask"))
    if template_len > max_length:
        raise ValueError(
            f"{spec.name}: the masked-LM template needs {template_len} tokens without its fields, "
            f"more than max_length={max_length}: the mask would be lost; raise max_length"
        )
    own = fit_lengths([len(s) for s, k in zip(spans, kinds) if k == "fixed_each"], max_length - template_len)
    texts = fit_lengths([len(s) for s, k in zip(spans, kinds) if k == "text"], max_length - template_len - sum(own))
    cut = {"fixed_each": iter(own), "text": iter(texts)}
    row = list(prefix)
    for span, kind in zip(spans, kinds):
        row.extend(span[: next(cut[kind])] if kind in cut else span)
    return row + list(suffix)


def candidate_texts(spec: TaskSpec, record: Mapping[str, str]) -> list[str]:
    """The ``K`` candidate completions of one example, in label order."""
    if spec.candidates is None:
        raise ValueError(f"{spec.name} has no causal candidates; prompt modes: {list(spec.prompt_modes)}")
    return [c.render(record) if isinstance(c, Field) else c for c in spec.candidates]


def encode_causal(
    tokenizer: Any, spec: TaskSpec, records: Sequence[Mapping[str, str]], max_length: int,
    num_candidates: Optional[int] = None,
) -> dict[str, Tensor]:
    """Candidate-scoring inputs ``{input_ids, attention_mask, candidate_mask}`` ``[N, K, max_length]``.

    A candidate that is a row's own text (COPA's choices, a QA answer) and is longer than ``max_length`` less the
    special prefix and one prompt token keeps its first tokens that fit: a refusal would tell that some private
    row's text is that long (reviews 41, 44). Candidates shared by every row (label words) are public and refused
    when they do not fit.

    A task with ``varying_candidates`` (ReCoRD) pads each example to ``K = num_candidates`` (default: the most
    candidates of ``records``) with absent rows: no token attended to, no candidate token (pad ids), which
    :class:`~lit_zodp.backbones.HFCandidateScorer` scores ``-inf`` without running them; ``gold_mask [N, K]``
    (long) is added, 1 on each example's gold candidates (any is a correct prediction)."""
    if spec.causal is None:
        raise ValueError(f"{spec.name} has no causal template; prompt modes: {list(spec.prompt_modes)}")
    prefix, _ = special_affixes(tokenizer)
    longest = max_length - len(prefix) - 1
    if spec.fixed_candidates is None and longest < 1:
        raise ValueError(f"{spec.name}: max_length={max_length} leaves no room for a prompt token and an answer "
                         "token; raise max_length")
    prompts = _token_ids(tokenizer, [render_text(spec.causal, r) for r in records])
    k = spec.num_classes
    fixed = spec.fixed_candidates
    golds = None
    if spec.varying_candidates is not None:
        texts, golds = zip(*(spec.varying_candidates(r) for r in records)) if records else ((), ())
        k = max((len(t) for t in texts), default=1) if num_candidates is None else num_candidates
        if any(len(t) > k for t in texts):  # (a caller's K below its own examples' count: no count of any example)
            raise ValueError(f"{spec.name}: num_candidates is smaller than an example's number of candidates")
        flat = iter(c[:longest] for c in _token_ids(tokenizer, [t for ts in texts for t in ts]))
        candidates = [[next(flat) for _ in ts] for ts in texts]
    elif fixed is not None:
        shared = _token_ids(tokenizer, fixed)
        candidates = [shared] * len(records)
    else:
        flat = [c[:longest] for c in _token_ids(tokenizer, [t for r in records for t in candidate_texts(spec, r)])]
        candidates = [flat[i * k : (i + 1) * k] for i in range(len(records))]
    n = len(records)
    shape = (n, k, max_length)
    input_ids = torch.full(shape, tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long)
    candidate_mask = torch.zeros(shape, dtype=torch.long)
    for i in range(n):
        cands = candidates[i]
        if not cands or any(len(c) == 0 for c in cands):
            raise ValueError(f"{spec.name}: an example has an empty candidate")  # (no row's place or text in it)
        room = max_length - len(prefix) - max(len(c) for c in cands)
        if room < 0:
            raise ValueError(f"{spec.name}: a candidate does not fit in max_length={max_length}; raise max_length")
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
    if golds is None:
        return {"input_ids": input_ids, "attention_mask": attention, "candidate_mask": candidate_mask}
    gold_mask = torch.zeros((n, k), dtype=torch.long)
    for i, gold in enumerate(golds):
        gold_mask[i, list(gold)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "candidate_mask": candidate_mask,
            "gold_mask": gold_mask}


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
    tokenizer: Any,
    spec: TaskSpec,
    records: Sequence[Mapping[str, str]],
    prompt: str,
    max_length: int,
    num_candidates: Optional[int] = None,
    **mlm_options: Any,
) -> dict[str, Tensor]:
    """Tensors of ``records`` in a prompt mode (``"mlm"``, ``"causal"`` or ``"none"``); ``mlm_options``
    (``first_sent_limit``, ``truncation``, ``faithful``) go to :func:`encode_mlm`, ``num_candidates`` (the ``K``
    of a task with ``varying_candidates``) to :func:`encode_causal`."""
    if prompt not in ENCODERS:
        raise ValueError(f"Unknown prompt mode {prompt!r}; expected one of {list(ENCODERS)}")
    if prompt == "mlm":
        return encode_mlm(tokenizer, spec, records, max_length, **mlm_options)
    if prompt == "causal":
        return encode_causal(tokenizer, spec, records, max_length, num_candidates)
    return ENCODERS[prompt](tokenizer, spec, records, max_length)


# -------------------------------------------------------------------------------- data module


def _check_optional_positive(name: str, value: Any) -> Optional[str]:
    return None if value is None else check_positive_int(name, value)


class PromptTextDataModule(PublicPrivateDataModule):
    """One of the papers' language-model tasks, sampled as the papers do and rendered as prompts.

    Example (DPZero Table 2, RoBERTa-large on SST-2, seed 42; ``data/original`` is LM-BFF's, whose
    ``GLUE-SST-2`` folder is read for SST-2)::

        dm = PromptTextDataModule("SST-2", "data/original", k_shot=512, k_dev=512, num_test=1000, data_seed=42,
                                  prompt="mlm", tokenizer="roberta-large", max_length=128, faithful=True,
                                  batch_size=64)
        model = HFPromptClassifier("roberta-large", label_words=dm.label_words)

    Faithful mode and its default: ``faithful=False`` (default) renders LM-BFF's masked-LM templates
    readably (values stripped, the NLI premise loses only final punctuation) and cuts long prompts field
    by field, never the mask; ``faithful=True`` matches LM-BFF's ``tokenize_multipart_input`` token for
    token (GLUE SST-2's trailing space kept as a token, ``*sent-_0*`` dropping the premise's last
    character whatever it is, tail truncation at ``max_length`` after ``first_sent_limit``); the paper
    configs set it, with the reference lengths per task (``run_fewshot.sh``: ``max_length`` 128, 256 for
    MNLI/RTE/SNLI; ``first_sent_limit`` 240 for MNLI/RTE, 110 for SST-5/TREC). Causal (MeZO) and plain
    prompts are the same in both modes.

    Padding: rows are stored right-padded to ``max_length``; each batch is cut to its longest row
    (:class:`~datamodules.collate.PadToLongest`), which only drops padding, so mask positions and
    candidate spans stay where they are and the model's outputs do not change. ``pad_to_max_length=True``
    keeps every batch at ``max_length``.

    Validation: the dev examples (``k_dev`` per class or ``num_dev``, drawn from the training file
    outside the training pool, as LM-BFF's ``dev.tsv`` and MeZO's dev set), else an lm-bff folder's
    dev file (MNLI: ``dev_matched.tsv``), else ``val_fraction`` of the pool; with none of them
    validation runs on the test set, with a warning.

    and DPZero Table 4 (OPT on BoolQ, Google's original ``train.jsonl``/``dev.jsonl`` in ``data/boolq``):
    ``PromptTextDataModule("BoolQ", "data/boolq", num_train=1000, num_dev=500, num_test=1000,
    prompt="causal", tokenizer="facebook/opt-1.3b", max_length=2048)``.

    Args:
        task: one of ``SST-2, SST-5, SNLI, MNLI, RTE, TREC, BoolQ, CB, WIC, WSC, COPA, MultiRC`` (any case).
        data_dir: folder holding the task folder (or the task folder; see :mod:`datamodules.text_tasks`),
            or with ``data_format="hf"`` a ``datasets`` name (``""`` for the task's default).
        data_format: ``auto``, ``glue`` (original full files), ``lm-bff`` (``<k>-<seed>`` folders),
            ``superglue`` (``*.jsonl``) or ``hf``.
        prompt: ``mlm`` (masked-LM template with one mask), ``causal`` (``K`` candidate completions) or
            ``none`` (plain sentence-pair tokenization); see the module docs for the batch formats.
        tokenizer: Hugging Face id or local path of the tokenizer (``"minilm"`` = the packaged MiniLM).
        max_length: tokens per sequence at most (the row length ``L`` of ``pad_to_max_length``).
        k_shot: training examples per class (LM-BFF / MeZO: 512 for RoBERTa; also picks the lm-bff folder).
        num_train: training examples (random subset; MeZO/OPT: 1000). Exclusive with ``k_shot``.
        k_dev: validation examples per class, drawn from the training examples not kept for training.
        num_dev: validation examples (random; MeZO/OPT: 500), from the same remainder. Exclusive with
            ``k_dev``. A file of fewer than ``num_train + num_dev`` examples keeps ``num_dev`` for validation
            (its permutation's last) and trains on the rest, as MeZO (CB, COPA: ``num_dev`` 100).
        num_test: test examples (random subset of the test file's rows; the papers: 1000).
        test_seed: seed of the ``num_test`` subset. ``None``: 42 with ``k_shot`` (LM-BFF's generator in
            MeZO/DPZero's ``k-shot-1k-test`` mode draws one test subset with seed 42 for every data
            seed), else ``data_seed`` (MeZO's OPT runs draw ``num_eval`` with the training seed).
        dedupe: skip repeated training examples (same text fields, the first kept) before drawing.
            ``False`` (default) draws exactly as LM-BFF and MeZO, which keep repeats (GLUE's SST-2
            repeats phrases), so a repeat can then sit in the pool twice, or in the pool and in
            ``k_dev``/``num_dev``. Set it with ``public_fraction`` (repeats would sit on both sides).
        first_sent_limit: ``prompt="mlm"``: LM-BFF's ``--first_sent_limit`` (the first text field keeps
            at most this many tokens; DPZero: 110 for SST-5/TREC, 240 for MNLI/RTE).
        truncation: ``prompt="mlm"``: ``"fields"`` (text fields cut longest first, template and
            ``</s>`` kept) or ``"tail"`` (LM-BFF: the sequence cut at ``max_length``); ``None`` (default):
            ``"tail"`` when ``faithful``, else ``"fields"``.
        faithful: ``prompt="mlm"``: match LM-BFF's tokens exactly (see above); default ``False``.
        pad_to_max_length: pad every batch to ``max_length``; ``False`` (default) pads each batch to its
            longest row.
        bos_token_id: ``prompt="causal"``: the id of every row's first token in place of the tokenizer's own
            (``None``: the tokenizer's). The Table 4 configs set 0, as MeZO's and DPZero's OPT code ran
            (:func:`start_rows_with`).
        public_task: a task whose training file is a separate public source (PAZO: SNLI for MNLI); it
            must have the same classes and fields. Its own repeats are dropped; private rows equal to one
            of its examples leave the private set (never the reverse: the public split depends on its
            file alone). A list of tasks mixes their draws (PAZO Table 7's half-half: ``[MNLI, SNLI]`` with
            ``public_k_shot: [50, 50]``); the same task as ``task`` draws from its training file apart from the
            private draw (Table 7's in-distribution public data). An example a later source repeats is kept once.
        public_data_dir: folder of ``public_task`` (``data_dir`` when ``None``); every source's when a list.
        public_data_format: layout of ``public_task``'s folder.
        public_k_shot: public examples per class (PAZO: 100), or one count per source of a ``public_task`` list;
            ``None`` keeps all (``max_public_samples`` caps them).
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
        public_task: Optional[Union[str, list[str]]] = None,
        public_data_dir: Optional[str] = None,
        public_data_format: Literal["auto", "glue", "lm-bff", "superglue", "hf"] = "auto",
        public_k_shot: Optional[Union[int, list[int]]] = None,
        dedupe: bool = False,
        first_sent_limit: Optional[int] = None,
        truncation: Optional[Literal["fields", "tail"]] = None,
        faithful: bool = False,
        pad_to_max_length: bool = False,
        bos_token_id: Optional[int] = None,
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
        self.dedupe = dedupe
        self.first_sent_limit = first_sent_limit
        self.truncation = truncation
        self.faithful = faithful
        self.pad_to_max_length = pad_to_max_length
        self.bos_token_id = bos_token_id
        self.spec: Optional[TaskSpec] = _try_task(task)
        self.public_tasks: list = list(public_task) if isinstance(public_task, (list, tuple)) else (
            [] if public_task is None else [public_task])
        self.public_specs: list[Optional[TaskSpec]] = [_try_task(t) for t in self.public_tasks]
        # (a task whose candidates vary per example knows its K after reading the data: see load_splits)
        self.known_num_classes = self.spec.num_classes or None if self.spec is not None else None
        self._tokenizer = None
        self.task_data = None
        super().__init__(**kwargs)

    # ------------------------------------------------------------------------------ checks
    def config_errors(self) -> list[Optional[str]]:
        errors = super().config_errors() + [
            check_positive_int("max_length", self.max_length),
            *(
                _check_optional_positive(name, getattr(self, name))
                for name in ("k_shot", "num_train", "k_dev", "num_dev", "num_test", "first_sent_limit")
            ),
        ]
        errors += [check_bool(name, getattr(self, name)) for name in ("dedupe", "faithful", "pad_to_max_length")]
        if self.truncation is not None and self.truncation not in TRUNCATIONS:
            errors.append(f"Expected `truncation` in {TRUNCATIONS} or None, but got {self.truncation!r}")
        if self.prompt != "mlm" and (self.first_sent_limit is not None or self.truncation is not None):
            errors.append("`first_sent_limit` and `truncation` apply to prompt='mlm' only")
        errors.append(bos_token_id_error(self.bos_token_id))
        if self.bos_token_id is not None and self.prompt != "causal":
            errors.append("`bos_token_id` applies to prompt='causal' only (the first token of a causal LM's rows)")
        if self.spec is None:
            errors.append(f"Unknown task {self.task!r}; expected one of {[*TASK_NAMES, *VARYING_TASK_NAMES]}")
        for name in ("data_format", "public_data_format"):
            if getattr(self, name) not in DATA_FORMATS:
                errors.append(f"Expected `{name}` in {DATA_FORMATS}, but got {getattr(self, name)!r}")
        if self.prompt not in PROMPT_MODES:
            errors.append(f"Expected `prompt` in {PROMPT_MODES}, but got {self.prompt!r}")
        elif self.spec is not None and self.prompt not in self.spec.prompt_modes:
            errors.append(
                f"Task {self.spec.name} supports prompt modes {self.spec.prompt_modes}, not {self.prompt!r}"
            )
        if self.spec is not None and self.spec.varying_candidates is not None and (
                self.k_shot is not None or self.k_dev is not None or self.public_k_shot is not None):
            errors.append(f"{self.spec.name} has no classes to draw k examples of: use num_train / num_dev")
        if self.k_shot is not None and self.num_train is not None:
            errors.append("Give `k_shot` (examples per class) or `num_train` (examples), not both")
        if self.k_dev is not None and self.num_dev is not None:
            errors.append("Give `k_dev` (examples per class) or `num_dev` (examples), not both")
        if self.test_seed is not None and (isinstance(self.test_seed, bool) or not isinstance(self.test_seed, int)):
            errors.append(f"Expected `test_seed` to be an int or None, but got {self.test_seed!r}")
        if not isinstance(self.tokenizer_name, str) or not self.tokenizer_name.strip():
            errors.append(f"Expected `tokenizer` to be a model id or path, but got {self.tokenizer_name!r}")
        errors += self._public_task_errors()
        return errors

    def _public_task_errors(self) -> list[Optional[str]]:
        """``public_task`` (one task or a list) and ``public_k_shot`` (a count, or one per listed task)."""
        counts = self.public_k_shot if isinstance(self.public_k_shot, (list, tuple)) else [self.public_k_shot]
        errors = [_check_optional_positive("public_k_shot", k) for k in counts]
        if not self.public_tasks:
            return errors + [None if self.public_k_shot is None else "`public_k_shot` needs `public_task`"]
        if isinstance(self.public_k_shot, (list, tuple)) and len(self.public_k_shot) != len(self.public_tasks):
            errors.append(f"`public_k_shot` gives {len(self.public_k_shot)} counts for {len(self.public_tasks)} "
                          f"public tasks {self.public_tasks}: one per task, or one count for all")
        if len(set(map(str, self.public_tasks))) != len(self.public_tasks):
            errors.append(f"`public_task` lists a task twice: {self.public_tasks}")
        for task, spec in zip(self.public_tasks, self.public_specs):
            if spec is None:
                errors.append(f"Unknown public_task {task!r}; expected one of {[*TASK_NAMES, *VARYING_TASK_NAMES]}")
            elif self.spec is not None and (spec.labels != self.spec.labels or spec.fields != self.spec.fields):
                errors.append(
                    f"public_task {spec.name} must share the classes and fields of {self.spec.name}: "
                    f"{list(spec.labels)} / {list(spec.fields)} vs {list(self.spec.labels)} / {list(self.spec.fields)}"
                )
        return errors

    # ------------------------------------------------------------------------- attributes
    @property
    def task_name(self) -> str:
        """The task (``SST-2``, ``BoolQ``...): the RESULT line's ``task``."""
        return self.spec.name

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
        """``K``: candidates per example in causal mode (the number of classes; for a task whose candidates vary,
        ReCoRD, the most any example of the data module's splits has, known after ``setup()``)."""
        return self.spec.num_classes or self.num_classes

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

            self._tokenizer = prepare_tokenizer(load_tokenizer(self.tokenizer_name, option="tokenizer"))
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
        data = self._read(spec, "data_dir", self.data_dir, self.data_format, self.k_shot)
        self.task_data = data
        note = source_warning(data)
        if note is not None:
            warnings.warn(note, LitZodpWarning)
        train = data.train
        what = f"{spec.name} ({train.path})"
        repeats = repeated_examples(spec, train) if self.dedupe else set()
        if data.data_format == "lm-bff":  # the k-shot folder is the sample; num_train / num_dev may subsample it
            pool_idx = [i for i in row_subset(train, self.num_train, self.data_seed) if i not in repeats]
            dev = None
            if data.dev is not None:
                if self.k_dev is not None:
                    order = shuffled_examples(data.dev, self.data_seed)
                    _, dev_idx = k_shot_draw(data.dev.labels, order, 0, self.k_dev, f"{what} (dev)")
                else:
                    dev_idx = row_subset(data.dev, self.num_dev, self.data_seed)
                dev = PromptRecords.from_split(data.dev, dev_idx)
        else:
            pool_idx, dev_idx = sample_pool(
                train.labels,
                shuffled_examples(train, self.data_seed, exclude=repeats),
                k_shot=self.k_shot,
                num_train=self.num_train,
                k_dev=self.k_dev,
                num_dev=self.num_dev,
                what=what,
            )
            dev = PromptRecords.from_split(train, dev_idx) if dev_idx else None
        pool = PromptRecords.from_split(train, pool_idx)
        test = PromptRecords.from_split(data.test, row_subset(data.test, self.num_test, self.resolved_test_seed))
        pool_ids = [record_key(spec, r) for r in pool.records]
        public = self._load_public() if self.public_tasks else None
        num_classes = spec.num_classes
        if spec.varying_candidates is not None:  # every split padded to one K: the most candidates of any example
            every = [*pool.records, *(dev.records if dev is not None else ()), *test.records,
                     *(public[0].records if public is not None else ())]
            num_classes = max((len(spec.varying_candidates(r)[0]) for r in every), default=1)
        splits = DataSplits(train=pool, val=dev, test=test, num_classes=num_classes, train_ids=pool_ids,
                            val_ids=None if dev is None else [record_key(spec, r) for r in dev.records],
                            train_groups=record_groups(spec, pool.records),
                            val_groups=None if dev is None else record_groups(spec, dev.records),
                            val_from_train_file=dev is not None and data.data_format != "lm-bff",
                            deduplicated=self.dedupe)
        if public is not None:
            splits.public, splits.public_ids = public
        return splits

    def _read(self, spec: TaskSpec, option: str, folder: str, data_format: str, k_shot: Optional[int]) -> TaskData:
        """:func:`load_task`; a missing folder or file raises a :class:`ConfigError` naming the option (one line
        in the CLI, exit code 2)."""
        try:
            return load_task(spec, folder, data_format, k_shot, self.data_seed)
        except FileNotFoundError as err:
            raise ConfigError(f"`data.init_args.{option}`: {err}; get the task's files (README, 'Paper configs') and "
                              f"set `{option}` to their folder") from err

    @property
    def resolved_test_seed(self) -> int:
        """Seed of the ``num_test`` subset: ``test_seed``, else LM-BFF's 42 with ``k_shot``, else ``data_seed``."""
        if self.test_seed is not None:
            return self.test_seed
        return LMBFF_TEST_SEED if self.k_shot is not None else self.data_seed

    def _load_public(self) -> tuple[PromptRecords, list[Hashable]]:
        """The separate public sources (PAZO), a function of their files alone (each one's repeats dropped; an
        example a later source repeats kept once). Source ``j`` draws with ``data_seed + PUBLIC_SEED_OFFSET + j``."""
        counts = (self.public_k_shot if isinstance(self.public_k_shot, (list, tuple))
                  else [self.public_k_shot] * len(self.public_specs))
        records, labels, keys = [], [], set()
        for offset, (spec, k) in enumerate(zip(self.public_specs, counts)):
            public = self._draw_public(spec, k, self.data_seed + PUBLIC_SEED_OFFSET + offset)
            for record, label in zip(public.records, public.labels.tolist()):
                key = record_key(self.spec, record)
                if key not in keys:
                    keys.add(key)
                    records.append(record)
                    labels.append(label)
        return PromptRecords(records, labels), [record_key(self.spec, r) for r in records]

    def _draw_public(self, spec: TaskSpec, k_shot: Optional[int], seed: int) -> PromptRecords:
        """``k_shot`` examples per class of ``spec``'s training file (all of them: ``None``), its repeats dropped."""
        option = "public_data_dir" if self.public_data_dir else "data_dir"
        data = self._read(spec, option, getattr(self, option), self.public_data_format, k_shot)
        train = data.train
        drop = repeated_examples(self.spec, train)
        if k_shot is not None and data.data_format != "lm-bff":
            order = shuffled_examples(train, seed, exclude=drop)
            index, _ = k_shot_draw(train.labels, order, k_shot, what=f"public {spec.name}")
        else:
            index = [i for i in range(len(train)) if i not in drop]
        return PromptRecords.from_split(train, index)

    def materialize(self, dataset: Dataset) -> TensorPairDataset:
        """Render and tokenize a kept split in the chosen prompt mode."""
        records, labels = records_and_labels(dataset)
        options = {}
        if self.prompt == "mlm":
            options = {"first_sent_limit": self.first_sent_limit, "truncation": self.truncation,
                       "faithful": self.faithful}
        if self.prompt == "causal" and self.spec.varying_candidates is not None:
            options = {"num_candidates": self._num_classes}
        inputs = encode_records(self.tokenizer, self.spec, records, self.prompt, self.max_length, **options)
        return TensorPairDataset(start_rows_with(inputs, self.tokenizer, self.bos_token_id, self.tokenizer_name), labels)

    def batch_collate(self) -> Optional[Callable[[list], Any]]:
        """Pad each batch to its longest row (mask positions and candidate spans unchanged), unless
        ``pad_to_max_length``."""
        return text_collate(self.pad_to_max_length)

    # ------------------------------------------------------------------------------ setup checks
    def model_mismatch(self, model: Any) -> Optional[str]:
        """A backbone that cannot read these prompts (:func:`backbone_mismatch`), or a model that sets its own
        ``num_classes`` for a task whose candidates vary per example (the data module sets it)."""
        error = backbone_mismatch(self, getattr(model, "backbone", None))
        if error is None and not self._ready and self.spec.varying_candidates is not None and (
                getattr(model, "num_classes", None) is not None):
            error = (f"{self.spec.name}'s examples have varying numbers of candidates: leave the model's "
                     "`num_classes` (and the backbone's) unset; the data module sets it")
        return error

    def validation_fallback(self) -> tuple[str, str]:
        return (f"{self.spec.name}: no validation split (no k_dev/num_dev, no dev file in the lm-bff folder, "
                "val_fraction 0)", "set k_dev (LM-BFF: k_dev = k_shot) or num_dev")


#: backbones that put a new, randomly initialised classification head on the model
_NEW_HEAD_BACKBONES = ("HFSequenceClassifier", "SentenceEncoderClassifier")


def backbone_mismatch(dm: "PromptTextDataModule", backbone: Any) -> Optional[str]:
    """One line when ``backbone`` cannot read ``dm``'s prompts, else ``None``.

    A masked-LM prompt is scored at its mask by :class:`~lit_zodp.backbones.HFPromptClassifier` (masked
    LM, ``label_words``), a causal one by :class:`~lit_zodp.backbones.HFCandidateScorer`. A backbone with
    a new head (``HFSequenceClassifier``...) would start at chance on a prompt (what a backbone replaced
    on the command line, dropping ``label_words``, silently gave). Other (user) backbones pass.
    """
    if backbone is None or dm.prompt == "none":
        return None
    name = type(backbone).__name__
    words = dm.label_words
    fix = (f"use class_path lit_zodp.backbones.HFPromptClassifier with label_words {words}"
           if dm.prompt == "mlm" else "use class_path lit_zodp.backbones.HFCandidateScorer")
    if name in _NEW_HEAD_BACKBONES:
        return (f"Model/data mismatch: data prompt={dm.prompt!r} renders {dm.spec.name} as prompts, but the backbone "
                f"{name} adds a new random classification head (chance accuracy at the start): {fix}, or set the "
                "data's prompt: none")
    if name == "HFAnswerGenerator":
        return (f"Model/data mismatch: the backbone HFAnswerGenerator generates answers to QADataModule's questions "
                f"(SQuAD, DROP), but {dm.spec.name} is scored by its candidates: {fix}")
    lm_type = getattr(backbone, "lm_type", None)
    if name == "HFPromptClassifier" and dm.prompt == "mlm" and lm_type != "mlm":
        return f"Model/data mismatch: data prompt='mlm' needs a masked LM, but the backbone is a {lm_type} LM: {fix}"
    if name == "HFPromptClassifier" and dm.prompt == "causal":
        return ("Model/data mismatch: data prompt='causal' gives [B, K, L] candidate rows that HFPromptClassifier "
                f"does not read: {fix}")
    if name == "HFCandidateScorer" and dm.prompt == "mlm":
        return (f"Model/data mismatch: data prompt='mlm' gives masked-LM prompts, not the candidate rows {name} "
                f"scores: {fix}")
    return None


def _try_task(name: Optional[str]) -> Optional[TaskSpec]:
    try:
        return get_task(name)
    except (ValueError, TypeError):
        return None


__all__ = [
    "LMBFF_TEST_SEED",
    "PromptRecords",
    "PromptTextDataModule",
    "TRUNCATIONS",
    "backbone_mismatch",
    "candidate_texts",
    "encode_causal",
    "encode_mlm",
    "encode_plain",
    "encode_records",
    "fit_lengths",
    "k_shot_draw",
    "numpy_permutation",
    "prepare_tokenizer",
    "record_key",
    "records_and_labels",
    "repeated_examples",
    "resolve_truncation",
    "row_subset",
    "sample_pool",
    "shuffled_examples",
    "special_affixes",
]
