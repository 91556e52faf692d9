"""Offline test helpers: a tiny byte-level BPE tokenizer and small task files in the real layouts.

Nothing here downloads anything. :func:`build_tiny_bpe_tokenizer` trains a byte-level BPE with the
``tokenizers`` library on a few sentences and saves it as a RoBERTa-, GPT-2- or OPT-style Hugging Face
tokenizer (load it back with ``AutoTokenizer.from_pretrained(path)`` or pass ``path`` wherever a
tokenizer name is taken). :func:`write_task_files` writes a few examples per class of any task of
:mod:`datamodules.text_tasks` in the ``glue``, ``lm-bff`` or ``superglue`` layout.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

from datamodules.text_tasks import TASKS, TaskSpec, get_task

#: Words of the templates and label words of every task, so they become single BPE tokens.
PROMPT_WORDS = (
    "It was terrible bad okay good great Yes No Maybe Description Entity Expression Human Location Number "
    "Suppose Can we infer that Does this mean is true or the word have same meaning in these two sentences "
    "Question Answer type correct because so refer to pronoun previous sentence found answer I a an movie "
    "film man woman plays park outside example class fine sun rose"
)
DEFAULT_CORPUS = (
    "the movie was great and fun, it was great",
    "a terrible film, it was bad and boring",
    "Does this mean that it is true? Yes or No?",
    "Suppose a man plays. Can we infer that someone plays? Yes, No, or Maybe?",
    "What is the capital? Answer type: Location. Description, Entity, Expression, Human, Number.",
    "The sun rose because it was morning, so I woke up.",
)

_KINDS = ("roberta", "gpt2", "opt")


def build_tiny_bpe_tokenizer(
    path: Union[str, os.PathLike],
    kind: str = "roberta",
    texts: Optional[Iterable[str]] = None,
    vocab_size: int = 1000,
) -> str:
    """Train a tiny byte-level BPE and save it as a Hugging Face tokenizer in ``path``.

    Args:
        path: output folder (created).
        kind: ``"roberta"`` (``RobertaTokenizerFast``: ``<s> ... </s>``, ``<mask>``, ``<pad>``),
            ``"gpt2"`` (``GPT2TokenizerFast``: no special tokens added, ``<|endoftext|>``, no pad token)
            or ``"opt"`` (``GPT2TokenizerFast`` that prepends ``</s>`` as OPT's does, pad ``<pad>``).
        texts: extra training sentences (the template and label words are always included, so words
            such as ``" great"`` and ``" Yes"`` are single tokens).
        vocab_size: BPE vocabulary size.

    Returns:
        ``str(path)``.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    from tokenizers import AddedToken, ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast, RobertaTokenizerFast

    specials = {
        "roberta": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        "gpt2": ["<|endoftext|>"],
        "opt": ["<s>", "<pad>", "</s>", "<unk>"],
    }[kind]
    corpus = [*DEFAULT_CORPUS, *(texts or ())]
    corpus += [PROMPT_WORDS] * 4 + [PROMPT_WORDS.lower()] * 2
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus, vocab_size=vocab_size, min_frequency=1, special_tokens=specials, show_progress=False
    )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as raw:
        bpe.save_model(raw)
        vocab, merges = os.path.join(raw, "vocab.json"), os.path.join(raw, "merges.txt")
        if kind == "roberta":
            tokenizer = RobertaTokenizerFast(vocab, merges, mask_token=AddedToken("<mask>", lstrip=True))
        elif kind == "gpt2":
            tokenizer = GPT2TokenizerFast(vocab, merges)
        else:
            tokenizer = GPT2TokenizerFast(
                vocab,
                merges,
                bos_token="</s>",
                eos_token="</s>",
                unk_token="</s>",
                pad_token="<pad>",
                add_bos_token=True,
            )
        tokenizer.save_pretrained(str(out))
    return str(out)


# ------------------------------------------------------------------------------ task files

