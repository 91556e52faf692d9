"""The DPZero paper's data pipeline against hand-written re-implementations of the reference code.

Each ``reference_*`` function below restates, from reading it, what the authors' code does:

* LM-BFF's ``tools/generate_k_shot_data.py`` (as run by MeZO's ``medium_models`` and DPZero's
  ``roberta/`` with ``--mode k-shot-1k-test``): ``np.random.seed(seed)``, shuffle the training
  file's lines (GLUE: ``readlines()`` after the header; SST-5/TREC: ``pd.read_csv(header=None)``
  rows), group them by label in order of first appearance, ``train`` = the first ``k`` of each
  group, ``dev`` = the next ``k``; the test file: ``np.random.seed(42)`` then shuffle and keep 1,000
  lines (GLUE), ``DataFrame.sample(n=1000, random_state=42)`` (SST-5/TREC).
* LM-BFF's ``tokenize_multipart_input`` for the masked-LM templates (parts tokenized separately).
* MeZO's ``large_models`` BoolQ (``BoolQTemplateV3`` and ``encode_prompt``'s left truncation).

Our loader (:class:`PromptTextDataModule`) reads the same small files the test writes, and the rows it
selects (and the tokens it renders) must be the reference's, in the reference's order.
"""

from __future__ import annotations

import contextlib
import csv
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from datamodules import PromptTextDataModule, get_task, load_task
from datamodules.prompt_text import candidate_texts, encode_causal, encode_mlm, prepare_tokenizer
from datamodules.testing import build_tiny_bpe_tokenizer
from datamodules.text_tasks import render_text, source_warning

SNLI_HEADER = (
    "index captionID pairID sentence1_binary_parse sentence2_binary_parse sentence1_parse sentence2_parse "
    "sentence1 sentence2 label1 gold_label"
).split()


@contextlib.contextmanager
def global_numpy_seed(seed):
    """``np.random.seed(seed)`` for the block, the global state restored after (MeZO's ``temp_seed``)."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


def load_tokenizer(path):
    from lit_zodp.backbones.huggingface import load_tokenizer as load

    return prepare_tokenizer(load(path))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref_tokenizers")
    texts = ["Is it open?\nYes", "Is it open?\nNo", "Do iran and afghanistan speak the same language?\nYes"]
    return {
        "opt": load_tokenizer(build_tiny_bpe_tokenizer(root / "opt", "opt", texts=texts)),
        "roberta": load_tokenizer(build_tiny_bpe_tokenizer(root / "roberta", "roberta")),
    }


# ------------------------------------------------------------------------------- small files


def write_sst2(folder: Path, n: int = 40, dev: int = 25, tag: str = "phrase") -> Path:
    """GLUE SST-2 TSVs (header, trailing space), with repeated rows and a blank line in the middle."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [(f"{tag} {i} is {'fine' if i % 3 else 'dull'} ", int(i % 3 != 0)) for i in range(n - 9)]
    rows += [rows[2 * i] for i in range(9)]  # 9 repeated rows (GLUE's SST-2 has repeated phrases)
    lines = ["sentence\tlabel"] + [f"{s}\t{y}" for s, y in rows]
    lines.insert(12, "")  # a blank line: LM-BFF's readlines() shuffles it with the rest
    (folder / "train.tsv").write_text("\n".join(lines) + "\n")
    dev_lines = ["sentence\tlabel"] + [f"{tag} dev {i} \t{i % 2}" for i in range(dev)]
    (folder / "dev.tsv").write_text("\n".join(dev_lines) + "\n")
    return folder


