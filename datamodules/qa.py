"""Generative question answering: SQuAD and DROP as MeZO and DPZero run them (DPZero Table 5, MeZO-BCD Table 2).

Each example is a passage, a question and one or more gold answers. The prompt is MeZO's (``templates.py``)::

    SQuAD: "Title: <title>\\nContext: <context>\\nQuestion: <question>\\nAnswer:"
    DROP:  "Passage: <passage>\\nQuestion: <question>\\nAnswer:"

and the training target is ``" <first gold answer>\\n"`` (MeZO's ``verbalize``; no end-of-sequence token).
Rows are ``{input_ids, attention_mask, candidate_mask}`` ``[1, max_length]`` per example, the answer as the
single candidate (:func:`datamodules.prompt_text.encode_causal`: the prompt is cut from the left, the first
(BOS) token kept, as MeZO's encoding). Validation and test rows also hold
:data:`~lit_zodp.backbones.generation.ANSWER_IDS`, every gold answer's tokens, for the F1 of generated answers
(:class:`~lit_zodp.backbones.generation.HFAnswerGenerator`).

Sampling (MeZO's ``sample_train_sets`` for OPT: ``num_train`` 1000, ``num_dev`` 500, ``num_test`` 1000): one
NumPy permutation of the training split with ``data_seed``; training takes its first ``num_train`` examples
and validation the next ``num_dev`` (a split shorter than both keeps ``num_dev``, the permutation's last, and
trains on the rest, as MeZO); the test examples are the first ``num_test`` of the validation split
permuted with ``test_seed`` (default ``data_seed``, as MeZO's ``num_eval`` draw).

Files (``data_dir``, or a ``squad`` / ``drop`` folder in it):

* SQuAD v1.1 (MeZO loads Hugging Face's ``squad``, which is v1.1): the official ``train-v1.1.json`` and
  ``dev-v1.1.json``, or Hugging Face rows exported as JSON lines (``train.jsonl`` and ``validation.jsonl``:
  ``title``, ``context``, ``question``, ``answers: {text: [...]}``).
* DROP: the official ``drop_dataset_train.json`` and ``drop_dataset_dev.json``, or Hugging Face rows
  (``passage``, ``question``, ``answers_spans: {spans: [...]}``). The official files are converted as
  Hugging Face's ``drop`` builder converts them, so both give the same examples in the same order: the
  training split's answer is ``answer``, the validation split's answers are ``validated_answers``; a number
  answer is its string, a date ``"day month year"``, a span answer its spans; a question whose answer mixes
  these, or has none, is skipped (9 in train, 1 in validation).
* ``data_format: hf``: ``datasets.load_dataset`` of the task's Hugging Face name (``squad``, ``ucinlp/drop``),
  from its local cache on an offline machine.

The privacy unit is one question. SQuAD and DROP ask several questions about each passage: a passage with
``k`` questions in the private set is protected as a group of ``k``. The passages are the groups of
:class:`~datamodules.base.DataSplits`, so ``public_fraction`` and ``val_fraction`` carve whole passages; MeZO's
``num_dev`` draw is row by row from the training file, which warns.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset

from datamodules.base import DataSplits, PublicPrivateDataModule
from datamodules.collate import text_collate
from datamodules.datasets import TensorPairDataset, items_and_labels
from datamodules.prompt_text import (_token_ids, bos_token_id_error, encode_causal, numpy_permutation,
                                     prepare_tokenizer, start_rows_with)
from datamodules.text_tasks import Field, TaskSpec, json_lines, task_key
from lit_zodp.backbones.generation import ANSWER_IDS, NO_TOKEN
from lit_zodp.errors import ConfigError, LitZodpWarning, check_positive_int

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QA_DATA_FORMATS = ("auto", "official", "jsonl", "hf")


# ------------------------------------------------------------------------------------ the tasks


@dataclass(frozen=True)
class QATask:
    """One generative QA task.

    Attributes:
        name: ``"SQuAD"`` or ``"DROP"``.
        spec: the prompt (``causal`` parts) and the target (the one candidate, the record's ``target``) in
            :class:`~datamodules.text_tasks.TaskSpec` form, for :func:`~datamodules.prompt_text.encode_causal`.
        official: ``{"train": file, "test": file}`` of the official release.
        hf: the Hugging Face dataset name and split names.
        read_official: the official JSON (loaded) and the split role -> :class:`QARecord` list.
        read_row: one Hugging Face row -> a :class:`QARecord`, or ``None`` to skip it.
    """

    name: str
    spec: TaskSpec
    official: Mapping[str, str]
    hf: tuple[str, Mapping[str, str]]
    read_official: Callable[[Any, str], list["QARecord"]]
    read_row: Callable[[Mapping[str, Any]], Optional["QARecord"]]


@dataclass(frozen=True)
class QARecord:
    """One question: its text fields (``title``, ``context``, ``question``) and gold answers (the first trains)."""

    fields: Mapping[str, str]
    answers: tuple[str, ...]

    def prompt_record(self) -> dict[str, str]:
        """The fields and the training target ``" <first answer>\\n"`` (MeZO's ``verbalize``)."""
        return {**self.fields, "target": f" {self.answers[0]}\n"}

    def key(self) -> tuple[str, ...]:
        """Identity: the passage and the question (surrounding whitespace ignored)."""
        return (self.fields["context"].strip(), self.fields["question"].strip())


def _spec(name: str, prompt: tuple) -> TaskSpec:
    fields = tuple(part.name for part in prompt if isinstance(part, Field)) + ("target",)
    return TaskSpec(name=name, labels=("answer",), fields=fields, field_aliases={f: (f,) for f in fields},
                    causal=prompt, candidates=(Field("target", strip=False),), source="MeZO (templates.py)")


def _squad_official(data: Any, role: str) -> list[QARecord]:
    """The official SQuAD JSON, in Hugging Face's ``squad`` order (articles, paragraphs, questions)."""
    records = []
    for article in _require_key(data, "data", "SQuAD"):
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                answers = tuple(answer["text"] for answer in qa["answers"])
                if answers:  # (SQuAD 2.0's unanswerable questions: MeZO asserts an answer)
                    records.append(QARecord({"title": article.get("title", ""), "context": paragraph["context"],
                                             "question": qa["question"]}, answers))
    return records


def _squad_row(row: Mapping[str, Any]) -> Optional[QARecord]:
    answers = tuple(row["answers"]["text"])
    if not answers:
        return None
    return QARecord({"title": row.get("title", ""), "context": row["context"], "question": row["question"]}, answers)


def drop_answers(answers: Iterable[Mapping[str, Any]]) -> Optional[tuple[str, ...]]:
    """Hugging Face's ``drop`` conversion of DROP answers: a number answer gives its string, a date
    ``"day month year"`` (stripped), a span answer its spans; ``None`` when an answer mixes kinds or none is given."""
    out: list[str] = []
    for answer in answers:
        date = answer.get("date") or {}
        date_text = " ".join([date.get("day", ""), date.get("month", ""), date.get("year", "")]).strip()
        has_date = any(date.get(k, "") for k in ("day", "month", "year"))
        number, spans = answer.get("number", ""), list(answer.get("spans", []))
        if sum((number != "", has_date, bool(spans))) > 1:
            return None
        if number != "":
            out.append(number)
        elif has_date:
            out.append(date_text)
        out.extend(spans)
    return tuple(out) or None


def _drop_official(data: Any, role: str) -> list[QARecord]:
    """The official DROP JSON, in Hugging Face's ``drop`` order (passages, questions); see the module docs."""
    if not isinstance(data, Mapping) or any(not isinstance(s, Mapping) or "qa_pairs" not in s for s in data.values()):
        raise ValueError("DROP: expected the official JSON (passage ids mapping to a passage and its qa_pairs)")
    records = []
    for section in data.values():
        for qa in section["qa_pairs"]:
            answers = drop_answers([qa["answer"]] if role == "train" else qa.get("validated_answers", []))
            if answers is not None:
                records.append(QARecord({"context": section["passage"], "question": qa["question"]}, answers))
    return records


def _drop_row(row: Mapping[str, Any]) -> Optional[QARecord]:
    spans = tuple(row["answers_spans"]["spans"])
    return QARecord({"context": row["passage"], "question": row["question"]}, spans) if spans else None


def _require_key(data: Any, key: str, name: str) -> Any:
    if not isinstance(data, Mapping) or key not in data:
        raise ValueError(f"{name}: expected the official JSON with a top-level {key!r} list")
    return data[key]


_QUESTION = Field("question")  # MeZO strips the question; the other fields are read as they are
QA_TASKS: dict[str, QATask] = {
    task_key(task.name): task
    for task in (
        QATask(
            "SQuAD",
            _spec("SQuAD", ("Title: ", Field("title", strip=False), "\nContext: ", Field("context", strip=False),
                            "\nQuestion: ", _QUESTION, "\nAnswer:")),
            {"train": "train-v1.1.json", "test": "dev-v1.1.json"},
            ("squad", {"train": "train", "test": "validation"}),
            _squad_official,
            _squad_row,
        ),
        QATask(
            "DROP",
            _spec("DROP", ("Passage: ", Field("context", strip=False), "\nQuestion: ", _QUESTION, "\nAnswer:")),
            {"train": "drop_dataset_train.json", "test": "drop_dataset_dev.json"},
            ("ucinlp/drop", {"train": "train", "test": "validation"}),
            _drop_official,
            _drop_row,
        ),
    )
}
QA_TASK_NAMES = tuple(task.name for task in QA_TASKS.values())


def get_qa_task(name: str) -> QATask:
    """The :class:`QATask` of ``"SQuAD"`` or ``"DROP"`` (any case)."""
    try:
        return QA_TASKS[task_key(name)]
    except KeyError:
        raise ConfigError(f"`task`: unknown QA task {name!r}; expected one of {list(QA_TASK_NAMES)}") from None


# ------------------------------------------------------------------------------------ reading

#: JSON-lines files of Hugging Face rows, by split role
JSONL_FILES = {"train": ("train.jsonl",), "test": ("validation.jsonl", "dev.jsonl")}


def read_jsonl_rows(task: QATask, path: Path) -> list[QARecord]:
    """Hugging Face rows, one JSON object per line; rows without an answer are skipped."""
    records = []
    for number, row in json_lines(path):
        try:
            record = task.read_row(row)
        except (KeyError, TypeError) as err:  # (the field's name, never a row's text)
            raise ValueError(f"{path}: line {number} is not a {task.name} row (missing {err})") from None
        if record is not None:
            records.append(record)
    return records


def read_official(task: QATask, path: Path, role: str) -> list[QARecord]:
    """The official release's JSON file of one split."""
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    try:
        return task.read_official(data, role)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path}: not the official {task.name} JSON (missing {err})") from None


def find_qa_files(task: QATask, data_dir: str, data_format: str) -> tuple[str, dict[str, Path]]:
    """The layout (``official`` or ``jsonl``) and the train/test files of a task folder: ``data_dir`` or its
    sub-folder named like the task (any case)."""
    root = Path(os.path.expanduser(data_dir))
    if not root.is_dir():
        raise FileNotFoundError(f"{task.name}: data_dir {str(root)!r} is not a folder")
    folders = [root] + [p for p in sorted(root.iterdir()) if p.is_dir() and task_key(p.name) == task_key(task.name)]
    layouts = {"official": {role: (name,) for role, name in task.official.items()}, "jsonl": JSONL_FILES}
    for folder in folders:
        for layout, names in layouts.items():
            if data_format not in ("auto", layout):
                continue
            found = {role: next((folder / n for n in options if (folder / n).is_file()), None)
                     for role, options in names.items()}
            if all(found.values()):
                return layout, found
    expected = f"{task.official['train']} + {task.official['test']} (official) or train.jsonl + validation.jsonl"
    raise FileNotFoundError(f"{task.name}: no {expected} in {str(root)!r} or a {task.name} folder in it")


def load_qa(task: QATask, data_dir: str, data_format: str = "auto") -> dict[str, list[QARecord]]:
    """``{"train": [...], "test": [...]}`` of a task from its folder or (``hf``) from ``datasets``."""
    if data_format == "hf":
        return _load_hf(task, data_dir)
    layout, files = find_qa_files(task, data_dir, data_format)
    if layout == "official":
        return {role: read_official(task, path, role) for role, path in files.items()}
    return {role: read_jsonl_rows(task, path) for role, path in files.items()}


def _load_hf(task: QATask, name: str) -> dict[str, list[QARecord]]:
    try:
        import datasets
    except ImportError:
        raise ImportError("data_format='hf' needs the `datasets` package and a local Hugging Face cache; otherwise "
                          "download the official files and pass their folder as data_dir") from None
    path, splits = name.strip() or task.hf[0], task.hf[1]
    loaded = datasets.load_dataset(path)
    return {role: [r for r in map(task.read_row, loaded[split]) if r is not None] for role, split in splits.items()}


# ------------------------------------------------------------------------------------ encoding


class QARecords(Dataset):
    """:class:`QARecord` examples ``(record, 0)`` (the label is the one candidate's index)."""

    def __init__(self, records: Sequence[QARecord]) -> None:
        self.records = list(records)
        self.labels = torch.zeros(len(self.records), dtype=torch.long)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int):
        return self.records[index], self.labels[index]