#: Folder names as the datasets ship them (LM-BFF: data/original, data/k-shot; SuperGLUE).
DIR_NAMES = {
    "sst2": "SST-2",
    "sst5": "sst-5",
    "trec": "trec",
    "snli": "SNLI",
    "mnli": "MNLI",
    "rte": "RTE",
    "boolq": "BoolQ",
    "cb": "CB",
    "wic": "WiC",
    "wsc": "WSC",
    "copa": "COPA",
    "multirc": "MultiRC",
    "record": "ReCoRD",
}
_SST5_WORDS = ("awful", "weak", "middling", "nice", "wonderful")
_MNLI_TRAIN = (
    "index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
    "sentence2_parse sentence1 sentence2 label1 gold_label"
).split()
_MNLI_DEV = _MNLI_TRAIN[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]
_SNLI_TRAIN = (
    "index captionID pairID sentence1_binary_parse sentence2_binary_parse sentence1_parse sentence2_parse "
    "sentence1 sentence2 label1 gold_label"
).split()
_SNLI_DEV = _SNLI_TRAIN[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]


def synthetic_example(spec: TaskSpec, label: int, i: int) -> dict[str, Any]:
    """A raw example of ``spec`` in the SuperGLUE/GLUE field names, unique per ``(label, i)``."""
    tag = f"{i} of class {label}"
    key = next(k for k, v in TASKS.items() if v is spec)
    if key in ("sst2", "sst5", "trec"):
        word = _SST5_WORDS[label] if key == "sst5" else ("bad", "good")[label] if key == "sst2" else "what"
        return {"sentence": f"A {word} movie, number {tag}."}
    if key in ("snli", "mnli", "rte", "cb"):
        return {"premise": f"A man plays in the park, example {tag}.", "hypothesis": f"Someone {tag} is outside."}
    if key == "boolq":
        return {
            "passage": f"The park is open every day of the year, passage {tag}.",
            "question": f"is the park open {tag}",
        }
    if key == "wic":
        return {
            "word": "bank",
            "sentence1": f"He sat on the bank of the river {tag}.",
            "sentence2": f"She went to the bank to get money {tag}.",
        }
    if key == "wsc":
        text = f"Mark told Pete many lies about himself {tag}. He was lying."
        return {"text": text, "span1_text": "Mark", "span2_text": "He"}
    if key == "copa":
        return {
            "premise": f"The man broke his toe {tag}.",
            "choice1": f"He dropped a hammer on his foot {i}.",
            "choice2": f"I got a hole in my sock {i}.",
            "question": ("cause", "effect")[i % 2],
        }
    if key == "multirc":
        paragraph = f"Sent 1: The sun rose {i}. Sent 2: Birds sang."
        return {"paragraph": paragraph, "question": f"What rose {tag}?", "answer": f"The sun {tag}"}
    raise ValueError(f"no synthetic examples for {spec.name}")


def synthetic_examples(spec: TaskSpec, per_class: int, offset: int = 0) -> list[tuple[dict[str, Any], int]]:
    """``per_class`` raw examples of every class, interleaved: ``[(fields, label), ...]``."""
    return [
        (synthetic_example(spec, label, offset + i), label)
        for i in range(per_class)
        for label in range(spec.num_classes)
    ]


def _raw_label(spec: TaskSpec, key: str, label: int, fmt: str) -> Any:
    if fmt == "superglue":
        if key in ("boolq", "wic", "wsc"):
            return bool(label)
        if key in ("copa", "multirc", "sst2", "sst5", "trec"):
            return label
        return spec.labels[label]
    if key in ("snli", "mnli", "rte"):
        return spec.labels[label]
    return label