def write_snli(folder: Path, n: int = 45, dev: int = 23) -> Path:
    """GLUE SNLI TSVs (11 columns, gold label last) with some unlabelled ``-`` rows."""
    folder.mkdir(parents=True, exist_ok=True)
    labels = ("entailment", "neutral", "contradiction", "-")

    def row(i, label, split):
        cells = [str(i), "c", "p", "b1", "b2", "p1", "p2", f"A man {split} {i} plays.", f"He {i} plays.", label, label]
        return "\t".join(cells)

    train = [row(i, labels[(i * 7) % 4 if i % 5 else 0], "train") for i in range(n)]
    (folder / "train.tsv").write_text("\n".join(["\t".join(SNLI_HEADER), *train]) + "\n")
    test = [row(i, labels[i % 3], "dev") for i in range(dev)]
    (folder / "dev.tsv").write_text("\n".join(["\t".join(SNLI_HEADER), *test]) + "\n")
    return folder


def write_sst5(folder: Path, n: int = 38, test: int = 21) -> Path:
    """LM-BFF's SST-5 CSVs (``label,sentence``, no header; quoted commas); class 4 is short."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        for i in range(n):
            writer.writerow([(i * 3) % 4 if i % 9 else 4, f"a film, number {i}, rated"])
    with open(folder / "test.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        for i in range(test):
            writer.writerow([i % 5, f"a test film, number {i}"])
    return folder


# --------------------------------------------------------------------- the references' draws


def read_csv_rows(path: Path) -> list[list]:
    """``pd.read_csv(path, header=None).values.tolist()`` (the csv module when pandas is absent)."""
    try:
        import pandas as pd
    except ImportError:
        with open(path, newline="") as handle:
            return [[int(r[0]), r[1]] for r in csv.reader(handle) if r]
    return pd.read_csv(path, header=None).values.tolist()


def reference_k_shot(path: Path, k: int, seed: int) -> tuple[list, list]:
    """LM-BFF's generate_k_shot_data.py: the lines (GLUE) or rows (CSV) of its train and dev files."""
    glue = path.suffix == ".tsv"
    if glue:
        with open(path) as handle:
            train_lines = handle.readlines()[1:]  # split_header: the first line is the header

        def get_label(line):
            return line.strip().split("\t")[-1]
    else:
        train_lines = read_csv_rows(path)

        def get_label(line):
            return line[0]

    with global_numpy_seed(seed):
        np.random.shuffle(train_lines)
    label_list = {}
    for line in train_lines:
        label = get_label(line)
        if label not in label_list:
            label_list[label] = [line]
        else:
            label_list[label].append(line)
    train = [line for label in label_list for line in label_list[label][:k]]
    dev = [line for label in label_list for line in label_list[label][k : k * 2]]
    return train, dev


def reference_test_subset(path: Path, num: int) -> list:
    """The k-shot-1k-test mode's test file (``num`` = 1000 there), the same for every data seed."""
    if path.suffix == ".tsv":
        with open(path) as handle:
            test_lines = handle.readlines()[1:]
        if len(test_lines) > num:
            with global_numpy_seed(42):
                np.random.shuffle(test_lines)
            test_lines = test_lines[:num]
        return test_lines
    try:
        import pandas as pd
    except ImportError:
        pytest.skip("pandas is needed for the reference's DataFrame.sample")
    frame = pd.read_csv(path, header=None)
    if len(frame.index) > num:
        frame = frame.sample(n=num, random_state=42)
    return frame.values.tolist()


def texts_of(lines: list, task: str) -> list[tuple]:
    """(text fields, label name) of reference lines; the rows our reader skips (blank, ``-``) dropped."""
    out = []
    for line in lines:
        if isinstance(line, list):  # CSV row
            out.append(((line[1],), str(line[0])))
            continue
        cells = line.rstrip("\n").split("\t")
        if not line.strip() or cells[-1] == "-":  # LM-BFF groups these too; they hold no example
            continue
        fields = (cells[7], cells[8]) if task == "SNLI" else (cells[0],)
        out.append((fields, cells[-1]))
    return out


def ours(records, labels, spec) -> list[tuple]:
    """(text fields, label as the file writes it) of our records."""
    raw = {"SNLI": list(spec.labels)}.get(spec.name)
    return [
        (tuple(r[name] for name in spec.fields), raw[y] if raw else str(y)) for r, y in zip(records, labels.tolist())
    ]