def answer_token_ids(tokenizer: Any, records: Sequence[QARecord]) -> Tensor:
    """Every gold answer's tokens ``[N, A, La]`` (``A``, ``La``: the most answers and answer tokens of the
    records), padded with :data:`~lit_zodp.backbones.generation.NO_TOKEN`."""
    tokens = [_token_ids(tokenizer, list(r.answers)) for r in records]
    most = max((len(t) for t in tokens), default=1)
    longest = max((len(a) for t in tokens for a in t), default=1)
    out = torch.full((len(records), most, max(longest, 1)), NO_TOKEN, dtype=torch.long)
    for i, answers in enumerate(tokens):
        for j, answer in enumerate(answers):
            out[i, j, : len(answer)] = torch.tensor(answer, dtype=torch.long)
    return out


# ------------------------------------------------------------------------------------ data module


class QADataModule(PublicPrivateDataModule):
    """SQuAD or DROP for a causal LM, sampled and prompted as MeZO and DPZero (see the module docs).

    Example (DPZero Table 5, OPT-1.3B on SQuAD; the official JSON files in ``data/squad``)::

        dm = QADataModule("SQuAD", "data/squad", tokenizer="facebook/opt-1.3b", max_length=1998,
                          num_train=1000, num_dev=500, num_test=1000, batch_size=8, data_seed=0)
        model = DPZero(HFAnswerGenerator("facebook/opt-1.3b", dtype="float16"), ...)

    Args:
        task: ``SQuAD`` or ``DROP`` (any case).
        data_dir: the folder of the files (or holding a folder named like the task); with ``data_format="hf"``
            a ``datasets`` name (``""``: ``squad`` / ``ucinlp/drop``).
        data_format: ``auto``, ``official``, ``jsonl`` or ``hf``.
        tokenizer: Hugging Face id or local path of the causal LM's tokenizer.
        max_length: prompt and answer tokens at most (MeZO: 2048 less the 50 generated tokens, 1998).
        num_train: training examples (MeZO: 1000); ``None``: every example not drawn for validation.
        num_dev: validation examples drawn after them from the same permutation (MeZO: 500).
        num_test: test examples drawn from the validation split (MeZO: 1000); ``None``: all of them.
        test_seed: seed of the test draw; ``None``: ``data_seed``.
        dedupe: skip repeated questions (same passage and question) before drawing.
        bos_token_id: the id of every row's first token in place of the tokenizer's own (``None``: the tokenizer's;
            the Table 5 configs set 0 as MeZO's and DPZero's OPT code ran: :func:`~datamodules.prompt_text.start_rows_with`).
        pad_to_max_length: pad every batch to ``max_length``; ``False`` pads each to its longest row.
        **kwargs: :class:`~datamodules.base.PublicPrivateDataModule` arguments (``batch_size``, ``data_seed``...).
    """

    def __init__(
        self,
        task: str,
        data_dir: str,
        data_format: Literal["auto", "official", "jsonl", "hf"] = "auto",
        tokenizer: str = "facebook/opt-1.3b",
        max_length: int = 1998,
        num_train: Optional[int] = 1000,
        num_dev: Optional[int] = 500,
        num_test: Optional[int] = 1000,
        test_seed: Optional[int] = None,
        dedupe: bool = False,
        bos_token_id: Optional[int] = None,
        pad_to_max_length: bool = False,
        **kwargs: Any,
    ) -> None:
        self.task = get_qa_task(task)
        self.data_dir = data_dir
        self.data_format = data_format
        self.tokenizer_name = tokenizer
        self.max_length = max_length
        self.num_train = num_train
        self.num_dev = num_dev
        self.num_test = num_test
        self.test_seed = test_seed
        self.dedupe = dedupe
        self.bos_token_id = bos_token_id
        self.pad_to_max_length = pad_to_max_length
        self._tokenizer: Any = None
        super().__init__(**kwargs)

    def config_errors(self) -> list[Optional[str]]:
        errors = super().config_errors() + [check_positive_int("max_length", self.max_length)]
        errors += [check_positive_int(name, getattr(self, name))
                   for name in ("num_train", "num_dev", "num_test") if getattr(self, name) is not None]
        errors.append(bos_token_id_error(self.bos_token_id))
        if self.data_format not in QA_DATA_FORMATS:
            errors.append(f"`data_format` must be one of {list(QA_DATA_FORMATS)}, got {self.data_format!r}")
        for name in ("dedupe", "pad_to_max_length"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"`{name}` must be true or false, got {getattr(self, name)!r}")
        return errors

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (loaded on first use; given a pad token if it has none)."""
        if self._tokenizer is None:
            from lit_zodp.backbones.huggingface import load_tokenizer

            self._tokenizer = prepare_tokenizer(load_tokenizer(self.tokenizer_name, option="tokenizer"))
        return self._tokenizer

    @property
    def task_name(self) -> str:
        """The task (``SQuAD``, ``DROP``): the RESULT line's ``task``."""
        return self.task.name

    @property
    def template(self) -> str:
        """The prompt and its target, readable."""
        from datamodules.text_tasks import describe

        return describe(self.task.spec.causal) + " <answer>\\n"

    def load_splits(self) -> DataSplits:
        try:
            data = load_qa(self.task, self.data_dir, self.data_format)
        except FileNotFoundError as err:
            raise ConfigError(f"`data.init_args.data_dir`: {err}; get the task's files (README, 'Paper configs') "
                              "and set `data_dir` to their folder") from err
        train, test = data["train"], data["test"]
        order = numpy_permutation(len(train), self.data_seed)
        if self.dedupe:
            order = _first_of_each(order, [r.key() for r in train])
        what = f"{self.task.name} ({self.data_dir})"
        pool_idx, dev_idx = _draw(order, self.num_train, self.num_dev, what, len(train))
        pool = QARecords([train[i] for i in pool_idx])
        dev = QARecords([train[i] for i in dev_idx]) if dev_idx else None
        test_order = numpy_permutation(len(test), self.data_seed if self.test_seed is None else self.test_seed)
        test_set = QARecords([test[i] for i in (test_order if self.num_test is None else test_order[: self.num_test])])
        return DataSplits(
            train=pool, val=dev, test=test_set, num_classes=1,
            train_ids=[r.key() for r in pool.records],
            val_ids=None if dev is None else [r.key() for r in dev.records],
            train_groups=[r.fields["context"].strip() for r in pool.records],
            val_groups=None if dev is None else [r.fields["context"].strip() for r in dev.records],
            val_from_train_file=dev is not None, deduplicated=self.dedupe)

    def materialize(self, dataset: Dataset) -> TensorPairDataset:
        """Prompt + first gold answer as the one candidate ``[N, 1, max_length]``. An answer longer than
        ``max_length`` less the BOS and one prompt token keeps its first tokens: refusing it would tell that a
        private answer is that long (MeZO would keep the row's last tokens)."""
        records, labels = items_and_labels(dataset, QARecords, "records")
        inputs = encode_causal(self.tokenizer, self.task.spec, [r.prompt_record() for r in records], self.max_length)
        return TensorPairDataset(start_rows_with(inputs, self.tokenizer, self.bos_token_id, self.tokenizer_name), labels)

    def materialize_evaluation(self, dataset: Dataset) -> TensorPairDataset:
        """Validation and test rows also carry every gold answer (:data:`ANSWER_IDS`) for the F1."""
        built = self.materialize(dataset)
        records, _ = items_and_labels(dataset, QARecords, "records")
        built.inputs[ANSWER_IDS] = answer_token_ids(self.tokenizer, records)
        return built

    def batch_collate(self) -> Optional[Callable[[list], Any]]:
        """Pad each batch to its longest row, unless ``pad_to_max_length``."""
        return text_collate(self.pad_to_max_length)

    def model_mismatch(self, model: Any) -> Optional[str]:
        """A backbone that does not generate answers, or whose model has fewer positions than ``max_length``
        (:func:`qa_backbone_mismatch`)."""
        return qa_backbone_mismatch(self, getattr(model, "backbone", None))

    def validation_fallback(self) -> tuple[str, str]:
        return (f"{self.task.name}: no validation split (num_dev null, val_fraction 0)",
                "set num_dev (MeZO: 500) or val_fraction")


