"""The language-model task suite of the papers: readers, label lists, prompt templates and candidates.

Thirteen tasks: SST-2, SST-5, SNLI, MNLI, RTE, TREC (LM-BFF / MeZO RoBERTa-large setting, DPZero Table 2)
and BoolQ, CB, WIC, WSC, COPA, MultiRC, ReCoRD (SuperGLUE, MeZO OPT setting, DPZero Table 4, MeZO-BCD).
ReCoRD (``VARYING_TASK_NAMES``) is causal only and has no classes: each example's candidates are its passage's
entities, several of which may be gold (:attr:`TaskSpec.varying_candidates`).
:func:`load_task` reads a local folder in one of the standard layouts (or a Hugging Face ``datasets``
name) and returns normalized records: one ``dict`` of canonical text fields plus an integer label per
example. Rendering the records into tensors is done by :mod:`datamodules.prompt_text`.

Layouts (``data_format``)
-------------------------
``"glue"``: the full original files, as in LM-BFF's ``data/original/<TASK>/``:

=======  ==========================  ===================  =============================================
task     training file               test file            columns
=======  ==========================  ===================  =============================================
SST-2    ``train.tsv``               ``dev.tsv``          ``sentence<TAB>label`` with a header
SST-5    ``train.csv``               ``test.csv``         ``label,sentence``, no header, labels 0-4
TREC     ``train.csv``               ``test.csv``         ``label,sentence``, no header, labels 0-5
MNLI     ``train.tsv``               ``dev_matched.tsv``  GLUE columns; ``sentence1``, ``sentence2``,
                                                          ``gold_label`` (the last column)
SNLI     ``train.tsv``               ``dev.tsv``          GLUE columns; ``sentence1``, ``sentence2``,
                                     (else ``test.tsv``)  ``gold_label`` (the last column)
RTE      ``train.tsv``               ``dev.tsv``          ``index, sentence1, sentence2, label``
=======  ==========================  ===================  =============================================

The test set is the original *dev* set for the GLUE tasks (their test labels are not public) and
``test.csv`` for SST-5/TREC, exactly as LM-BFF's ``generate_k_shot_data.py`` and MeZO do. TSV headers
are detected (a first row naming known columns); without one the LM-BFF processors' column positions
are used (SST-2 0/1, MNLI 8/9/last, SNLI 7/8/last, RTE 1/2/last). A ``.tsv`` may replace a ``.csv``
(read by header) and vice versa. SNLI/MNLI rows whose gold label is ``-`` (no consensus) are dropped.
Each record remembers its row in the file (:attr:`TaskSplit.rows`), so that the data module can draw
from the file's rows exactly as LM-BFF's generator does (it shuffles the file's lines).

SST-2 (Table 2 of DPZero): LM-BFF's ``datasets.tar`` ships two SST-2 folders, ``original/SST-2``
(LM-BFF's own sentence-level SST-2: 6,920 training sentences) and ``original/GLUE-SST-2`` (GLUE's
SST-2: 67,349 training phrases; the same 872-sentence dev set). MeZO's and DPZero's data scripts
(``medium_models/data/download_dataset.sh``, ``roberta/data/prepare_datasets.sh``) rename
``GLUE-SST-2`` to ``SST-2`` before sampling, so their RoBERTa runs train on GLUE's SST-2. Under a
``data_dir`` such as ``data/original`` the SST-2 task therefore reads ``GLUE-SST-2`` when that folder
exists (the tarball as extracted), else ``SST-2`` (the renamed layout); :func:`source_warning`
flags LM-BFF's own SST-2 when it is read instead (pass its folder as ``data_dir`` to use it).

BoolQ (Table 4): MeZO reads Hugging Face's ``boolq`` (Google's original ``train.jsonl`` /
``dev.jsonl``: ``question, title, answer, passage``), not SuperGLUE's copy, whose passages begin
with ``"<title> -- "``. Both are read (``answer`` is the label of the original files); use the
original files to reproduce MeZO's prompts (:func:`source_warning` flags SuperGLUE's passages).

``"lm-bff"``: LM-BFF's sampled k-shot folders ``<root>/<TASK>/<k>-<seed>/{train,dev,test}.{tsv,csv}``
(MNLI's dev file is ``dev_matched.tsv`` and its test file ``test_matched.tsv``, as LM-BFF's generator
writes them) with the per-task formats above; ``k_shot`` and the seed select the folder. The dev file
(``k`` per class, the next ``k`` of each class of the shuffled training file) is the validation set.

``"superglue"``: ``<root>/<TASK>/{train,val}.jsonl`` as distributed by SuperGLUE (one JSON object per
line). ``val.jsonl`` is the test set (the SuperGLUE test labels are hidden; MeZO evaluates on the
validation set too; ``dev.jsonl`` is accepted in its place). Fields: BoolQ ``passage, question, label
(bool)`` (Google's original BoolQ, ``train.jsonl`` + ``dev.jsonl``, names it ``answer`` and adds an
unread ``title``); ReCoRD ``passage{text, entities[{start, end}]}, qas[{query, answers[{start, end, text}]}]``
(inclusive ends), flattened to one example per query (the Hugging Face layout ``passage, query, entities,
answers`` too); CB/RTE ``premise, hypothesis, label (str)``; WiC ``word, sentence1, sentence2, label
(bool)``; WSC ``text, target{span1_text, span2_text}, label (bool)``; COPA ``premise, choice1, choice2,
question (cause|effect), label (0|1)``; MultiRC ``passage{text, questions[{question, answers[{text,
label}]}]}``, flattened to one example per (paragraph, question, answer). The Hugging Face flat variants
(``span1_text`` at the top level, ``paragraph/question/answer``, integer labels) are read too, and every
task accepts this layout.

``"hf"``: a Hugging Face ``datasets`` name (``"glue/sst2"``, ``"super_glue:boolq"``,
``"SetFit/sst5"``...; empty for the task's default), loaded with ``datasets.load_dataset`` when the
package is installed (imported lazily).

``"auto"`` picks a layout from the files found: a ``<k>-<seed>`` folder -> ``lm-bff``; ``train.tsv`` /
``train.csv`` -> ``glue``; ``train.jsonl`` -> ``superglue``.

Templates (``TEMPLATES`` below, printed by :func:`template_table`)
------------------------------------------------------------------
Masked-LM templates of SST-2, SST-5, SNLI, MNLI, RTE and TREC are LM-BFF's (used by MeZO and DPZero for
RoBERTa), with their label words. The parts of a template are tokenized separately and concatenated
(as LM-BFF does); label words are single tokens read *with* a leading space (``"Ġgreat"``), as
:class:`lit_zodp.backbones.HFPromptClassifier` encodes them. Causal-LM templates of SST-2, RTE, BoolQ,
CB, WIC, WSC, MultiRC and COPA are MeZO's (``large_models/templates.py``); the others (SST-5, SNLI,
MNLI, TREC causal; all SuperGLUE masked-LM templates) are ours, built the same way.

Records keep the text exactly as read. LM-BFF's masked-LM templates, as the task specs below write
them, use it as is (GLUE's SST-2 sentences end in a space, which LM-BFF's tokenizer call turns into a
``"Ġ"`` token before ``" It was"``; its ``*sent-_0*`` deletes the premise's last character whatever it
is): ``PromptTextDataModule(faithful=True)`` renders them so, token for token. With ``faithful=False``
(the data module's default) :func:`readable_parts` strips the values and drops only final punctuation.
Every other template strips the value first (MeZO strips SST-2's sentence; ``Field(strip=True)``, the
default), in both modes.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

DATA_FORMATS = ("auto", "glue", "lm-bff", "superglue", "hf")
PROMPT_MODES = ("mlm", "causal", "none")
LABEL_KEYS = ("label", "gold_label", "coarse_label", "label-coarse", "label_coarse")

# ----------------------------------------------------------------------------------- templates


class _Mask:
    """The mask token's place in a masked-LM template."""

    def __repr__(self) -> str:
        return "MASK"