def _write_tsv(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for row in [header, *rows]:
            handle.write("\t".join(str(cell) for cell in row) + "\n")


def _write_delimited(spec: TaskSpec, key: str, path_stem: Path, examples, test: bool) -> Path:
    """One file of the glue / lm-bff layout, in the dataset's own columns."""
    if key in ("sst5", "trec"):
        path = path_stem.with_suffix(".csv")
        with open(path, "w", encoding="utf-8", newline="") as handle:
            writer = csv.writer(handle)
            for fields, label in examples:
                writer.writerow([label, fields["sentence"]])
        return path
    path = path_stem.with_suffix(".tsv")
    if key == "sst2":
        _write_tsv(path, ["sentence", "label"], [[f["sentence"] + " ", y] for f, y in examples])
    elif key == "rte":
        _write_tsv(
            path,
            ["index", "sentence1", "sentence2", "label"],
            [[i, f["premise"], f["hypothesis"], spec.labels[y]] for i, (f, y) in enumerate(examples)],
        )
    elif key in ("mnli", "snli"):
        header = (_MNLI_DEV if test else _MNLI_TRAIN) if key == "mnli" else (_SNLI_DEV if test else _SNLI_TRAIN)
        rows = []
        for i, (f, y) in enumerate(examples):
            row = {name: f"x{i}" for name in header}
            row.update(index=i, sentence1=f["premise"], sentence2=f["hypothesis"], gold_label=spec.labels[y])
            row.update({name: spec.labels[y] for name in header if name.startswith("label")})
            if key == "mnli":
                row["genre"] = "fiction"
            rows.append([row[name] for name in header])
        # an unlabelled SNLI/MNLI row (gold label "-"): the reader drops it
        unlabelled = {name: "-" for name in header}
        unlabelled.update(index=len(rows), sentence1="Nobody agreed.", sentence2="No gold label.")
        rows.append([unlabelled[name] for name in header])
        _write_tsv(path, header, rows)
    else:
        raise ValueError(f"{spec.name} has no glue/lm-bff layout; use data_format='superglue'")
    return path


def _superglue_object(spec: TaskSpec, key: str, fields: dict[str, Any], label: Any, index: int) -> dict[str, Any]:
    if key == "wsc":
        spans = {key: fields[key] for key in ("span1_text", "span2_text")}
        target = {**spans, "span1_index": 0, "span2_index": 9}
        return {"text": fields["text"], "target": target, "idx": index, "label": label}
    return {**fields, "idx": index, "label": label}


def _write_jsonl(spec: TaskSpec, key: str, path: Path, examples, with_labels: bool = True) -> Path:
    lines = []
    if key == "multirc":  # nested: one passage per question, each with its answers
        by_question: dict[str, dict[str, Any]] = {}
        for fields, label in examples:
            paragraph = fields["paragraph"]
            entry = by_question.setdefault(
                paragraph, {"idx": len(by_question), "version": 1.1, "passage": {"text": paragraph, "questions": []}}
            )
            questions = entry["passage"]["questions"]
            answer = {"text": fields["answer"], "idx": len(questions)}
            if with_labels:
                answer["label"] = label
            questions.append({"question": fields["question"], "answers": [answer], "idx": len(questions)})
        lines = list(by_question.values())
    else:
        for index, (fields, label) in enumerate(examples):
            obj = _superglue_object(spec, key, fields, _raw_label(spec, key, label, "superglue"), index)
            if not with_labels:
                obj.pop("label")
            lines.append(obj)
    with open(path, "w", encoding="utf-8") as handle:
        for obj in lines:
            handle.write(json.dumps(obj) + "\n")
    return path


#: Entity names of the synthetic ReCoRD passages (:func:`record_object`)
RECORD_NAMES = ("Alice", "Bob", "Paris", "London", "Acme", "Oak")


def record_object(i: int, with_answers: bool = True) -> dict[str, Any]:
    """Passage ``i`` of a synthetic ReCoRD file in SuperGLUE's nested layout (``passage{text, entities[{start,
    end}]}`` with inclusive ends, ``qas[{query, answers[{start, end, text}], idx}]``): ``2 + i % 4`` distinct
    entities, the first mentioned twice, and two queries; the first query's answers are two mentions of one
    entity, the second's (when ``i`` is even) two different entities."""
    names = RECORD_NAMES[: 2 + i % 4]
    text = (f"{names[0]} met {' and '.join(names[1:])} in the park, story {i}. {names[0]} smiled.\n"
            f"@highlight\n{names[-1]} was there {i}\n@highlight\nThe sun rose")

    def mentions(name: str) -> list[dict[str, Any]]:
        starts = [k for k in range(len(text)) if text.startswith(name, k)]
        return [{"start": k, "end": k + len(name) - 1, "text": name} for k in starts]

    entities = [{"start": m["start"], "end": m["end"]} for name in names for m in mentions(name)]
    golds = [mentions(names[0])] + [mentions(names[1]) + mentions(names[-1]) if i % 2 == 0 else mentions(names[-1])]
    qas = []
    for q, answers in enumerate(golds):
        qa = {"query": f"@placeholder was happy in story {i} part {q} .", "idx": 2 * i + q}
        if with_answers:
            qa["answers"] = answers
        qas.append(qa)
    return {"source": "Synthetic", "passage": {"text": text, "entities": entities}, "qas": qas, "idx": i}


def _write_record(folder: Path, train: int, test: int) -> Path:
    """ReCoRD's ``train.jsonl`` (``train`` passages), ``val.jsonl`` and an unanswered ``test.jsonl``."""
    for name, objects in (("train", [record_object(i) for i in range(train)]),
                          ("val", [record_object(10_000 + i) for i in range(test)]),
                          ("test", [record_object(20_000 + i, with_answers=False) for i in range(2)])):
        with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as handle:
            for obj in objects:
                handle.write(json.dumps(obj) + "\n")
    return folder


def write_task_files(
    root: Union[str, os.PathLike],
    task: str,
    data_format: str = "glue",
    per_class: int = 4,
    eval_per_class: int = 2,
    k_seed_folders: Sequence[tuple[int, int]] = ((2, 13), (2, 42)),
) -> Path:
    """Write a few synthetic examples of ``task`` under ``root`` in a real layout; returns the task folder.

    Args:
        root: parent folder (``data/original``-like for ``glue``, ``data/k-shot``-like for ``lm-bff``).
        task: task name.
        data_format: ``glue`` (``train`` + the original dev/test file), ``lm-bff`` (``<k>-<seed>``
            folders with ``train``/``dev``/``test``) or ``superglue`` (``train.jsonl``, ``val.jsonl``
            and an unlabelled ``test.jsonl``).
        per_class: training examples per class (``glue``/``superglue``).
        eval_per_class: dev/test examples per class.

        ReCoRD (no classes): ``per_class`` training and ``eval_per_class`` validation passages of two queries each
        (:func:`record_object`), ``superglue`` layout only.
        k_seed_folders: ``(k, seed)`` of the ``lm-bff`` folders; each has ``k`` training examples per
            class (different ones per seed).
    """
    spec = get_task(task)
    key = next(k for k, v in TASKS.items() if v is spec)
    folder = Path(root) / DIR_NAMES[key]
    folder.mkdir(parents=True, exist_ok=True)
    if key == "record":  # no classes: per_class passages (two queries each), eval_per_class validation passages
        if data_format != "superglue":
            raise ValueError(f"{spec.name} has the superglue layout only")
        return _write_record(folder, per_class, eval_per_class)
    train = synthetic_examples(spec, per_class)
    test = synthetic_examples(spec, eval_per_class, offset=10_000)
    if data_format == "glue":
        files = spec.glue_files or {"train": ("train.tsv",), "test": ("dev.tsv",)}
        _write_delimited(spec, key, folder / Path(files["train"][0]).stem, train, test=False)
        _write_delimited(spec, key, folder / Path(files["test"][0]).stem, test, test=True)
    elif data_format == "lm-bff":
        for k, seed in k_seed_folders:
            sub = folder / f"{k}-{seed}"
            sub.mkdir(exist_ok=True)
            _write_delimited(spec, key, sub / "train", synthetic_examples(spec, k, offset=1000 * seed), test=False)
            dev = "dev_matched" if key == "mnli" else "dev"  # LM-BFF's generator names MNLI's dev file so
            _write_delimited(spec, key, sub / dev, synthetic_examples(spec, k, offset=1000 * seed + 500), test=False)
            _write_delimited(spec, key, sub / ("test_matched" if key == "mnli" else "test"), test, test=True)
    elif data_format == "superglue":
        _write_jsonl(spec, key, folder / "train.jsonl", train)
        _write_jsonl(spec, key, folder / "val.jsonl", test)
        _write_jsonl(spec, key, folder / "test.jsonl", synthetic_examples(spec, 1, offset=20_000), with_labels=False)
    else:
        raise ValueError(f"data_format must be 'glue', 'lm-bff' or 'superglue', got {data_format!r}")
    return folder


#: Words of the synthetic QA passages (:func:`write_qa_files`), for a tiny tokenizer's vocabulary.
QA_WORDS = ("Title: Context: Passage: Question: Answer: The river runs through the city of town in year "
            "How many bridges are there ? What is the name of the river ? When was it built ? blue green red "
            "seven twelve three 1850 May Oak Elm")


def squad_official(articles: int, paragraphs: int = 2, questions: int = 2, offset: int = 0) -> dict[str, Any]:
    """A SQuAD v1.1 JSON object (``{"data": [...]}``) of synthetic passages; the first question of each passage
    has two gold answers, the others one."""
    data = []
    for a in range(offset, offset + articles):
        paras = []
        for p in range(paragraphs):
            context = f"The river {a} runs through the city {p} . It has seven bridges and the river is blue ."
            qas = [{"id": f"{a}-{p}-{q}", "question": f" How many bridges are there {q} ? ",
                    "answers": [{"text": "seven", "answer_start": 40}] + ([{"text": "seven bridges",
                                                                             "answer_start": 40}] if q == 0 else [])}
                   for q in range(questions)]
            paras.append({"context": context, "qas": qas})
        data.append({"title": f"River_{a}", "paragraphs": paras})
    return {"version": "1.1", "data": data}


def drop_official(passages: int, offset: int = 0) -> dict[str, Any]:
    """A DROP JSON object (passage ids -> passage and ``qa_pairs``) whose questions cover a number, a date, one
    span, several spans and a mixed answer (skipped by the Hugging Face conversion)."""
    blank = {"number": "", "date": {"day": "", "month": "", "year": ""}, "spans": []}
    kinds = [
        {**blank, "number": "12"},
        {**blank, "date": {"day": "3", "month": "May", "year": "1850"}},
        {**blank, "spans": ["Oak"]},
        {**blank, "spans": ["Oak", "Elm"]},
        {**blank, "number": "7", "spans": ["Oak"]},  # mixed: skipped
    ]
    data = {}
    for n in range(offset, offset + passages):
        qa_pairs = [{"query_id": f"{n}-{k}", "question": f"What is the name of the river {k} ?", "answer": answer,
                     "validated_answers": [answer, {**blank, "spans": ["green"]}] if k < 4 else [answer]}
                    for k, answer in enumerate(kinds)]
        data[f"nfl_{n}"] = {"passage": f"The river Oak {n} and the river Elm were built in 1850 .",
                            "qa_pairs": qa_pairs}
    return data


def write_qa_files(root: Union[str, os.PathLike], task: str, train: int = 4, test: int = 2) -> Path:
    """Write ``task``'s (``SQuAD`` or ``DROP``) official JSON files with synthetic questions in ``root/<task>``
    (SQuAD: ``train`` / ``test`` articles of 2 passages with 2 questions; DROP: passages of 4 kept questions)."""
    folder = Path(root) / task.lower()
    folder.mkdir(parents=True, exist_ok=True)
    if task.lower() == "squad":
        files = {"train-v1.1.json": squad_official(train), "dev-v1.1.json": squad_official(test, offset=1000)}
    else:
        files = {"drop_dataset_train.json": drop_official(train), "drop_dataset_dev.json": drop_official(test, 1000)}
    for name, data in files.items():
        (folder / name).write_text(json.dumps(data))
    return folder


__all__ = [
    "DIR_NAMES",
    "QA_WORDS",
    "build_tiny_bpe_tokenizer",
    "drop_official",
    "squad_official",
    "synthetic_example",
    "synthetic_examples",
    "write_qa_files",
    "write_task_files",
]