CASES = {"SST-2": (write_sst2, "train.tsv", "dev.tsv"), "SNLI": (write_snli, "train.tsv", "dev.tsv"),
         "SST-5": (write_sst5, "train.csv", "test.csv")}


@pytest.mark.parametrize("task", list(CASES))
def test_k_shot_draws_are_lm_bff_rows_in_lm_bff_order(tmp_path, task):
    writer, train_file, _ = CASES[task]
    folder = writer(tmp_path / task)
    spec = get_task(task)
    for seed in (13, 42, 100):
        ref_train, ref_dev = reference_k_shot(folder / train_file, 3, seed)
        dm = PromptTextDataModule(task, str(tmp_path), k_shot=3, k_dev=3, data_seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SST-5's short class
            splits = dm.load_splits()
        assert ours(splits.train.records, splits.train.labels, spec) == texts_of(ref_train, task), seed
        assert ours(splits.val.records, splits.val.labels, spec) == texts_of(ref_dev, task), seed


def test_repeats_kept_by_default_and_skipped_with_dedupe(tmp_path):
    folder = write_sst2(tmp_path / "SST-2")
    spec = get_task("SST-2")
    short = r"fewer than 100 examples for classes \[0, 1\]; kept all of them: lower `k_shot`"  # no counts
    with pytest.warns(UserWarning, match=short):
        kept = PromptTextDataModule("SST-2", str(tmp_path), k_shot=100, data_seed=13).load_splits()
    ref_train, _ = reference_k_shot(folder / "train.tsv", 100, 13)
    assert ours(kept.train.records, kept.train.labels, spec) == texts_of(ref_train, "SST-2")
    assert len(kept.train) == 40 and len({r["sentence"] for r in kept.train.records}) == 31  # repeats kept

    # dedupe=True: the same permutation of the file's lines, a later copy of a text skipped
    with open(folder / "train.tsv") as handle:
        lines = handle.readlines()[1:]
    numbers = list(range(len(lines)))
    with global_numpy_seed(13):
        np.random.shuffle(numbers)  # the permutation LM-BFF's shuffle applies to the lines
    first = {}
    for number, line in enumerate(lines):
        first.setdefault(line.split("\t")[0], number)
    groups = {}
    for number in numbers:
        if lines[number].strip() and first[lines[number].split("\t")[0]] == number:
            groups.setdefault(lines[number].strip().split("\t")[-1], []).append(lines[number])
    expected = texts_of([line for group in groups.values() for line in group], "SST-2")
    with pytest.warns(UserWarning, match="fewer than 100"):
        unique = PromptTextDataModule("SST-2", str(tmp_path), k_shot=100, data_seed=13, dedupe=True).load_splits()
    assert ours(unique.train.records, unique.train.labels, spec) == expected and len(expected) == 31


@pytest.mark.parametrize("task", list(CASES))
def test_test_subset_is_drawn_once_with_seed_42(tmp_path, task):
    writer, _, test_file = CASES[task]
    folder = writer(tmp_path / task)
    spec = get_task(task)
    expected = texts_of(reference_test_subset(folder / test_file, 10), task)
    subsets = []
    for seed in (13, 21):
        dm = PromptTextDataModule(task, str(tmp_path), k_shot=2, num_test=10, data_seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            splits = dm.load_splits()
        subsets.append(ours(splits.test.records, splits.test.labels, spec))
    assert subsets[0] == subsets[1] == expected and len(expected) == 10
    # a file no longer than num_test is kept whole, in file order (TREC's 500, SST-2's 872 in the paper)
    whole = PromptTextDataModule(task, str(tmp_path), k_shot=2, num_test=1000).load_splits()
    assert ours(whole.test.records, whole.test.labels, spec) == texts_of(reference_test_subset(folder / test_file,
                                                                                              1000), task)


def reference_mezo_sample(n: int, seed: int, num: int) -> list[int]:
    """MeZO's Dataset.sample_subset: np.random.permutation(n)[:num] under temp_seed(seed)."""
    with global_numpy_seed(seed):
        return np.random.permutation(n).tolist()[:num]


def test_num_train_num_dev_num_test_are_mezo_draws(tmp_path):
    folder = tmp_path / "BoolQ"
    folder.mkdir()
    for name, n in (("train.jsonl", 30), ("dev.jsonl", 20)):  # Google's original BoolQ files
        rows = [{"question": f"is {name} {i} true", "title": "T", "answer": bool(i % 3), "passage": f"P {i}."}
                for i in range(n)]
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = PromptTextDataModule("BoolQ", str(tmp_path), num_train=8, num_dev=4, num_test=6, data_seed=29,
                              prompt="causal")
    splits = dm.load_splits()
    sample = reference_mezo_sample(30, 29, 8 + 4)  # dev = the last num_dev of the sample
    assert [r["question"] for r in splits.train.records] == [f"is train.jsonl {i} true" for i in sample[:8]]
    assert [r["question"] for r in splits.val.records] == [f"is train.jsonl {i} true" for i in sample[8:]]
    evaluation = reference_mezo_sample(20, 29, 6)  # num_eval drawn with the train-set seed
    assert [r["question"] for r in splits.test.records] == [f"is dev.jsonl {i} true" for i in evaluation]
    assert splits.train.labels.tolist() == [int(bool(i % 3)) for i in sample[:8]]  # `answer` is the label


# ----------------------------------------------------------------------------------- SST-2


def test_table2_sst2_is_glue_sst2_and_lm_bff_own_sst2_is_flagged(tmp_path):
    raw = tmp_path / "original"  # LM-BFF's datasets.tar as extracted
    write_sst2(raw / "SST-2", tag="sentence")
    write_sst2(raw / "GLUE-SST-2", tag="phrase")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        splits = PromptTextDataModule("SST-2", str(raw), k_shot=2).load_splits()
    assert all(r["sentence"].startswith("phrase") for r in splits.train.records + splits.test.records)
    with pytest.warns(UserWarning, match="LM-BFF's own SST-2") as record:
        PromptTextDataModule("SST-2", str(raw / "SST-2"), k_shot=2).load_splits()
    assert len(str(record[0].message).splitlines()) == 1

    renamed = tmp_path / "renamed"  # after MeZO's / DPZero's data script: SST-2 is GLUE's
    write_sst2(renamed / "SST-2", tag="phrase")
    write_sst2(renamed / "SST-2-original", tag="sentence")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        splits = PromptTextDataModule("SST-2", str(renamed), k_shot=2).load_splits()
    assert splits.train.records[0]["sentence"].startswith("phrase")
    with pytest.warns(UserWarning, match="LM-BFF's own SST-2"):
        PromptTextDataModule("SST-2", str(renamed / "SST-2-original"), k_shot=2).load_splits()

    alone = write_sst2(tmp_path / "elsewhere" / "sst2", n=6919)  # + a blank line: LM-BFF's 6,920 rows
    assert "LM-BFF's own SST-2" in source_warning(load_task("SST-2", alone))
    assert source_warning(load_task("SST-2", write_sst2(tmp_path / "other" / "sst2"))) is None


# ------------------------------------------------------------------------------------ BoolQ


def test_boolq_prompt_and_tokens_are_mezos(tokenizers, tmp_path):
    """MeZO's BoolQTemplateV3: f"{passage} {question}\\n{candidate}", question capitalised, '?' added once."""
    spec = get_task("BoolQ")
    records = [
        {"passage": "Persian is spoken in Iran and Afghanistan.", "question": "do iran and afghanistan speak persian"},
        {"passage": "The park opens at noon.", "question": "Is the park open at noon?"},
    ]
    prompts = [
        "Persian is spoken in Iran and Afghanistan. Do iran and afghanistan speak persian?\n",
        "The park opens at noon. Is the park open at noon?\n",
    ]
    tokenizer = tokenizers["opt"]
    out = encode_causal(tokenizer, spec, records, 64)
    yes = tokenizer.convert_tokens_to_ids("Yes")
    assert yes != tokenizer.convert_tokens_to_ids("ĠYes") and yes != tokenizer.unk_token_id
    for i, (record, prompt) in enumerate(zip(records, prompts)):
        assert render_text(spec.causal, record) == prompt
        assert candidate_texts(spec, record) == ["No", "Yes"]  # label order (false, true)
        for j, candidate in enumerate(("No", "Yes")):
            row = out["input_ids"][i, j][out["attention_mask"][i, j].bool()].tolist()
            assert row == tokenizer.encode(prompt + candidate)  # MeZO encodes the verbalized prompt, BOS first
            scored = out["input_ids"][i, j][out["candidate_mask"][i, j].bool()].tolist()
            assert scored == tokenizer.encode(candidate, add_special_tokens=False)
            assert tokenizer.decode(row[len(row) - len(scored) - 1 :]) == "\n" + candidate  # no space before it
        assert out["input_ids"][i, 1][out["candidate_mask"][i, 1].bool()].tolist() == [yes]


def test_boolq_long_prompt_is_cut_from_the_left_like_mezo(tokenizers):
    tokenizer = tokenizers["opt"]
    spec = get_task("BoolQ")
    record = {"passage": " ".join(f"word{i}" for i in range(200)), "question": "is it open"}
    out = encode_causal(tokenizer, spec, [record], 40)
    for j, candidate in enumerate(("No", "Yes")):
        full = tokenizer.encode(render_text(spec.causal, record) + candidate)
        mezo = full[0:1] + full[1:][-(40 - 1) :]  # encode_prompt: BOS + the last max_length - 1 tokens
        assert out["input_ids"][0, j].tolist() == mezo


def test_boolq_files_original_and_superglue(tmp_path):
    original, superglue = tmp_path / "boolq", tmp_path / "SuperGLUE" / "BoolQ"
    for folder, rows in (
        (original, [{"question": "is it", "title": "Ethanol fuel", "answer": False, "passage": "All biomass."}]),
        (superglue, [{"question": "is it", "passage": "Ethanol fuel -- All biomass.", "idx": 0, "label": False}]),
    ):
        folder.mkdir(parents=True)
        for name in ("train.jsonl", "dev.jsonl"):
            (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_task("BoolQ", original)
    assert data.train.records == [{"passage": "All biomass.", "question": "is it"}] and data.train.labels == [0]
    assert source_warning(data) is None
    assert "SuperGLUE" in source_warning(load_task("BoolQ", tmp_path / "SuperGLUE"))


# ------------------------------------------------------------------- LM-BFF's masked-LM inputs


def reference_lm_bff_tokens(tokenizer, template, texts, max_length, first_sent_limit=None):
    """LM-BFF's tokenize_multipart_input for the parts of DPZero's six templates (no demonstrations)."""
    def enc(text):
        return tokenizer.encode(text, add_special_tokens=False)

    ids = []
    for part in template.split("*"):
        if part == "cls":
            tokens = [tokenizer.cls_token_id]
        elif part == "mask":
            tokens = [tokenizer.mask_token_id]
        elif part == "sep+":
            tokens = [tokenizer.sep_token_id]
        elif part.startswith("sent_"):
            tokens = enc(texts[int(part[5:])])
        elif part.startswith("+sent_"):
            tokens = enc(" " + texts[int(part[6:])])
        elif part.startswith("sent-_"):
            tokens = enc(texts[int(part[6:])][:-1])
        elif part.startswith("+sentl_"):
            text = texts[int(part[7:])]
            tokens = enc(" " + text[:1].lower() + text[1:])
        else:
            part = part.replace("_", " ")
            tokens = [tokenizer.convert_tokens_to_ids(part)] if len(part) == 1 else enc(part)
        if "sent" in part and int(part.split("_")[1]) == 0 and first_sent_limit is not None:
            tokens = tokens[:first_sent_limit]
        ids += tokens
    return ids[:max_length]


LM_BFF_TEMPLATES = {
    "SST-2": "*cls**sent_0*_It_was*mask*.*sep+*",
    "TREC": "*cls**mask*:*+sent_0**sep+*",
    "MNLI": "*cls**sent-_0*?*mask*,*+sentl_1**sep+*",
}


@pytest.mark.parametrize(
    "task,texts",
    [
        ("SST-2", ["a gorgeous , witty film "]),  # GLUE's trailing space: LM-BFF keeps it as a token
        ("TREC", ["What is the capital?"]),
        ("MNLI", ['He said "no"', "Someone spoke."]),  # sent-_0 drops the last character, here a quote
        ("MNLI", ["The sun rose", " It was morning."]),
    ],
)
def test_masked_lm_inputs_are_lm_bff_tokens(tokenizers, task, texts):
    tokenizer = tokenizers["roberta"]
    spec = get_task(task)
    record = dict(zip(spec.fields, texts))
    out = encode_mlm(tokenizer, spec, [record], 64, faithful=True)
    row = out["input_ids"][0][out["attention_mask"][0].bool()].tolist()
    assert row == reference_lm_bff_tokens(tokenizer, LM_BFF_TEMPLATES[task], texts, 64)


def test_first_sent_limit_and_tail_truncation_are_lm_bffs(tokenizers):
    tokenizer = tokenizers["roberta"]
    spec = get_task("MNLI")
    texts = [" ".join(["word"] * 40) + ".", "A man plays in the park outside and " * 3]
    record = dict(zip(spec.fields, texts))
    for limit, length in ((10, 64), (30, 36)):  # the second cuts the tail (hypothesis and </s>)
        out = encode_mlm(tokenizer, spec, [record], length, first_sent_limit=limit, faithful=True)  # tail
        row = out["input_ids"][0][out["attention_mask"][0].bool()].tolist()
        assert row == reference_lm_bff_tokens(tokenizer, LM_BFF_TEMPLATES["MNLI"], texts, length, limit)
    cut = encode_mlm(tokenizer, spec, [record], 20, faithful=True)  # (the mask past 20: cut by fields, below)
    assert torch.equal(cut["input_ids"], encode_mlm(tokenizer, spec, [record], 20, truncation="fields",
                                                    faithful=True)["input_ids"])


# ---------------------------------------------------------------------------------- configs


def test_paper_configs_carry_the_reference_settings():
    root = Path(__file__).resolve().parents[2] / "configs" / "dpzero"
    lengths = {"SST-2": (128, None), "SST-5": (128, 110), "SNLI": (256, None), "MNLI": (256, 240),
               "RTE": (256, 240), "TREC": (128, 110)}  # DPZero's roberta/examples/run_fewshot.sh
    for path in sorted(root.glob("table*.yaml")):  # (Sec. 5.1's sec51_* read no text task)
        data = yaml.safe_load(path.read_text())["data"]["init_args"]
        if path.name.startswith("table2"):
            assert data["test_seed"] == 42 and data["faithful"] is True and data["data_dir"] == "data/original"
            assert (data["max_length"], data.get("first_sent_limit")) == lengths[data["task"]], path.name
            assert not data.get("dedupe", False) and "truncation" not in data  # faithful: LM-BFF's tail truncation
            assert data["k_dev"] == data["k_shot"] == 512  # validation on LM-BFF's dev.tsv, not the test set
        elif path.name.startswith("table5"):  # MeZO's 2048 positions less the 50 generated tokens
            assert data["max_length"] == 1998 and data["data_dir"] == f"data/{data['task'].lower()}", path.name
        elif data["task"] == "BoolQ":
            assert data["max_length"] == 2048 and data["data_dir"] == "data/boolq", path.name
        assert not data.get("pad_to_max_length", False)  # dynamic padding


def test_new_options_are_checked(tmp_path):
    from lit_zodp.errors import PrivacyConfigError

    with pytest.raises(PrivacyConfigError, match="truncation"):
        PromptTextDataModule("MNLI", str(tmp_path), truncation="head")
    with pytest.raises(PrivacyConfigError, match="`faithful` to be a bool"):
        PromptTextDataModule("MNLI", str(tmp_path), faithful="yes")
    with pytest.raises(PrivacyConfigError, match="`pad_to_max_length` to be a bool"):
        PromptTextDataModule("MNLI", str(tmp_path), pad_to_max_length=1)
    with pytest.raises(PrivacyConfigError, match="prompt='mlm' only"):
        PromptTextDataModule("BoolQ", str(tmp_path), prompt="causal", truncation="tail")
    with pytest.raises(PrivacyConfigError, match="prompt='mlm' only"):
        PromptTextDataModule("BoolQ", str(tmp_path), prompt="causal", first_sent_limit=240)
    with pytest.raises(PrivacyConfigError, match="first_sent_limit"):
        PromptTextDataModule("MNLI", str(tmp_path), first_sent_limit=0)
    dm = PromptTextDataModule("MNLI", str(tmp_path), k_shot=4, dedupe=True, first_sent_limit=240, truncation="tail")
    assert dm.hparams["dedupe"] is True and dm.hparams["truncation"] == "tail"
    assert dm.resolved_test_seed == 42 and PromptTextDataModule("BoolQ", "x", data_seed=29).resolved_test_seed == 29


# ------------------------------------------------------------------- faithful and readable modes


def mlm_text(tokenizer, task, texts, **options):
    spec = get_task(task)
    out = encode_mlm(tokenizer, spec, [dict(zip(spec.fields, texts))], 64, **options)
    return tokenizer.decode(out["input_ids"][0][out["attention_mask"][0].bool()])


def test_faithful_mode_keeps_lm_bffs_quirks_and_the_default_drops_them(tokenizers):
    tokenizer = tokenizers["roberta"]
    sst2 = ["a gorgeous , witty film "]  # GLUE SST-2: every sentence ends in a space
    faithful = encode_mlm(tokenizer, get_task("SST-2"), [{"sentence": sst2[0]}], 64, faithful=True)
    readable = encode_mlm(tokenizer, get_task("SST-2"), [{"sentence": sst2[0]}], 64)
    assert int(faithful["attention_mask"].sum()) == int(readable["attention_mask"].sum()) + 1  # LM-BFF's "Ġ"
    assert readable["input_ids"][0][readable["attention_mask"][0].bool()].tolist() == reference_lm_bff_tokens(
        tokenizer, LM_BFF_TEMPLATES["SST-2"], [sst2[0].strip()], 64)
    # *sent-_0*: LM-BFF drops the premise's last character whatever it is; the default only punctuation
    quote = ['He said "no"', "Someone spoke."]
    assert mlm_text(tokenizer, "MNLI", quote, faithful=True) == '<s>He said "no?<mask>, someone spoke.</s>'
    assert mlm_text(tokenizer, "MNLI", quote) == '<s>He said "no"?<mask>, someone spoke.</s>'
    no_period = ["The sun rose", "It was morning."]
    assert mlm_text(tokenizer, "MNLI", no_period, faithful=True) == "<s>The sun ros?<mask>, it was morning.</s>"
    assert mlm_text(tokenizer, "RTE", no_period) == "<s>The sun rose?<mask>, it was morning.</s>"
    for options in ({}, {"faithful": True}):  # the usual case, a final period, is the same in both modes
        assert mlm_text(tokenizer, "SNLI", ["It rained.", "The ground is wet."], **options) == (
            "<s>It rained?<mask>, the ground is wet.</s>")


def test_faithful_mode_truncates_the_tail_unless_told_otherwise(tokenizers):
    from datamodules.prompt_text import resolve_truncation

    assert resolve_truncation(None, True) == "tail" and resolve_truncation(None, False) == "fields"
    assert resolve_truncation("fields", True) == "fields"
    tokenizer = tokenizers["roberta"]
    record = {"premise": " ".join(["word"] * 60) + ".", "hypothesis": "A man plays."}
    kept = encode_mlm(tokenizer, get_task("MNLI"), [record], 32, faithful=True, truncation="fields")
    assert int((kept["input_ids"] == tokenizer.mask_token_id).sum()) == 1
    # LM-BFF asserts when the mask falls off the end: that row alone is cut by fields, and the other rows keep LM-BFF's
    # tail (red-team review 18: a refusal on one row's length told about that row)
    short = {"premise": "It rained.", "hypothesis": " ".join(["word"] * 40) + "."}
    both = encode_mlm(tokenizer, get_task("MNLI"), [record, short], 32, faithful=True)
    assert torch.equal(both["input_ids"][0], kept["input_ids"][0])
    assert torch.equal(both["input_ids"][1], encode_mlm(tokenizer, get_task("MNLI"), [short], 32,
                                                        faithful=True)["input_ids"][0])
    assert not torch.equal(both["input_ids"][1], encode_mlm(tokenizer, get_task("MNLI"), [short], 32, faithful=True,
                                                            truncation="fields")["input_ids"][0])


MNLI_HEADER = ("index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
               "sentence2_parse sentence1 sentence2 label1 gold_label").split()


def write_mnli_k_shot(root: Path, k: int, seed: int, n: int = 40, dev_file: str = "dev_matched.tsv") -> Path:
    """GLUE MNLI files and the k-shot folder LM-BFF's generator writes from them: ``train.tsv``,
    ``dev_matched.tsv`` (the next k per class) and the original dev sets as ``test_(mis)matched.tsv``."""
    labels = ("entailment", "neutral", "contradiction")

    def row(i, split):
        cells = [str(i), "p", "q", "fiction", "b1", "b2", "p1", "p2", f"A {split} man {i} walks.", f"He {i} moves.",
                 labels[(i * 5) % 3], labels[(i * 5) % 3]]
        return "\t".join(cells) + "\n"

    original = root / "original" / "MNLI"
    original.mkdir(parents=True)
    header = "\t".join(MNLI_HEADER) + "\n"
    (original / "train.tsv").write_text(header + "".join(row(i, "train") for i in range(n)))
    for split in ("matched", "mismatched"):
        (original / f"dev_{split}.tsv").write_text(header + "".join(row(i, split) for i in range(9)))
    train, dev = reference_k_shot(original / "train.tsv", k, seed)
    folder = root / "k-shot" / "MNLI" / f"{k}-{seed}"
    folder.mkdir(parents=True)
    (folder / "train.tsv").write_text(header + "".join(train))
    (folder / dev_file).write_text(header + "".join(dev))
    for split in ("matched", "mismatched"):
        (folder / f"test_{split}.tsv").write_text((original / f"dev_{split}.tsv").read_text())
    return folder


def test_mnli_k_shot_dev_matched_is_the_validation_set(tmp_path):
    folder = write_mnli_k_shot(tmp_path, k=4, seed=13)
    dm = PromptTextDataModule("MNLI", str(tmp_path / "k-shot"), k_shot=4, data_seed=13, tokenizer="minilm",
                              max_length=32, batch_size=2)
    splits = dm.load_splits()
    assert dm.task_data.data_format == "lm-bff" and dm.task_data.dev.path.endswith("dev_matched.tsv")

    def premises(path):
        return [line.split("\t")[8] for line in path.read_text().splitlines()[1:]]

    assert [r["premise"] for r in splits.val.records] == premises(folder / "dev_matched.tsv")
    assert [r["premise"] for r in splits.test.records] == premises(folder / "test_matched.tsv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "validation runs on the test set" warning
        dm.setup()
    assert dm.val_dataset is not dm.test_dataset and len(dm.val_dataset) == 12


def test_validation_on_the_test_set_is_announced(tmp_path):
    write_mnli_k_shot(tmp_path, k=4, seed=13, dev_file="unused.tsv")  # a folder without its dev file
    dm = PromptTextDataModule("MNLI", str(tmp_path / "k-shot"), k_shot=4, data_seed=13, tokenizer="minilm",
                              max_length=32, batch_size=2)
    with pytest.warns(UserWarning, match="validation runs on the test set; set k_dev"):
        dm.setup()
    assert dm.val_dataset is dm.test_dataset