MASK = _Mask()


@dataclass(frozen=True)
class Field:
    """A record field in a template.

    Attributes:
        name: canonical field name (``"sentence"``, ``"premise"``...).
        before: literal text glued in front of the value, in the same token span (``" "`` so that a
            byte-level BPE tokenizer gives ``"Ġword"``).
        transform: names of :data:`TRANSFORMS` applied to the value in order.
        fixed: never truncated (short fields such as WiC's word); other fields are cut to fit.
        strip: strip surrounding whitespace from the value before the transforms; LM-BFF's templates
            read the value as is (``strip=False``).
    """

    name: str
    before: str = ""
    transform: tuple[str, ...] = ()
    fixed: bool = False
    strip: bool = True

    def render(self, record: Mapping[str, str]) -> str:
        value = record[self.name]
        if self.strip:
            value = value.strip()
        for name in self.transform:
            value = TRANSFORMS[name](value)
        return self.before + value


Part = Union[str, Field, _Mask]


def _drop_last(text: str) -> str:
    """LM-BFF's ``*sent-_0*``: delete the last character, whatever it is (usually the final period)."""
    return text[:-1]


#: sentence-final punctuation that ``faithful=False`` drops before the NLI template's ``?``
FINAL_PUNCTUATION = ".!?,;:"


def _drop_final_punctuation(text: str) -> str:
    """``*sent-_0*`` without its quirk (``faithful=False``): delete the last character only when it is
    sentence-final punctuation (a premise ending in a quote or a letter keeps it)."""
    return text[:-1] if text.endswith(tuple(FINAL_PUNCTUATION)) else text


def _question_mark(text: str) -> str:
    """MeZO's BoolQ: append ``?`` unless the question already ends with one."""
    return text if text.endswith("?") else text + "?"


def _upper_first(text: str) -> str:
    """MeZO's BoolQ: upper-case the first character."""
    return text[:1].upper() + text[1:]


def _strip_period(text: str) -> str:
    """MeZO's COPA: ``premise.rstrip()`` without a final period."""
    text = text.rstrip()
    return text[:-1] if text.endswith(".") else text


def _lower_first(text: str) -> str:
    """LM-BFF's ``sentl``: lower-case the first character."""
    return text[:1].lower() + text[1:]


def _lower_first_word(text: str) -> str:
    """MeZO's COPA ``capitalize`` ("correct"): lower-case the first word unless it is "I"."""
    words = text.split(" ")
    if words[0] != "I":
        words[0] = words[0].lower()
    return " ".join(words)


def _copa_connective(question: str) -> str:
    """MeZO's COPA connective: ``" because"`` for a cause, ``" so"`` for an effect."""
    try:
        return {"cause": " because", "effect": " so"}[question.strip().lower()]
    except KeyError:
        raise ValueError(f"COPA question must be 'cause' or 'effect', got {question!r}") from None


def _record_highlights(text: str) -> str:
    """MeZO's ReCoRD passage (``ReCoRDTemplateGPT3``): each ``@highlight`` line becomes a ``- `` item; the
    prompt's leading spaces go (MeZO strips the rendered text of spaces)."""
    return text.replace("@highlight\n", "- ").lstrip(" ")


TRANSFORMS: dict[str, Callable[[str], str]] = {
    "drop_last": _drop_last,
    "drop_final_punctuation": _drop_final_punctuation,
    "question_mark": _question_mark,
    "upper_first": _upper_first,
    "strip_period": _strip_period,
    "lower_first": _lower_first,
    "lower_first_word": _lower_first_word,
    "lower": str.lower,
    "copa_connective": _copa_connective,
    "record_highlights": _record_highlights,
}


#: LM-BFF's transforms and their readable counterparts (:func:`readable_parts`)
READABLE_TRANSFORMS = {"drop_last": "drop_final_punctuation"}


def readable_parts(parts: Sequence[Part]) -> tuple[Part, ...]:
    """A template without LM-BFF's two tokenisation quirks (``faithful=False``).

    Every value is stripped of surrounding whitespace (LM-BFF keeps GLUE SST-2's trailing space, one
    ``"Ġ"`` token before ``" It was"``), and ``*sent-_0*`` drops the premise's last character only
    when it is punctuation (:func:`_drop_final_punctuation`). Literal parts and the mask are unchanged.
    """
    out: list[Part] = []
    for part in parts:
        if isinstance(part, Field):
            transform = tuple(READABLE_TRANSFORMS.get(name, name) for name in part.transform)
            part = dataclasses.replace(part, strip=True, transform=transform)
        out.append(part)
    return tuple(out)


def render_text(parts: Sequence[Part], record: Mapping[str, str]) -> str:
    """The parts of a template (no mask) joined into one string."""
    if any(part is MASK for part in parts):
        raise ValueError("render_text() renders mask-free parts; masked-LM templates are tokenized per part")
    return "".join(part.render(record) if isinstance(part, Field) else part for part in parts)


def describe(parts: Sequence[Part], mask: str = "<mask>") -> str:
    """Readable form of a template: ``"<sentence> It was<mask>."``."""
    out = []
    for part in parts:
        if part is MASK:
            out.append(mask)
        elif isinstance(part, Field):
            tag = part.name + ("|" + ",".join(part.transform) if part.transform else "")
            out.append(f"{part.before}<{tag}>")
        else:
            out.append(part)
    return "".join(out)


# ------------------------------------------------------------------------------------ task specs