def qa_backbone_mismatch(dm: QADataModule, backbone: Any) -> Optional[str]:
    """One line when ``backbone`` is a library backbone other than
    :class:`~lit_zodp.backbones.HFAnswerGenerator` (which alone generates and scores answers), or one whose model
    has fewer positions than ``max_length`` (a row that long, private or not, failed in the forward), else ``None``.
    A candidate scorer would train on the answer but test by a one-candidate accuracy (a traceback of the
    metric, or a meaningless 100%); a classifier would read the rows as classes. A user's own backbone passes."""
    from lit_zodp.backbones.generation import HFAnswerGenerator

    if isinstance(backbone, HFAnswerGenerator):
        room = backbone._max_positions()
        if room is not None and dm.max_length > room:  # (a row that long failed in the forward when sampled)
            return (f"`data.init_args.max_length`: {dm.max_length} is more than the {room} positions of the "
                    f"backbone's model; set max_length <= {room} (MeZO: the positions less max_new_tokens)")
        return None
    if backbone is None:
        return None
    if not type(backbone).__module__.startswith("lit_zodp."):
        return None
    return (f"Model/data mismatch: QADataModule gives {dm.task.name} questions whose answers are generated and "
            f"scored by F1, which the backbone {type(backbone).__name__} does not do: use class_path "
            "lit_zodp.backbones.HFAnswerGenerator")