@dataclass(frozen=True)
class TaskSpec:
    """Everything the data module needs to know about one task.

    Attributes:
        name: canonical name (``"SST-2"``).
        labels: class names in label order (index = target).
        fields: canonical text fields of a record.
        field_aliases: raw column / key names accepted for each field, first match wins.
        label_aliases: extra raw label spellings (lower-cased) -> index; the class names and the
            indices ``"0".."K-1"`` are always accepted.
        skip_labels: raw labels of unlabelled rows that are dropped (SNLI's ``"-"``).
        positions: column positions of headerless ``.tsv`` / ``.csv`` files: ``{ext: {field: index}}``
            (``"label"`` included; negative counts from the end).
        glue_files: ``{"train": (...), "test": (...)}`` candidate files of the ``glue`` layout.
        mlm: masked-LM template parts (exactly one :data:`MASK`), or ``None``.
        label_words: one single-token word per class, read at the mask.
        causal: causal-LM prompt parts, or ``None``.
        candidates: one completion per class appended to the causal prompt; a ``str`` is the same for
            every example, a :class:`Field` is taken from the record (COPA's choices).
        pair: text(s) of ``prompt="none"``: one or two part tuples (sentence, optional second sentence).
        hf: default Hugging Face ``(path, config)`` and split names ``{"train": ..., "test": ...}``.
        source: where the templates come from.
        flatten: turns one raw row into the rows of its examples (MultiRC) or renames keys (BoolQ).
        folder_names: sub-folders of ``data_dir`` tried first for the task (SST-2: ``GLUE-SST-2``).
        group_field: the field naming the unit several rows share (MultiRC: the paragraph, one row per
            answer option), or ``None``. The privacy unit stays one row; the public and validation
            hold-outs are carved by whole groups, so no paragraph is on both sides of the private set.
        varying_candidates: for a task whose examples each have their own number of candidates (ReCoRD: one per
            entity of the passage), a function of a record giving its candidate completions and the indices of its
            gold ones (any of which is a correct prediction); ``labels`` is then empty and an example's label is the
            index of its first gold candidate (the one trained on). ``None``: one candidate per class.
    """

    name: str
    labels: tuple[str, ...]
    fields: tuple[str, ...]
    field_aliases: Mapping[str, tuple[str, ...]]
    mlm: Optional[tuple[Part, ...]] = None
    label_words: Optional[tuple[str, ...]] = None
    causal: Optional[tuple[Part, ...]] = None
    candidates: Optional[tuple[Union[str, Field], ...]] = None
    pair: Optional[tuple[tuple[Part, ...], ...]] = None
    label_aliases: Mapping[str, int] = field(default_factory=dict)
    skip_labels: frozenset = frozenset()
    positions: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    glue_files: Optional[Mapping[str, tuple[str, ...]]] = None
    hf: tuple[str, Optional[str], Mapping[str, str]] = ("", None, {})
    source: str = ""
    flatten: Optional[Callable[[Mapping[str, Any]], list[dict[str, Any]]]] = None
    folder_names: tuple[str, ...] = ()
    group_field: Optional[str] = None
    varying_candidates: Optional[Callable[[Mapping[str, str]], tuple[list[str], list[int]]]] = None

    @property
    def num_classes(self) -> int:
        """Number of classes; in causal mode the number of candidates per example (0: it varies, see
        ``varying_candidates``)."""
        return len(self.labels)

    @property
    def prompt_modes(self) -> tuple[str, ...]:
        """The prompt modes this task supports."""
        modes = {"mlm": self.mlm, "causal": self.causal, "none": self.pair}
        return tuple(mode for mode in PROMPT_MODES if modes[mode] is not None)

    @property
    def fixed_candidates(self) -> Optional[list[str]]:
        """The candidate texts when they are the same for every example (else ``None``)."""
        if self.candidates is None or any(isinstance(c, Field) for c in self.candidates):
            return None
        return list(self.candidates)

    def label_index(self, raw: Any) -> Optional[int]:
        """Index of a raw label; ``None`` for an unlabelled row (``skip_labels``); raises otherwise."""
        key = normalize_label(raw)
        if key in self.skip_labels:
            return None
        if self.varying_candidates is not None:  # the first gold candidate's index; anything else: no gold (skipped)
            return int(key) if key.isdigit() else None
        table = {str(i): i for i in range(self.num_classes)}
        table.update({name.lower(): i for i, name in enumerate(self.labels)})
        table.update(self.label_aliases)
        if key not in table:  # (not the value: a private row's label cell, or its text in a shifted row; review 21)
            raise ValueError(f"{self.name}: a row's label is none of {sorted(table)} (labels {list(self.labels)})")
        return table[key]


def normalize_label(raw: Any) -> str:
    """Raw label -> lower-case string (``True`` -> ``"true"``, ``1.0`` -> ``"1"``)."""
    if isinstance(raw, bool):
        return "true" if raw else "false"
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    return str(raw).strip().lower()


def _sentence_task(
    name, labels, words, mlm, causal, candidates, positions, glue_files, hf, source, aliases=None, folders=()
):
    return TaskSpec(
        name=name,
        labels=labels,
        fields=("sentence",),
        field_aliases={"sentence": ("sentence", "text")},
        mlm=mlm,
        label_words=words,
        causal=causal,
        candidates=candidates,
        pair=((Field("sentence"),),),
        label_aliases=aliases or {},
        positions=positions,
        glue_files=glue_files,
        hf=hf,
        source=source,
        folder_names=folders,
    )


_NLI_FIELDS = {"premise": ("premise", "sentence1"), "hypothesis": ("hypothesis", "sentence2")}
#: LM-BFF's NLI template ``*cls**sent-_0*?*mask*,*+sentl_1**sep+*`` (texts as read, not stripped)
_LMBFF_NLI = (
    Field("premise", transform=("drop_last",), strip=False),
    "?",
    MASK,
    ",",
    Field("hypothesis", " ", ("lower_first",), strip=False),
)
#: MeZO's CB template (PromptSource), reused for SNLI/MNLI causal prompts
_SUPPOSE = ("Suppose", Field("premise", " "), ' Can we infer that "', Field("hypothesis"), '"? Yes, No, or Maybe?\n')
_NLI_PAIR = ((Field("premise"),), (Field("hypothesis"),))
_BOOL = ("false", "true")
_BOOL_ALIASES = {"no": 0, "yes": 1}
_SENTIMENT_CSV = {"csv": {"label": 0, "sentence": 1}, "tsv": {"sentence": 0, "label": -1}}
_CSV_FILES = {"train": ("train.csv", "train.tsv"), "test": ("test.csv", "test.tsv")}
#: LM-BFF's ``*cls**sent_0*_It_was*mask*.*sep+*`` (the sentence as read: GLUE's trailing space kept)
_SST_MLM = (Field("sentence", strip=False), " It was", MASK, ".")
#: MeZO's ``SST2Template``: ``f"{sentence.strip()} It was"`` + ``" " + word``
_SST_CAUSAL = (Field("sentence"), " It was")


def _flatten_multirc(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """SuperGLUE MultiRC: one example per (paragraph, question, answer), as MeZO trains it. The DP
    unit is then one answer row: a paragraph with k answer rows is protected as a group of k
    (group privacy, about k epsilon); the hold-outs are carved by paragraph (``group_field``)."""
    passage = record.get("passage")
    if not isinstance(passage, Mapping):  # already flat (Hugging Face layout)
        return [dict(record)]
    out = []
    for question in passage.get("questions", []):
        for answer in question.get("answers", []):
            out.append(
                {
                    "paragraph": passage["text"],
                    "question": question["question"],
                    "answer": answer["text"],
                    "label": answer.get("label"),
                }
            )
    return out


def _flatten_wsc(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """SuperGLUE WSC keeps the spans under ``target``; the Hugging Face layout has them at the top."""
    target = record.get("target")
    flat = dict(record)
    if isinstance(target, Mapping):
        flat.update({key: target[key] for key in ("span1_text", "span2_text") if key in target})
    return [flat]


def _flatten_boolq(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Google's original BoolQ files (and Hugging Face's ``boolq``) name the label ``answer``."""
    if record.get("label") is None and "answer" in record:
        return [{**record, "label": record["answer"]}]
    return [dict(record)]


def _record_row(passage: str, query: str, entities: Sequence[str], answers: Sequence[str]) -> dict[str, Any]:
    """One ReCoRD example: the entities and answers as sorted, distinct texts (Hugging Face's ``super_glue``
    ``record``, which MeZO reads), stored as JSON lists so that a record stays a mapping of strings. The label
    is the index of the first answer (in sorted order) among the entities, MeZO's ``correct_candidate[0]``; -1
    (an unlabelled row, dropped) when no answer is an entity (SuperGLUE's hidden test answers)."""
    entities = sorted({str(e) for e in entities})
    answers = sorted({str(a) for a in answers})
    label = next((entities.index(a) for a in answers if a in entities), -1)
    return {"passage": str(passage), "query": str(query), "entities": json.dumps(entities),
            "answers": json.dumps(answers), "label": label}


def _flatten_record(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """SuperGLUE ReCoRD (``passage{text, entities[{start, end}]}, qas[{query, answers[{start, end, text}]}]``, the
    ends inclusive): one example per query, the passage's entities its candidates. The Hugging Face layout (one row
    per query: ``passage, query, entities, answers`` as texts) is read too."""
    passage = record.get("passage")
    if not isinstance(passage, Mapping):
        return [_record_row(passage, record.get("query"), record.get("entities") or (), record.get("answers") or ())]
    text = passage["text"]
    entities = [text[e["start"] : e["end"] + 1] for e in passage.get("entities", [])]
    return [_record_row(text, qa["query"], entities, [a["text"] for a in qa.get("answers") or ()])
            for qa in record.get("qas", [])]


def _record_candidates(record: Mapping[str, str]) -> tuple[list[str], list[int]]:
    """ReCoRD's candidates: the query with ``@placeholder`` replaced by each entity, after ``"\n-"`` (MeZO's
    ``ReCoRDTemplateGPT3.verbalize`` less its ``encode``: ``" " + query``, trailing spaces stripped); the gold
    ones are the entities among the answers."""
    entities, answers = json.loads(record["entities"]), set(json.loads(record["answers"]))
    texts = [(" " + record["query"].replace("@placeholder", entity)).rstrip(" ") for entity in entities]
    return texts, [i for i, entity in enumerate(entities) if entity in answers]


_SUPERGLUE = ("super_glue", {"train": "train", "test": "validation"})

TASKS: dict[str, TaskSpec] = {}


def _register(spec: TaskSpec) -> None:
    TASKS[task_key(spec.name)] = spec


def task_key(name: str) -> str:
    """Registry key of a task name: lower-case without ``-``/``_`` (``"SST-2"`` -> ``"sst2"``)."""
    return re.sub(r"[-_\s]", "", str(name)).lower()


_register(
    _sentence_task(
        "SST-2",
        ("negative", "positive"),
        ("terrible", "great"),
        _SST_MLM,
        _SST_CAUSAL,
        (" terrible", " great"),
        {"tsv": {"sentence": 0, "label": 1}, "csv": {"label": 0, "sentence": 1}},
        {"train": ("train.tsv",), "test": ("dev.tsv",)},
        ("glue", "sst2", {"train": "train", "test": "validation"}),
        "mlm: LM-BFF; causal: MeZO",
        folders=("GLUE-SST-2",),
    )
)
_register(
    _sentence_task(
        "SST-5",
        ("very negative", "negative", "neutral", "positive", "very positive"),
        ("terrible", "bad", "okay", "good", "great"),
        _SST_MLM,
        _SST_CAUSAL,
        (" terrible", " bad", " okay", " good", " great"),
        _SENTIMENT_CSV,
        _CSV_FILES,
        ("SetFit/sst5", None, {"train": "train", "test": "test"}),
        "mlm: LM-BFF; causal: ours (MeZO's SST-2 prompt with the SST-5 words)",
    )
)
_register(
    _sentence_task(
        "TREC",
        # LM-BFF's label order (its CSV labels 0-5 map to these words)
        ("description", "entity", "abbreviation", "human", "location", "number"),
        ("Description", "Entity", "Expression", "Human", "Location", "Number"),
        (MASK, ":", Field("sentence", " ", strip=False)),  # LM-BFF's *cls**mask*:*+sent_0**sep+*
        (Field("sentence"), " Answer type:"),
        (" Description", " Entity", " Expression", " Human", " Location", " Number"),
        _SENTIMENT_CSV,
        _CSV_FILES,
        ("trec", None, {"train": "train", "test": "test"}),
        "mlm: LM-BFF; causal: ours",
        aliases={"desc": 0, "enty": 1, "abbr": 2, "expression": 2, "hum": 3, "loc": 4, "num": 5},
    )
)
_NLI_POSITIONS = {
    "SNLI": {"premise": 7, "hypothesis": 8, "label": -1},
    "MNLI": {"premise": 8, "hypothesis": 9, "label": -1},
}
for _name, _pos in _NLI_POSITIONS.items():
    _register(
        TaskSpec(
            name=_name,
            labels=("entailment", "neutral", "contradiction"),
            fields=("premise", "hypothesis"),
            field_aliases=_NLI_FIELDS,
            mlm=_LMBFF_NLI,
            label_words=("Yes", "Maybe", "No"),
            causal=_SUPPOSE,
            candidates=("Yes", "Maybe", "No"),
            pair=_NLI_PAIR,
            skip_labels=frozenset({"-", "-1", ""}),
            positions={"tsv": _pos},
            glue_files={"train": ("train.tsv",), "test": ("dev_matched.tsv",)}
            if _name == "MNLI"
            else {"train": ("train.tsv",), "test": ("dev.tsv", "test.tsv")},
            hf=("glue", "mnli", {"train": "train", "test": "validation_matched"})
            if _name == "MNLI"
            else ("stanfordnlp/snli", None, {"train": "train", "test": "validation"}),
            source="mlm: LM-BFF; causal: ours (MeZO's CB prompt)",
        )
    )
del _name, _pos
_register(
    TaskSpec(
        name="RTE",
        labels=("entailment", "not_entailment"),
        fields=("premise", "hypothesis"),
        field_aliases=_NLI_FIELDS,
        mlm=_LMBFF_NLI,
        label_words=("Yes", "No"),
        causal=(Field("premise"), '\nDoes this mean that "', Field("hypothesis"), '" is true? Yes or No?\n'),
        candidates=("Yes", "No"),
        pair=_NLI_PAIR,
        positions={"tsv": {"premise": 1, "hypothesis": 2, "label": -1}},
        glue_files={"train": ("train.tsv",), "test": ("dev.tsv",)},
        hf=("glue", "rte", {"train": "train", "test": "validation"}),
        source="mlm: LM-BFF; causal: MeZO",
    )
)
_register(
    TaskSpec(
        name="CB",
        labels=("entailment", "contradiction", "neutral"),
        fields=("premise", "hypothesis"),
        field_aliases=_NLI_FIELDS,
        mlm=_LMBFF_NLI,
        label_words=("Yes", "No", "Maybe"),
        causal=_SUPPOSE,
        candidates=("Yes", "No", "Maybe"),
        pair=_NLI_PAIR,
        hf=("super_glue", "cb", _SUPERGLUE[1]),
        source="mlm: ours (LM-BFF's NLI prompt); causal: MeZO",
    )
)
#: MeZO's BoolQ question: ``?`` appended when missing, first letter upper-cased
_BOOLQ_QUESTION = Field("question", " ", ("question_mark", "upper_first"))
_register(
    TaskSpec(
        name="BoolQ",
        labels=_BOOL,
        fields=("passage", "question"),
        field_aliases={"passage": ("passage",), "question": ("question",)},
        mlm=(Field("passage"), _BOOLQ_QUESTION, MASK, "."),
        label_words=("No", "Yes"),
        # MeZO's default BoolQTemplateV3: f"{passage} {question}\n" + candidate, no space before it
        causal=(Field("passage"), _BOOLQ_QUESTION, "\n"),
        candidates=("No", "Yes"),
        pair=((Field("question"),), (Field("passage"),)),
        label_aliases=_BOOL_ALIASES,
        hf=("boolq", None, _SUPERGLUE[1]),
        source="mlm: ours; causal: MeZO (BoolQTemplateV3)",
        flatten=_flatten_boolq,
    )
)
_register(
    TaskSpec(
        name="WIC",
        labels=_BOOL,
        fields=("word", "sentence1", "sentence2"),
        field_aliases={"word": ("word",), "sentence1": ("sentence1",), "sentence2": ("sentence2",)},
        mlm=(
            Field("sentence1"),
            Field("sentence2", " "),
            ' Does "',
            Field("word", fixed=True),
            '" have the same meaning in both sentences?',
            MASK,
            ".",
        ),
        label_words=("No", "Yes"),
        causal=(
            'Does the word "',
            Field("word"),
            '" have the same meaning in these two sentences? Yes, No?\n',
            Field("sentence1"),
            "\n",
            Field("sentence2"),
            "\n",
        ),
        candidates=("No", "Yes"),
        pair=((Field("word"), ": ", Field("sentence1")), (Field("sentence2"),)),
        label_aliases=_BOOL_ALIASES,
        hf=("super_glue", "wic", _SUPERGLUE[1]),
        source="mlm: ours; causal: MeZO",
    )
)
_register(
    TaskSpec(
        name="WSC",
        labels=_BOOL,
        fields=("text", "span1_text", "span2_text"),
        field_aliases={"text": ("text",), "span1_text": ("span1_text",), "span2_text": ("span2_text",)},
        mlm=(
            Field("text"),
            ' Does "',
            Field("span2_text", transform=("lower",), fixed=True),
            '" refer to',
            Field("span1_text", " ", fixed=True),
            "?",
            MASK,
            ".",
        ),
        label_words=("No", "Yes"),
        causal=(
            Field("text"),
            '\nIn the previous sentence, does the pronoun "',
            Field("span2_text", transform=("lower",)),
            '" refer to ',
            Field("span1_text"),
            "? Yes or No?\n",
        ),
        candidates=("No", "Yes"),
        pair=((Field("text"),), ('"', Field("span2_text"), '" refers to ', Field("span1_text"))),
        label_aliases=_BOOL_ALIASES,
        hf=("super_glue", "wsc.fixed", _SUPERGLUE[1]),
        source="mlm: ours; causal: MeZO",
        flatten=_flatten_wsc,
    )
)
_register(
    TaskSpec(
        name="COPA",
        labels=("choice1", "choice2"),
        fields=("premise", "choice1", "choice2", "question"),
        field_aliases={k: (k,) for k in ("premise", "choice1", "choice2", "question")},
        causal=(Field("premise", transform=("strip_period",)), Field("question", transform=("copa_connective",))),
        candidates=(
            Field("choice1", " ", ("lower_first_word",)),
            Field("choice2", " ", ("lower_first_word",)),
        ),
        hf=("super_glue", "copa", _SUPERGLUE[1]),
        source="causal: MeZO (candidates are the two choices; no masked-LM or classifier form)",
    )
)
_register(
    TaskSpec(
        name="MultiRC",
        labels=_BOOL,
        fields=("paragraph", "question", "answer"),
        field_aliases={"paragraph": ("paragraph",), "question": ("question",), "answer": ("answer",)},
        mlm=(
            Field("paragraph"),
            " Question:",
            Field("question", " "),
            " Answer:",
            Field("answer", " "),
            ". Is that correct?",
            MASK,
            ".",
        ),
        label_words=("No", "Yes"),
        causal=(
            Field("paragraph"),
            "\nQuestion: ",
            Field("question"),
            '\nI found this answer "',
            Field("answer"),
            '". Is that correct? Yes or No?\n',
        ),
        candidates=("No", "Yes"),
        pair=((Field("paragraph"),), (Field("question"), " ", Field("answer"))),
        label_aliases=_BOOL_ALIASES,
        hf=("super_glue", "multirc", _SUPERGLUE[1]),
        source="mlm: ours; causal: MeZO",
        flatten=_flatten_multirc,
        group_field="paragraph",
    )
)

_register(
    TaskSpec(
        name="ReCoRD",
        labels=(),
        fields=("passage", "query", "entities", "answers"),
        field_aliases={k: (k,) for k in ("passage", "query", "entities", "answers")},
        # MeZO's ReCoRDTemplateGPT3: encode f"{passage}\n-", verbalize f"{passage}\n- {query}" (@placeholder filled)
        causal=(Field("passage", transform=("record_highlights",), strip=False), "\n-"),
        hf=("super_glue", "record", _SUPERGLUE[1]),
        source="causal: MeZO (ReCoRDTemplateGPT3; one candidate per entity of the passage)",
        flatten=_flatten_record,
        group_field="passage",  # the queries of one passage: hold-outs carved by whole passages (as MultiRC's)
        varying_candidates=_record_candidates,
    )
)

#: Canonical names of the tasks with one candidate per class, in the papers' order (DPZero Table 2, then the
#: SuperGLUE tasks of MeZO).
TASK_NAMES = ("SST-2", "SST-5", "SNLI", "MNLI", "RTE", "TREC", "BoolQ", "CB", "WIC", "WSC", "COPA", "MultiRC")
#: The tasks whose examples have their own number of candidates (``TaskSpec.varying_candidates``; causal only).
VARYING_TASK_NAMES = ("ReCoRD",)
TASKS = {task_key(name): TASKS[task_key(name)] for name in (*TASK_NAMES, *VARYING_TASK_NAMES)}


def get_task(name: str) -> TaskSpec:
    """The :class:`TaskSpec` of a task name (any case, with or without ``-``)."""
    try:
        return TASKS[task_key(name)]
    except KeyError:
        raise ValueError(f"Unknown task {name!r}; expected one of {[*TASK_NAMES, *VARYING_TASK_NAMES]}") from None


def template_table() -> str:
    """A plain-text table of every task's templates, label words and candidates."""
    rows = []
    for spec in TASKS.values():
        rows.append(f"{spec.name} ({spec.source}); labels {list(spec.labels)}")
        if spec.mlm is not None:
            rows.append(f"  mlm:    {describe(spec.mlm)!r}  words {list(spec.label_words)}")
        if spec.causal is not None:
            cands = (["<one per example's entity>"] if spec.candidates is None
                     else [c if isinstance(c, str) else describe((c,)) for c in spec.candidates])
            rows.append(f"  causal: {describe(spec.causal)!r}  + candidates {cands}")
        if spec.pair is not None:
            rows.append(f"  none:   {' | '.join(describe(p) for p in spec.pair)!r}")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------- records


@dataclass
class TaskSplit:
    """Normalized examples of one split: canonical text fields and integer labels.

    Attributes:
        records: the text fields of each example, as read.
        labels: the label index of each example.
        path: the file (or dataset) read.
        rows: for a ``.tsv``/``.csv`` file, the row of each example among the file's data rows (0 =
            the first line after the header; a ``.tsv``'s blank lines and unlabelled rows count, as
            they do for LM-BFF's ``readlines()``); ``None`` when every row is one example, in order.
        num_rows: the number of data rows (``None`` when ``rows`` is).
    """

    records: list[dict[str, str]]
    labels: list[int]
    path: str = ""
    rows: Optional[list[int]] = None
    num_rows: Optional[int] = None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def row_count(self) -> int:
        """Rows a file-level draw permutes: ``num_rows``, or the number of examples."""
        return len(self) if self.num_rows is None else self.num_rows

    def row_to_example(self) -> dict[int, int]:
        """``{row: example index}`` for the rows that hold an example."""
        rows = range(len(self)) if self.rows is None else self.rows
        return {row: i for i, row in enumerate(rows)}


@dataclass
class TaskData:
    """What :func:`load_task` returns.

    Attributes:
        spec: the task.
        train: the training file (sampling happens in the data module).
        test: the test set (the original dev/validation set, see the module docs).
        dev: a given dev set (LM-BFF k-shot ``dev.*``), else ``None``.
        data_format: the layout that was read.
        task_dir: the folder (or dataset name) read.
    """

    spec: TaskSpec
    train: TaskSplit
    test: TaskSplit
    dev: Optional[TaskSplit]
    data_format: str
    task_dir: str


def normalize_records(
    spec: TaskSpec,
    raw_rows: Iterable[Mapping[str, Any]],
    where: str = "",
    positions: Optional[Sequence[int]] = None,
    num_rows: Optional[int] = None,
) -> TaskSplit:
    """Raw rows (dicts with raw keys) -> canonical records and label indices; unlabelled rows dropped.

    Text values are kept as read (templates strip them, see :class:`Field`). ``positions`` gives each raw
    row's position in its file (see :attr:`TaskSplit.rows`); ``num_rows`` the file's number of rows.
    """
    records, labels, rows = [], [], []
    for number, raw in enumerate(raw_rows, start=1):
        for row in spec.flatten(raw) if spec.flatten is not None else (raw,):
            label_key = next((k for k in LABEL_KEYS if k in row and row[k] is not None), None)
            if label_key is None:
                raise ValueError(f"{where}: example {number} has no label ({list(LABEL_KEYS)}); its fields: "
                                 f"{sorted(row)}")  # (the field names, never a row's text: review 18)
            label = spec.label_index(row[label_key])
            if label is None:
                continue
            record = {}
            for name in spec.fields:
                key = next((k for k in spec.field_aliases[name] if k in row and row[k] is not None), None)
                if key is None:
                    raise ValueError(
                        f"{where}: example {number} lacks the field {name!r} (looked for "
                        f"{list(spec.field_aliases[name])}); its fields: {sorted(row)}"  # (never a row's text)
                    )
                record[name] = str(row[key])
            records.append(record)
            labels.append(label)
            if positions is not None:
                rows.append(positions[number - 1])
    if positions is None:
        return TaskSplit(records, labels, where)
    total = len(positions) if num_rows is None else num_rows
    return TaskSplit(records, labels, where, rows, total)


def read_delimited(spec: TaskSpec, path: Union[str, Path]) -> TaskSplit:
    """A GLUE ``.tsv`` (header detected) or an LM-BFF ``.csv`` (``label,sentence``, no header)."""
    path = Path(path)
    ext = path.suffix.lower().lstrip(".")
    if ext == "tsv":
        # GLUE TSVs are not quoted (quotes are literal text): split on tabs only. LM-BFF's generator
        # shuffles open(path).readlines(), blank lines included: every line keeps its number.
        with open(path, encoding="utf-8") as handle:
            lines = [line.rstrip("\n") for line in handle.readlines()]
        numbered = [(i, line.split("\t")) for i, line in enumerate(lines) if line.strip()]
    else:  # pandas.read_csv (LM-BFF's generator) skips blank lines: number the non-blank rows
        with open(path, encoding="utf-8", newline="") as handle:
            numbered = list(enumerate(row for row in csv.reader(handle) if row))
    if not numbered:
        return TaskSplit([], [], str(path))
    rows = [row for _, row in numbered]
    known = {k.lower() for k in LABEL_KEYS}
    known |= {alias.lower() for aliases in spec.field_aliases.values() for alias in aliases}
    header = [cell.strip().lower() for cell in rows[0]]
    has_header = bool(known & set(header)) and not _parses_as_label(spec, rows[0])
    if has_header:
        columns = {}
        for name in (*spec.fields, "label"):
            aliases = _HEADER_LABEL_KEYS if name == "label" else spec.field_aliases[name]
            index = next((header.index(a.lower()) for a in aliases if a.lower() in header), None)
            if index is None:
                raise ValueError(f"{path}: no column for {name!r} in the header {rows[0]}")
            columns[name] = index
    else:
        columns = dict(spec.positions.get(ext, {}))
        if set(columns) != {*spec.fields, "label"}:
            raise ValueError(
                f"{path}: {spec.name} .{ext} files need a header row naming the columns "
                f"({', '.join(spec.fields)}, label)"
            )
    width = max(-i if i < 0 else i + 1 for i in columns.values())
    first = numbered[0][0] + 1 if has_header else 0  # row 0 = the first line after the header
    total = (len(lines) if ext == "tsv" else len(numbered)) - first
    raw_rows, positions = [], []
    for line, row in numbered[1:] if has_header else numbered:
        if len(row) < width:
            raise ValueError(f"{path}: row {line + 1} has {len(row)} columns, expected at least {width}")  # (no text)
        raw_rows.append({name: row[index] for name, index in columns.items()})
        positions.append(line - first)
    return normalize_records(spec, raw_rows, str(path), positions, total)


#: label columns of a header, by preference (GLUE SNLI/MNLI have ``label1`` ... and ``gold_label``)
_HEADER_LABEL_KEYS = ("gold_label", "label", "coarse_label", "label-coarse", "label_coarse")


def _parses_as_label(spec: TaskSpec, row: Sequence[str]) -> bool:
    """Whether some cell of a row is a valid label (a header row has none)."""
    for cell in row:
        try:
            if spec.label_index(cell) is not None:
                return True
        except ValueError:
            continue
    return False


def json_lines(path: Union[str, Path]) -> Iterator[tuple[int, Any]]:
    """``(line number, object)`` of each non-blank line of a JSON-lines file; a line that is not JSON raises one
    line naming the file and the line (never its text)."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {number} is not JSON: {err}") from None


def read_jsonl(spec: TaskSpec, path: Union[str, Path]) -> TaskSplit:
    """A SuperGLUE ``.jsonl`` file (one JSON object per line)."""
    return normalize_records(spec, [row for _, row in json_lines(path)], str(path))


def read_split(spec: TaskSpec, path: Union[str, Path]) -> TaskSplit:
    """Read one file by its extension (``.tsv``, ``.csv`` or ``.jsonl``/``.json``)."""
    ext = Path(path).suffix.lower()
    if ext in (".jsonl", ".json"):
        return read_jsonl(spec, path)
    if ext in (".tsv", ".csv"):
        return read_delimited(spec, path)
    raise ValueError(f"{path}: unsupported file type {ext!r} (expected .tsv, .csv or .jsonl)")


# ------------------------------------------------------------------------------------ layouts

#: LM-BFF's generator names MNLI's k-shot dev file ``dev_matched.tsv`` (and its test files
#: ``test_matched.tsv`` / ``test_mismatched.tsv``; the matched one is the test set, as in the papers)
LMBFF_FILES = {
    "train": ("train.tsv", "train.csv"),
    "dev": ("dev.tsv", "dev.csv", "dev_matched.tsv"),
    "test": ("test.tsv", "test.csv", "test_matched.tsv"),
}
SUPERGLUE_FILES = {"train": ("train.jsonl",), "test": ("val.jsonl", "dev.jsonl", "validation.jsonl")}
_KSHOT_DIR = re.compile(r"^(\d+)-(\d+)$")


def glue_files(spec: TaskSpec) -> dict[str, tuple[str, ...]]:
    """Candidate files of the ``glue`` (original full data) layout."""
    if spec.glue_files is not None:
        return dict(spec.glue_files)
    return {"train": ("train.tsv", "train.csv"), "test": ("dev.tsv", "dev.csv", "test.tsv", "test.csv")}


def _find(folder: Path, names: Sequence[str]) -> Optional[Path]:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    return None


def kshot_folders(task_dir: Path) -> list[str]:
    """LM-BFF ``<k>-<seed>`` sub-folders of a task folder."""
    if not task_dir.is_dir():
        return []
    return sorted(p.name for p in task_dir.iterdir() if p.is_dir() and _KSHOT_DIR.match(p.name))


def find_task_dir(spec: TaskSpec, data_dir: Union[str, Path]) -> Path:
    """The task's folder: ``data_dir`` itself if it holds the task's files, else the first of the task's
    ``folder_names`` found in it (SST-2: ``GLUE-SST-2``), else the sub-folder whose name matches the
    task (any case, ``SST-2``/``sst2``/``sst-2``, ``WiC``/``WIC``...)."""
    root = Path(os.path.expanduser(str(data_dir)))
    if not root.is_dir():
        raise FileNotFoundError(f"{spec.name}: data_dir {str(root)!r} is not a folder")
    if _holds_task_files(spec, root):
        return root
    for name in spec.folder_names:  # SST-2: LM-BFF's tarball names GLUE's SST-2 "GLUE-SST-2"
        if (root / name).is_dir() and _holds_task_files(spec, root / name):
            return root / name
    key = task_key(spec.name)
    matches = [p for p in sorted(root.iterdir()) if p.is_dir() and task_key(p.name) == key]
    if matches:
        return matches[0]
    raise FileNotFoundError(
        f"{spec.name}: no task folder under {str(root)!r} (looked for a sub-folder named like "
        f"{spec.name!r}, any case) and no {_expected_files(spec)} in it"
    )


def _holds_task_files(spec: TaskSpec, folder: Path) -> bool:
    names = {*glue_files(spec)["train"], *LMBFF_FILES["train"], *SUPERGLUE_FILES["train"]}
    return any((folder / n).is_file() for n in names) or bool(kshot_folders(folder))


def _expected_files(spec: TaskSpec) -> str:
    glue = glue_files(spec)
    return (
        f"glue: {glue['train'][0]} + one of {list(glue['test'])}; lm-bff: <k>-<seed>/{{train,dev,test}}.{{tsv,csv}}; "
        f"superglue: train.jsonl + one of {list(SUPERGLUE_FILES['test'])}"
    )


def detect_format(spec: TaskSpec, task_dir: Path, k_shot: Optional[int] = None, seed: Optional[int] = None) -> str:
    """The layout of a task folder (``data_format="auto"``)."""
    if _KSHOT_DIR.match(task_dir.name) and _find(task_dir, LMBFF_FILES["train"]):
        return "lm-bff"
    if k_shot is not None and (task_dir / f"{k_shot}-{seed}").is_dir():
        return "lm-bff"
    if _find(task_dir, glue_files(spec)["train"]):
        return "glue"
    if _find(task_dir, SUPERGLUE_FILES["train"]):
        return "superglue"
    if kshot_folders(task_dir):
        return "lm-bff"
    raise FileNotFoundError(
        f"{spec.name}: cannot tell the layout of {str(task_dir)!r}; expected {_expected_files(spec)}"
    )


def _require(folder: Path, names: Sequence[str], spec: TaskSpec, split: str, fmt: str) -> Path:
    found = _find(folder, names)
    if found is None:
        present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        raise FileNotFoundError(
            f"{spec.name} ({fmt} layout): no {split} file in {str(folder)!r}: expected one of {list(names)}; "
            f"found {present}"
        )
    return found


def load_task(
    task: Union[str, TaskSpec],
    data_dir: Union[str, Path],
    data_format: str = "auto",
    k_shot: Optional[int] = None,
    seed: Optional[int] = None,
) -> TaskData:
    """Read a task's training, test (and LM-BFF dev) sets.

    Args:
        task: task name (``"SST-2"``, ``"mnli"``, ``"BoolQ"``...) or spec.
        data_dir: a folder holding the task folder (``data/original``, ``data/k-shot``, a SuperGLUE
            root), the task folder itself, or (``data_format="hf"``) a ``datasets`` name.
        data_format: ``auto``, ``glue``, ``lm-bff``, ``superglue`` or ``hf`` (see the module docs).
        k_shot: with ``lm-bff``, selects the ``<k_shot>-<seed>`` folder.
        seed: with ``lm-bff``, selects the ``<k_shot>-<seed>`` folder.
    """
    spec = task if isinstance(task, TaskSpec) else get_task(task)
    if data_format not in DATA_FORMATS:
        raise ValueError(f"Unknown data_format {data_format!r}; expected one of {list(DATA_FORMATS)}")
    if data_format == "hf":
        return load_hf_task(spec, str(data_dir or ""))
    task_dir = find_task_dir(spec, data_dir)
    fmt = detect_format(spec, task_dir, k_shot, seed) if data_format == "auto" else data_format
    dev = None
    if fmt == "lm-bff":
        folder = task_dir
        if not _KSHOT_DIR.match(task_dir.name):
            available = kshot_folders(task_dir)
            if k_shot is None or seed is None:
                raise ValueError(
                    f"{spec.name}: the lm-bff layout needs k_shot and data_seed to pick a <k>-<seed> folder; "
                    f"available in {str(task_dir)!r}: {available}"
                )
            folder = task_dir / f"{k_shot}-{seed}"
            if not folder.is_dir():
                raise FileNotFoundError(
                    f"{spec.name}: no folder {folder.name!r} in {str(task_dir)!r}; available: {available}"
                )
        train = read_split(spec, _require(folder, LMBFF_FILES["train"], spec, "train", fmt))
        dev_path = _find(folder, LMBFF_FILES["dev"])
        dev = read_split(spec, dev_path) if dev_path is not None else None
        test = read_split(spec, _require(folder, LMBFF_FILES["test"], spec, "test", fmt))
        task_dir = folder
    elif fmt in ("glue", "superglue"):
        files = glue_files(spec) if fmt == "glue" else SUPERGLUE_FILES
        train = read_split(spec, _require(task_dir, files["train"], spec, "train", fmt))
        test = read_split(spec, _require(task_dir, files["test"], spec, "test", fmt))
    else:
        raise ValueError(f"Unknown data_format {fmt!r}; expected one of {list(DATA_FORMATS)}")
    for split, name in ((train, "train"), (test, "test")):
        if len(split) == 0:
            raise ValueError(f"{spec.name}: the {name} file {split.path!r} holds no labelled example")
    return TaskData(spec, train, test, dev, fmt, str(task_dir))


#: Training rows of LM-BFF's own SST-2 (``original/SST-2`` of its ``datasets.tar``); GLUE's has 67,349.
LMBFF_SST2_TRAIN_ROWS = 6920
_BOOLQ_TITLE = re.compile(r"^[^\n]{1,120}? -- ")


def source_warning(data: TaskData) -> Optional[str]:
    """One line when ``data`` is not the copy of the task that MeZO/DPZero read (else ``None``).

    * SST-2 read from LM-BFF's own ``original/SST-2`` (sentence level, 6,920 training sentences): the
      Table 2 runs use GLUE's SST-2 (``original/GLUE-SST-2``, renamed ``SST-2`` by their scripts).
      Recognised by the folder name ``SST-2-original``, a ``GLUE-SST-2`` folder beside it, or 6,920
      training rows.
    * BoolQ from SuperGLUE (passages ``"<title> -- ..."``): MeZO's Table 4 prompts use the original
      BoolQ passages, without titles.
    """
    spec, train = data.spec, data.train
    if spec.name == "SST-2" and data.data_format == "glue":
        folder = Path(data.task_dir)
        beside_glue = folder.name != "GLUE-SST-2" and (folder.parent / "GLUE-SST-2").is_dir()
        if folder.name.lower() == "sst-2-original" or beside_glue or train.row_count == LMBFF_SST2_TRAIN_ROWS:
            return (
                f"SST-2: {train.path} looks like LM-BFF's own SST-2 ({LMBFF_SST2_TRAIN_ROWS:,} sentences), not "
                "GLUE's SST-2 (67,349 phrases) that MeZO/DPZero's Table 2 trains on: point data_dir at LM-BFF's "
                "data/original (which holds GLUE-SST-2) or at the GLUE-SST-2 folder"
            )
    if spec.name == "BoolQ":
        sample = train.records[:200]
        titled = sum(bool(_BOOLQ_TITLE.match(r["passage"])) for r in sample)
        if sample and titled >= 0.9 * len(sample):
            return (
                f"BoolQ: the passages of {train.path} start with '<title> -- ' (SuperGLUE's copy); MeZO/DPZero's "
                "Table 4 prompts use the original BoolQ (Hugging Face `boolq`, Google's train.jsonl/dev.jsonl), "
                "whose passages have no title"
            )
    return None


def parse_hf_name(name: str, spec: TaskSpec) -> tuple[str, Optional[str]]:
    """``"glue/sst2"`` / ``"super_glue:boolq"`` / ``"SetFit/sst5"`` / ``""`` -> ``(path, config)``."""
    name = name.strip()
    if not name:
        return spec.hf[0], spec.hf[1]
    if ":" in name:
        path, config = name.split(":", 1)
        return path, config or None
    head, _, tail = name.partition("/")
    if tail and "/" not in tail and head in ("glue", "super_glue"):
        return head, tail
    return name, None


def load_hf_task(spec: TaskSpec, name: str) -> TaskData:
    """Load a task from the Hugging Face hub with ``datasets`` (train split and the test split of
    ``spec.hf``: the validation set for GLUE/SuperGLUE/SNLI, the test set for SST-5/TREC)."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "data_format='hf' needs the `datasets` package (pip install datasets) and network access or a "
            "local Hugging Face cache; otherwise download the files and pass their folder as data_dir "
            "(data_format='glue', 'lm-bff' or 'superglue')"
        ) from None
    path, config = parse_hf_name(name, spec)
    splits = dict(spec.hf[2]) or {"train": "train", "test": "validation"}
    loaded = datasets.load_dataset(path, config) if config else datasets.load_dataset(path)
    out = {}
    for role, split_name in splits.items():
        if split_name not in loaded:
            raise ValueError(f"{spec.name}: {path}/{config} has no split {split_name!r}; it has {list(loaded)}")
        split = loaded[split_name]
        names = _class_names(split)
        rows = ({**row, **_named_label(row, names)} for row in split)
        out[role] = normalize_records(spec, rows, f"{path}/{config or ''}[{split_name}]")
    return TaskData(spec, out["train"], out["test"], None, "hf", f"{path}:{config or ''}")


def _class_names(split: Any) -> dict[str, list[str]]:
    names = {}
    features = getattr(split, "features", None) or {}
    for key in LABEL_KEYS:
        feature = features.get(key)
        if feature is not None and getattr(feature, "names", None):
            names[key] = list(feature.names)
    return names


def _named_label(row: Mapping[str, Any], names: Mapping[str, list[str]]) -> dict[str, Any]:
    """Replace a ClassLabel integer by its name (TREC's coarse label order differs from LM-BFF's)."""
    out = {}
    for key, table in names.items():
        value = row.get(key)
        if isinstance(value, int) and 0 <= value < len(table):
            out[key] = table[value]
    return out


__all__ = [
    "DATA_FORMATS",
    "Field",
    "MASK",
    "PROMPT_MODES",
    "TASKS",
    "TASK_NAMES",
    "VARYING_TASK_NAMES",
    "TaskData",
    "TaskSpec",
    "TaskSplit",
    "describe",
    "detect_format",
    "find_task_dir",
    "get_task",
    "kshot_folders",
    "load_hf_task",
    "load_task",
    "normalize_label",
    "normalize_records",
    "parse_hf_name",
    "read_delimited",
    "read_jsonl",
    "read_split",
    "readable_parts",
    "render_text",
    "source_warning",
    "task_key",
    "template_table",
]