def _first_of_each(order: Sequence[int], keys: Sequence[Any]) -> list[int]:
    seen: set = set()
    out = []
    for i in order:
        if keys[i] not in seen:
            seen.add(keys[i])
            out.append(i)
    return out


def _draw(order: Sequence[int], num_train: Optional[int], num_dev: Optional[int], what: str, size: int
          ) -> tuple[list[int], list[int]]:
    """MeZO's draw (``sample_train_sets`` and ``run.py``): the first ``num_train + num_dev`` of the permutation,
    validation the last ``num_dev`` of them, training the rest (``num_train`` when the split is long enough).
    ``size``: the training split's example count (public); what is printed names it, never ``len(order)``, which with
    ``dedupe`` counts the split's repeats, so a warning told whether one private row repeats another."""
    if num_train is None:
        dev = list(order[: num_dev or 0])
        return sorted(set(order) - set(dev)), dev
    wanted = num_train + (num_dev or 0)
    if wanted > size:
        kept = (f"as MeZO, dev is the last {min(num_dev, size)} of them (shuffled) and training the rest (at most "
                f"{max(size - num_dev, 0)})" if num_dev else "kept all of them")
        warnings.warn(f"{what}: num_train + num_dev = {wanted} but the training split holds {size} examples; {kept}",
                      LitZodpWarning)
    taken = list(order[:wanted])
    cut = max(len(taken) - (num_dev or 0), 0)
    return taken[:cut], taken[cut:]


__all__ = [
    "QADataModule",
    "QARecord",
    "QARecords",
    "QATask",
    "QA_TASKS",
    "QA_TASK_NAMES",
    "answer_token_ids",
    "drop_answers",
    "get_qa_task",
    "load_qa",
    "qa_backbone_mismatch",
]
