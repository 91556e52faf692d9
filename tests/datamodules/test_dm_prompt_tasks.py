"""The papers' language-model tasks: readers of the real layouts, sampling, and the three prompt modes.

Every file is written to ``tmp_path`` in the dataset's own format (GLUE TSV, LM-BFF CSV / k-shot folders,
SuperGLUE JSONL); tokenizers are offline: the packaged MiniLM (BERT WordPiece) and tiny byte-level
BPE tokenizers trained here (RoBERTa, OPT and GPT-2 style).
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from importlib.util import find_spec

import pytest
import torch

from datamodules import PromptTextDataModule, TASK_NAMES, get_task, load_task, template_table
from datamodules.collate import EmptySafeCollate
from datamodules.prompt_text import (
    candidate_texts,
    encode_causal,
    encode_mlm,
    numpy_permutation,
    fit_lengths,
    prepare_tokenizer,
    record_key,
    sample_pool,
    special_affixes,
)
from datamodules.testing import build_tiny_bpe_tokenizer, synthetic_examples, write_task_files
from datamodules.text_tasks import parse_hf_name, render_text
from lit_zodp.errors import ConfigError, LitZodpWarning, PrivacyConfigError

GLUE_TASKS = ("SST-2", "SST-5", "SNLI", "MNLI", "RTE", "TREC")
SUPERGLUE_TASKS = ("BoolQ", "CB", "RTE", "WIC", "WSC", "COPA", "MultiRC")
QUICK = dict(batch_size=2, sampling_seed=0, max_length=48)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Paths of tiny RoBERTa / OPT / GPT-2 style tokenizers, and the packaged MiniLM alias."""
    root = tmp_path_factory.mktemp("tokenizers")
    paths = {kind: build_tiny_bpe_tokenizer(root / kind, kind) for kind in ("roberta", "opt", "gpt2")}
    return {**paths, "minilm": "minilm"}


def load_hf_tokenizer(name):
    from lit_zodp.backbones.huggingface import load_tokenizer

    return prepare_tokenizer(load_tokenizer(name))


def data_format_of(task):
    return "glue" if task in GLUE_TASKS else "superglue"


def make_dm(root, task, **kwargs):
    args = {**QUICK, **kwargs}
    return PromptTextDataModule(task, str(root), **args)


# ----------------------------------------------------------------------------------- registry


def test_registry_covers_the_papers_tasks():
    assert set(TASK_NAMES) == {*GLUE_TASKS, *SUPERGLUE_TASKS}
    for name in TASK_NAMES:
        spec = get_task(name)
        assert len(spec.candidates) == spec.num_classes
        if spec.label_words is not None:
            assert len(spec.label_words) == spec.num_classes
        assert spec.prompt_modes == (("causal",) if name == "COPA" else ("mlm", "causal", "none"))
    assert get_task("sst2") is get_task("SST-2") and get_task("WiC") is get_task("wic")
    assert get_task("SST-2").label_words == ("terrible", "great")
    assert get_task("SST-5").label_words == ("terrible", "bad", "okay", "good", "great")
    assert get_task("MNLI").label_words == ("Yes", "Maybe", "No")
    assert get_task("RTE").label_words == ("Yes", "No")
    assert get_task("TREC").label_words == ("Description", "Entity", "Expression", "Human", "Location", "Number")
    assert get_task("BoolQ").candidates == ("No", "Yes")  # MeZO: after "\n", no space
    assert "It was<mask>." in template_table()
    with pytest.raises(ValueError, match="SST-2"):
        get_task("squad")


# ------------------------------------------------------------------------------------ readers


@pytest.mark.parametrize(
    "task,fmt",
    [(t, "glue") for t in GLUE_TASKS] + [(t, "lm-bff") for t in GLUE_TASKS] + [(t, "superglue") for t in TASK_NAMES],
)
def test_every_task_parses_in_its_layouts(tmp_path, task, fmt):
    """Records and labels read back equal what was written, in every task's real file format."""
    spec = get_task(task)
    write_task_files(tmp_path, task, fmt, per_class=3, eval_per_class=2, k_seed_folders=((2, 13), (2, 42)))
    data = load_task(task, tmp_path, "auto", k_shot=2, seed=42)
    assert data.data_format == fmt
    written = synthetic_examples(spec, 2, offset=42_000) if fmt == "lm-bff" else synthetic_examples(spec, 3)
    assert data.train.labels == [label for _, label in written]
    for record, (fields, _) in zip(data.train.records, written):  # as written (SST-2: GLUE's trailing space)
        assert {k: v.strip() for k, v in record.items()} == {name: str(fields[name]) for name in spec.fields}
    assert Counter(data.test.labels) == {c: 2 for c in range(spec.num_classes)}  # SNLI/MNLI "-" rows dropped
    assert (data.dev is not None) == (fmt == "lm-bff")


def test_glue_files_in_their_real_columns(tmp_path):
    """MNLI's 12/16-column TSVs (gold_label last), SNLI, RTE, SST-2 with header, LM-BFF CSVs."""
    mnli = tmp_path / "MNLI"
    mnli.mkdir()
    train_header = "index\tpromptID\tpairID\tgenre\ts1b\ts2b\ts1p\ts2p\tsentence1\tsentence2\tlabel1\tgold_label"
    (mnli / "train.tsv").write_text(
        train_header + "\n"
        + '0\t1\t2\tgov\t(b)\t(b)\t(p)\t(p)\tConceptually "cream" skimming.\tProduct and geography.\tneutral\tneutral\n'
        + "1\t1\t2\tgov\t(b)\t(b)\t(p)\t(p)\tYou know.\tYou lose.\tentailment\tentailment\n"
    )
    dev_header = train_header.replace("label1\tgold_label", "label1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label")
    (mnli / "dev_matched.tsv").write_text(
        dev_header + "\n"
        + "0\t1\t2\tfic\tb\tb\tp\tp\tThe new rights.\tEveryone loves.\tneutral\tn\tn\tn\tn\tcontradiction\n"
        + "1\t1\t2\tfic\tb\tb\tp\tp\tNo gold.\tNone.\tneutral\tn\tn\tn\tn\t-\n"
    )
    data = load_task("MNLI", tmp_path)
    assert data.data_format == "glue"
    first = {"premise": 'Conceptually "cream" skimming.', "hypothesis": "Product and geography."}
    assert data.train.records[0] == first
    assert data.train.labels == [1, 0] and data.test.labels == [2]

    sst5 = tmp_path / "sst-5"
    sst5.mkdir()
    (sst5 / "train.csv").write_text('4,"a gorgeous, witty film"\n0,dull\n')
    (sst5 / "test.csv").write_text("2,so-so\n")
    data = load_task("sst5", tmp_path)
    assert data.train.records == [{"sentence": "a gorgeous, witty film"}, {"sentence": "dull"}]
    assert data.train.labels == [4, 0] and data.test.labels == [2]

    rte = tmp_path / "RTE"
    rte.mkdir()
    (rte / "train.tsv").write_text(
        "index\tsentence1\tsentence2\tlabel\n0\tA cat.\tAn animal.\tentailment\n1\tA.\tB.\tnot_entailment\n"
    )
    (rte / "dev.tsv").write_text("0\tA dog.\tA cat.\tnot_entailment\n")  # headerless: LM-BFF's positions
    data = load_task("RTE", tmp_path)
    assert data.train.labels == [0, 1] and data.test.labels == [1]
    assert data.test.records == [{"premise": "A dog.", "hypothesis": "A cat."}]


def test_superglue_nested_formats(tmp_path):
    """WSC spans under ``target``; MultiRC nested passages flattened to (paragraph, question, answer)."""
    wsc = tmp_path / "WSC"
    wsc.mkdir()
    line = {"text": "Mark lied. He was wrong.", "target": {"span1_text": "Mark", "span2_text": "He", "span1_index": 0,
            "span2_index": 2}, "idx": 0, "label": True}
    (wsc / "train.jsonl").write_text(json.dumps(line) + "\n")
    (wsc / "val.jsonl").write_text(json.dumps({**line, "label": False}) + "\n")
    data = load_task("WSC", tmp_path)
    assert data.train.records == [{"text": "Mark lied. He was wrong.", "span1_text": "Mark", "span2_text": "He"}]
    assert data.train.labels == [1] and data.test.labels == [0]

    multirc = tmp_path / "MultiRC"
    multirc.mkdir()
    passage = {"text": "P.", "questions": [
        {"question": "Q1?", "answers": [{"text": "a", "label": 0}, {"text": "b", "label": 1}], "idx": 0},
        {"question": "Q2?", "answers": [{"text": "c", "label": 1}], "idx": 1},
    ]}
    (multirc / "train.jsonl").write_text(json.dumps({"idx": 0, "passage": passage}) + "\n")
    (multirc / "val.jsonl").write_text(json.dumps({"idx": 1, "passage": passage}) + "\n")
    data = load_task("multirc", tmp_path, "superglue")
    assert [r["answer"] for r in data.train.records] == ["a", "b", "c"] and data.train.labels == [0, 1, 1]
    assert data.train.records[2] == {"paragraph": "P.", "question": "Q2?", "answer": "c"}


def test_reader_errors_name_the_expected_files(tmp_path):
    (tmp_path / "SST-2").mkdir()
    (tmp_path / "SST-2" / "train.tsv").write_text("sentence\tlabel\ngood\t1\n")
    with pytest.raises(FileNotFoundError, match=r"dev\.tsv"):
        load_task("SST-2", tmp_path, "glue")
    with pytest.raises(FileNotFoundError, match="no task folder"):
        load_task("BoolQ", tmp_path)
    (tmp_path / "SST-2" / "dev.tsv").write_text("sentence\tlabel\nbad\tmaybe\n")
    with pytest.raises(ValueError, match="a row's label is none of") as info:  # (review 21: not the row's cell)
        load_task("SST-2", tmp_path)
    assert "maybe" not in str(info.value)
    write_task_files(tmp_path / "kshot", "SST-2", "lm-bff", k_seed_folders=((2, 13),))
    with pytest.raises(FileNotFoundError, match=r"available: \['2-13'\]"):
        load_task("SST-2", tmp_path / "kshot", "lm-bff", k_shot=16, seed=13)
    with pytest.raises(ValueError, match="Unknown data_format"):
        load_task("SST-2", tmp_path, "parquet")


@pytest.mark.skipif(find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_format_without_datasets_says_so():
    with pytest.raises(ImportError, match="datasets"):
        load_task("SST-2", "glue/sst2", "hf")


class _FakeSplit(list):
    def __init__(self, rows, features):
        super().__init__(rows)
        self.features = features


def test_hf_format_with_a_stub_datasets_module(monkeypatch):
    """Names are parsed, ClassLabel integers mapped by name (TREC's hub order differs from LM-BFF's)."""
    from types import ModuleType, SimpleNamespace

    calls = []
    coarse = SimpleNamespace(names=["ABBR", "ENTY", "DESC", "HUM", "LOC", "NUM"])

    def load_dataset(path, config=None):
        calls.append((path, config))
        rows = [{"text": "What is NASA?", "coarse_label": 0}, {"text": "Who wrote it?", "coarse_label": 3}]
        features = {"coarse_label": coarse}
        return {"train": _FakeSplit(rows, features), "test": _FakeSplit(rows[:1], features)}

    stub = ModuleType("datasets")
    stub.load_dataset = load_dataset
    monkeypatch.setitem(__import__("sys").modules, "datasets", stub)
    data = load_task("TREC", "", "hf")
    assert calls == [("trec", None)] and data.data_format == "hf"
    assert data.train.labels == [2, 3] and data.train.records[0] == {"sentence": "What is NASA?"}  # ABBR = Expression
    spec = get_task("BoolQ")
    assert parse_hf_name("super_glue/boolq", spec) == ("super_glue", "boolq")
    assert parse_hf_name("aps/super_glue:boolq", spec) == ("aps/super_glue", "boolq")
    assert parse_hf_name("SetFit/sst5", spec) == ("SetFit/sst5", None)
    assert parse_hf_name("", spec) == ("boolq", None)  # MeZO's BoolQ: the original, not SuperGLUE's copy


# ----------------------------------------------------------------------------------- sampling


def test_k_shot_counts_determinism_and_seeds(tmp_path, tokenizers):
    write_task_files(tmp_path, "SST-5", "glue", per_class=12)
    kwargs = dict(k_shot=4, k_dev=2, tokenizer=tokenizers["minilm"])
    dm = make_dm(tmp_path, "SST-5", data_seed=13, **kwargs)
    dm.setup()
    pool = dm.pool_dataset
    assert Counter(pool.labels.tolist()) == {c: 4 for c in range(5)}
    assert Counter(dm.val_dataset.targets.tolist()) == {c: 2 for c in range(5)}
    private_rows = {tuple(row.tolist()) for row in dm.private_dataset.inputs["input_ids"]}
    assert not private_rows & {tuple(row.tolist()) for row in dm.val_dataset.inputs["input_ids"]}  # disjoint
    again = make_dm(tmp_path, "SST-5", data_seed=13, **kwargs)
    again.setup()
    other = make_dm(tmp_path, "SST-5", data_seed=21, **kwargs)
    other.setup()
    assert again.pool_dataset.records == pool.records
    assert torch.equal(again.private_dataset.inputs["input_ids"], dm.private_dataset.inputs["input_ids"])
    assert other.pool_dataset.records != pool.records
    assert dm.n_private == 20 and len(dm.test_dataset) == 10


def test_num_train_dev_test_subsets(tmp_path, tokenizers):
    write_task_files(tmp_path, "BoolQ", "superglue", per_class=15, eval_per_class=10)
    kwargs = dict(num_train=12, num_dev=5, num_test=7, prompt="causal", tokenizer=tokenizers["opt"])
    dm = make_dm(tmp_path, "BoolQ", data_seed=0, **kwargs)
    dm.setup()
    assert len(dm.pool_dataset) == 12 and len(dm.val_dataset) == 5 and len(dm.test_dataset) == 7
    dm_same = make_dm(tmp_path, "BoolQ", data_seed=0, **kwargs)
    dm_same.setup()
    assert dm_same.pool_dataset.records == dm.pool_dataset.records
    assert torch.equal(dm_same.test_dataset.inputs["input_ids"], dm.test_dataset.inputs["input_ids"])
    dm_other = make_dm(tmp_path, "BoolQ", data_seed=29, **kwargs)
    dm_other.setup()
    assert dm_other.pool_dataset.records != dm.pool_dataset.records
    fixed_test = make_dm(tmp_path, "BoolQ", data_seed=29, test_seed=0, **kwargs)
    fixed_test.setup()
    assert torch.equal(fixed_test.test_dataset.inputs["input_ids"], dm.test_dataset.inputs["input_ids"])
    # train and dev are disjoint draws of the training file
    train, dev = sample_pool([i % 2 for i in range(30)], list(range(30))[::-1], num_train=12, num_dev=5)
    assert train == list(range(29, 17, -1)) and dev == [17, 16, 15, 14, 13]



def test_short_file_keeps_mezos_dev_set():
    """MeZO's sample_train_sets draws the first num_train + num_dev of the permutation and makes the LAST num_dev
    of them dev: CB (250 examples) at its script's 1000 / 100 trains on 150 and validates on 100 (COPA: 300 / 100)."""
    order = numpy_permutation(250, 0)
    mezo = order[: 1000 + 100]  # all 250
    with pytest.warns(LitZodpWarning, match=r"dev is the last 100 of them \(shuffled\) and training the rest "
                                            r"\(at most 150\)"):
        train, dev = sample_pool([i % 3 for i in range(250)], order, num_train=1000, num_dev=100)
    assert train == mezo[:-100] and dev == mezo[-100:]
    train, dev = sample_pool([0] * 400, numpy_permutation(400, 0), num_train=1000, num_dev=100)
    assert (len(train), len(dev)) == (300, 100)


@pytest.mark.parametrize("num_train,num_dev", [(1000, 5), (27, 3), (None, 40), (40, None)])
def test_a_short_files_warning_says_the_same_whatever_one_private_rows_text_is(tmp_path, tokenizers, num_train,
                                                                                num_dev):
    """Review 44: with ``dedupe`` the short-file warnings named (and fired on) the examples left after dropping
    repeats, so what setup printed told whether one private row repeats another. They name the file's size now."""
    write_task_files(tmp_path, "BoolQ", "superglue", per_class=15, eval_per_class=3)
    path = tmp_path / "BoolQ" / "train.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    outputs = []
    for text in (rows[3]["question"], "a question found nowhere else"):  # a repeat of row 3, or a fresh text
        changed = [dict(row) for row in rows]
        changed[7].update(question=text, passage=rows[3]["passage"] if text == rows[3]["question"] else "fresh")
        path.write_text("".join(json.dumps(row) + "\n" for row in changed))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                make_dm(tmp_path, "BoolQ", num_train=num_train, num_dev=num_dev, dedupe=True, prompt="causal",
                        tokenizer=tokenizers["opt"]).setup()
                error = None
            except Exception as err:  # noqa: BLE001 (a refusal is output too: num_dev 40 leaves no training row)
                error = str(err)
        outputs.append(([str(w.message) for w in caught], error))
    assert outputs[0] == outputs[1]
    short = [message for message in outputs[0][0] if "file holds" in message]
    assert short == [] if (num_train, num_dev) == (27, 3) else short and all("30 examples" in m for m in short)


def test_lm_bff_folders_are_picked_by_k_and_seed(tmp_path, tokenizers):
    write_task_files(tmp_path, "MNLI", "lm-bff", k_seed_folders=((2, 13), (2, 42)))
    dm13 = make_dm(tmp_path, "MNLI", k_shot=2, data_seed=13, tokenizer=tokenizers["roberta"])
    dm42 = make_dm(tmp_path, "MNLI", k_shot=2, data_seed=42, tokenizer=tokenizers["roberta"])
    dm13.setup()
    dm42.setup()
    assert dm13.task_data.data_format == "lm-bff" and dm13.task_data.task_dir.endswith("2-13")
    assert Counter(dm13.pool_dataset.labels.tolist()) == {0: 2, 1: 2, 2: 2}
    assert dm13.pool_dataset.records != dm42.pool_dataset.records
    assert len(dm13.val_dataset) == 6 and len(dm13.test_dataset) == 6  # dev.tsv / test_matched.tsv


def test_duplicates_dropped_and_public_task_disjoint(tmp_path, tokenizers):
    """PAZO's setting: MNLI private, SNLI k-shot public; no public example equals a private example."""
    write_task_files(tmp_path, "MNLI", "glue", per_class=5)
    write_task_files(tmp_path, "SNLI", "glue", per_class=5)  # same synthetic texts as MNLI
    snli_train = tmp_path / "SNLI" / "train.tsv"
    lines = snli_train.read_text().splitlines()
    snli_train.write_text("\n".join(lines + [lines[1]]) + "\n")  # a duplicate row
    extra = synthetic_examples(get_task("SNLI"), 3, offset=500)
    with open(snli_train, "a") as handle:
        for i, (f, y) in enumerate(extra):
            row = ["x"] * 11
            row[0], row[7], row[8], row[-1] = str(100 + i), f["premise"], f["hypothesis"], get_task("SNLI").labels[y]
            handle.write("\t".join(row) + "\n")
    dm = make_dm(tmp_path, "MNLI", k_shot=5, public_task="SNLI", public_k_shot=2, tokenizer=tokenizers["roberta"])
    dm.setup()
    assert len(dm.public_dataset) == 6 and Counter(dm.public_dataset.targets.tolist()) == {0: 2, 1: 2, 2: 2}
    public = {record_key(dm.spec, r) for r in dm._load_public()[0].records}  # drawn from the SNLI file alone
    pool = [record_key(dm.spec, r) for r in dm.pool_dataset.records]
    assert [pool[i] for i in dm.private_indices] == [key for key in pool if key not in public]
    assert len(load_task("SNLI", tmp_path).train) == 25  # 15 + duplicate + 9, read as written
    with pytest.raises(PrivacyConfigError, match="share the classes"):
        make_dm(tmp_path, "RTE", public_task="SNLI")


def test_public_tasks_mix_their_draws_and_the_private_task_can_be_one(tmp_path, tokenizers):
    """PAZO Table 7: public MNLI (in distribution, drawn from the private task's own file apart from its private draw),
    SNLI, and half of each. Each source draws its own k per class; private rows equal to any public example leave."""
    write_task_files(tmp_path, "MNLI", "glue", per_class=20)
    snli = write_task_files(tmp_path, "SNLI", "glue", per_class=20) / "train.tsv"
    snli.write_text(snli.read_text().replace("\tA ", "\tPublic: A "))  # the two files share no pair

    def public_keys(**options):
        dm = make_dm(tmp_path, "MNLI", k_shot=6, tokenizer=tokenizers["roberta"], **options)
        dm.setup()
        pool = [record_key(dm.spec, r) for r in dm.pool_dataset.records]
        public = dm._load_public()[0]
        keys = [record_key(dm.spec, r) for r in public.records]
        assert not {pool[i] for i in dm.private_indices} & set(keys)  # no public example is private
        return keys, Counter(public.labels.tolist())

    snli_only, counts = public_keys(public_task="SNLI", public_k_shot=2)
    assert counts == {0: 2, 1: 2, 2: 2} and all(key[0].startswith("Public:") for key in snli_only)
    mnli_only, counts = public_keys(public_task="MNLI", public_k_shot=2)
    assert counts == {0: 2, 1: 2, 2: 2} and not any(key[0].startswith("Public:") for key in mnli_only)
    mixed, counts = public_keys(public_task=["MNLI", "SNLI"], public_k_shot=[1, 1])
    assert counts == {0: 2, 1: 2, 2: 2} and sum(key[0].startswith("Public:") for key in mixed) == 3
    assert public_keys(public_task="SNLI", public_k_shot=2)[0] == snli_only  # a function of the files alone
    # the first source draws as a single public task does (Table 5's configs unchanged); the second with its own seed
    one, _ = public_keys(public_task="MNLI", public_k_shot=1)
    assert mixed[:3] == one
    for bad, message in ((dict(public_task=["MNLI", "SNLI"], public_k_shot=[1]), "2 public tasks"),
                         (dict(public_task=["SNLI", "SNLI"]), "lists a task twice"),
                         (dict(public_task=["SNLI", "RTE"]), "share the classes"),
                         (dict(public_task=["SNLI"], public_k_shot=[0]), "public_k_shot")):
        with pytest.raises(PrivacyConfigError, match=message):
            make_dm(tmp_path, "MNLI", **bad)


def _swap_pair(path, old, new):
    """Rewrite the (M/S)NLI file ``path`` with ``new`` in the text fields of the row holding ``old``."""
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    first, second = rows[0].index("sentence1"), rows[0].index("sentence2")
    for row in rows[1:]:
        if (row[first].strip(), row[second].strip()) == old:
            row[first], row[second] = new
    path.write_text("".join("\t".join(row) + "\n" for row in rows))


@pytest.mark.parametrize("public_k_shot", [None, 5])
def test_the_public_task_split_does_not_depend_on_the_private_rows(tmp_path, tokenizers, public_k_shot):
    """Replace-one neighbours: one private MNLI row replaced by a pair of the public SNLI split. The public
    split (size, rows, first public batch) stays as it was; the private set loses that row instead."""
    mnli = write_task_files(tmp_path, "MNLI", "glue", per_class=20) / "train.tsv"
    snli = write_task_files(tmp_path, "SNLI", "glue", per_class=20) / "train.tsv"
    snli.write_text(snli.read_text().replace("\tA ", "\tPublic: A "))  # the two files share no pair

    def build():
        dm = make_dm(tmp_path, "MNLI", prompt="none", tokenizer=tokenizers["roberta"], public_task="SNLI",
                     public_k_shot=public_k_shot, batch_size=4, public_in_step=True)
        dm.setup("fit")
        return dm, next(iter(dm.train_dataloader()["public"]))

    before, first_batch = build()
    private_row = before.pool_dataset.records[before.private_indices[0]]
    public_pair = record_key(before.spec, before._load_public()[0].records[0])
    _swap_pair(mnli, record_key(before.spec, private_row), public_pair)
    after, first_batch_after = build()
    assert len(after.public_dataset) == len(before.public_dataset)
    for name, value in before.public_dataset.inputs.items():
        assert torch.equal(after.public_dataset.inputs[name], value)
    assert torch.equal(first_batch_after[0]["input_ids"], first_batch[0]["input_ids"])
    assert after.n_private == before.n_private - 1


# ---------------------------------------------------------------------------------- masked LM


@pytest.mark.parametrize("kind", ["roberta", "minilm"])
def test_mlm_prompts_hold_one_mask_for_every_task(tmp_path, tokenizers, kind):
    tokenizer = load_hf_tokenizer(tokenizers[kind])
    prefix, suffix = special_affixes(tokenizer)
    for task in TASK_NAMES:
        spec = get_task(task)
        if spec.mlm is None:
            continue
        records = [fields for fields, _ in synthetic_examples(spec, 1)]
        records = [{k: str(v) for k, v in r.items()} for r in records]
        out = encode_mlm(tokenizer, spec, records, 64)
        ids, mask = out["input_ids"], out["attention_mask"]
        assert ids.shape == (spec.num_classes, 64) and set(out) == {"input_ids", "attention_mask"}
        assert ((ids == tokenizer.mask_token_id).sum(1) == 1).all(), task
        for row, m in zip(ids, mask):
            real = row[m.bool()].tolist()
            assert real[: len(prefix)] == prefix and real[len(real) - len(suffix) :] == suffix
            assert (row[~m.bool()] == tokenizer.pad_token_id).all()


def test_mlm_datamodule_matches_lm_bff_and_the_prompt_backbone(tmp_path, tokenizers):
    write_task_files(tmp_path, "SST-2", "glue", per_class=3)
    dm = make_dm(tmp_path, "SST-2", tokenizer=tokenizers["roberta"], faithful=True)
    dm.setup()
    tok = dm.tokenizer
    assert dm.label_words == ["terrible", "great"] and dm.num_classes == 2
    inputs, target = dm.test_dataset[0]
    text = tok.decode(inputs["input_ids"][inputs["attention_mask"].bool()])
    # faithful: LM-BFF tokenizes GLUE's trailing space ("Ġ") before " It was"
    assert text == "<s>A bad movie, number 10000 of class 0.  It was<mask>.</s>"
    readable = make_dm(tmp_path, "SST-2", tokenizer=tokenizers["roberta"])  # the default: values stripped
    readable.setup()
    inputs, _ = readable.test_dataset[0]
    assert tok.decode(inputs["input_ids"][inputs["attention_mask"].bool()]) == (
        "<s>A bad movie, number 10000 of class 0. It was<mask>.</s>")
    assert dm.template == "<sentence> It was<mask>." and dm.labels == ["negative", "positive"]
    from lit_zodp.backbones import HFPromptClassifier

    config = dict(model_type="roberta", vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, max_position_embeddings=64, pad_token_id=tok.pad_token_id)
    model = HFPromptClassifier(config=config, label_words=dm.label_words, lm_type="mlm",
                               tokenizer_name_or_path=tokenizers["roberta"]).eval()
    # the ids the prompt backbone reads at the mask: each label word one token after a space
    assert model.label_word_ids.tolist() == dm.label_word_ids()
    batch = next(iter(dm.test_dataloader()))
    with torch.no_grad():
        assert model(batch[0]).shape == (len(batch[1]), 2)


def test_mlm_truncation_keeps_the_template_and_mask(tokenizers):
    tokenizer = load_hf_tokenizer(tokenizers["roberta"])
    spec = get_task("MNLI")
    long = " ".join(["word"] * 200) + "."
    out = encode_mlm(tokenizer, spec, [{"premise": long, "hypothesis": "A short one."}], 24)
    ids = out["input_ids"][0]
    assert int(out["attention_mask"].sum()) == 24 and (ids == tokenizer.mask_token_id).sum() == 1
    text = tokenizer.decode(ids)
    assert text.startswith("<s>word word") and text.endswith("?<mask>, a short one.</s>")  # premise cut, not the rest
    assert fit_lengths([10, 3, 7], 12) == [5, 3, 4] and fit_lengths([2, 3], 9) == [2, 3]
    with pytest.raises(ValueError, match="mask would be lost"):
        encode_mlm(tokenizer, get_task("WIC"), [{"word": "w", "sentence1": "a", "sentence2": "b"}], 8)
    # a mask token written in the data is not a second mask
    out = encode_mlm(tokenizer, get_task("SST-2"), [{"sentence": "fill <mask> here"}], 32)
    assert (out["input_ids"] == tokenizer.mask_token_id).sum() == 1
    with pytest.raises(ValueError, match="mask token"):
        encode_mlm(load_hf_tokenizer(tokenizers["gpt2"]), spec, [{"premise": "a", "hypothesis": "b"}], 16)


# ------------------------------------------------------------------------------------ causal



#: MeZO's default template of each task (large_models/templates.py; BoolQ: BoolQTemplateV3), written out: the prompt
#: MeZO scores the candidates after (``encode(sample).strip(' ')``) and each candidate in label order, the text
#: ``verbalize(sample, candidate)`` adds to it (its tokens are the option tokens MeZO scores)
MEZO_CAUSAL = {
    "SST-2": ({"sentence": " a gripping , funny film . "}, "a gripping , funny film . It was", [" terrible", " great"]),
    "RTE": ({"premise": "Dana went home.", "hypothesis": "Dana left."},
            'Dana went home.\nDoes this mean that "Dana left." is true? Yes or No?\n', ["Yes", "No"]),
    "CB": ({"premise": "It rained all day.", "hypothesis": "it was wet"},
           'Suppose It rained all day. Can we infer that "it was wet"? Yes, No, or Maybe?\n', ["Yes", "No", "Maybe"]),
    "BoolQ": ({"passage": "Paris is the capital of France.", "question": "is paris in france"},
              "Paris is the capital of France. Is paris in france?\n", ["No", "Yes"]),
    "WIC": ({"word": "bank", "sentence1": "He sat on the bank.", "sentence2": "The bank was closed."},
            'Does the word "bank" have the same meaning in these two sentences? Yes, No?\nHe sat on the bank.\n'
            "The bank was closed.\n", ["No", "Yes"]),
    "WSC": ({"text": "Mark told Pete he was late.", "span1_text": "Mark", "span2_text": "He"},
            'Mark told Pete he was late.\nIn the previous sentence, does the pronoun "he" refer to Mark? Yes or No?\n',
            ["No", "Yes"]),
    "MultiRC": ({"paragraph": "Sent 1: Tom ran.", "question": "Who ran?", "answer": "Tom"},
                'Sent 1: Tom ran.\nQuestion: Who ran?\nI found this answer "Tom". Is that correct? Yes or No?\n',
                ["No", "Yes"]),
    "COPA": ({"premise": "The man fell.", "question": "cause", "choice1": "He tripped.", "choice2": "I pushed him."},
             "The man fell because", [" he tripped.", " I pushed him."]),
}


@pytest.mark.parametrize("task", sorted(MEZO_CAUSAL))
def test_causal_templates_are_mezos_byte_for_byte(task):
    """Spaces before the candidates, newlines, quotes, BoolQ's '?' and capital, WSC's lower-cased pronoun, COPA's
    connective (' so ' for an effect) and lower-cased first word (but "I"), as MeZO's strings; candidates in label
    order (CB: entailment, contradiction, neutral)."""
    record, prompt, candidates = MEZO_CAUSAL[task]
    spec = get_task(task)
    assert render_text(spec.causal, record) == prompt
    assert candidate_texts(spec, record) == candidates
    if task == "COPA":
        effect = {**record, "question": "effect", "choice1": "The Man cried."}
        assert render_text(spec.causal, effect) == "The man fell so"
        assert candidate_texts(spec, effect)[0] == " the Man cried."


@pytest.mark.parametrize("kind", ["opt", "gpt2"])
def test_causal_candidate_mask_covers_exactly_the_candidates(tokenizers, kind):
    tokenizer = load_hf_tokenizer(tokenizers[kind])
    prefix, _ = special_affixes(tokenizer)
    assert prefix == ([tokenizer.bos_token_id] if kind == "opt" else [])
    for task in TASK_NAMES:
        spec = get_task(task)
        records = [{k: str(v) for k, v in f.items()} for f, _ in synthetic_examples(spec, 1)]
        out = encode_causal(tokenizer, spec, records, 96)
        k = spec.num_classes
        assert set(out) == {"input_ids", "attention_mask", "candidate_mask"}
        assert all(v.shape == (len(records), k, 96) and v.dtype == torch.long for v in out.values())
        for i, record in enumerate(records):
            cands = candidate_texts(spec, record)
            for j in range(k):
                ids, att, cm = (out[key][i, j] for key in ("input_ids", "attention_mask", "candidate_mask"))
                assert tokenizer.decode(ids[cm.bool()]) == cands[j], task
                real = ids[att.bool()].tolist()
                assert real[: len(prefix)] == prefix
                assert att.bool()[: len(real)].all() and not att.bool()[len(real) :].any()  # right padding
                assert cm.nonzero().max() == len(real) - 1  # the candidate ends the row
                # the same tokens as MeZO's joint encoding of prompt + candidate
                joint = tokenizer(render_text(spec.causal, record) + cands[j])["input_ids"]
                assert real == joint, task
            prompts = out["input_ids"][i] * (1 - out["candidate_mask"][i]) * out["attention_mask"][i]
            first = out["candidate_mask"][i].argmax(1)
            assert (first == first[0]).all() and (prompts[:, : first[0]] == prompts[0, : first[0]]).all()


def test_causal_truncation_cuts_the_prompt_from_the_left(tokenizers):
    tokenizer = load_hf_tokenizer(tokenizers["opt"])
    spec = get_task("BoolQ")
    record = {"passage": " ".join(f"w{i}" for i in range(300)), "question": "is it true"}
    out = encode_causal(tokenizer, spec, [record], 32)
    assert out["attention_mask"][0].sum(1).max() == 32
    for j, cand in enumerate(candidate_texts(spec, record)):
        ids = out["input_ids"][0, j]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids[out["candidate_mask"][0, j].bool()]) == cand
        assert tokenizer.decode(ids[out["attention_mask"][0, j].bool()]).endswith("w299 Is it true?\n" + cand)
    # a choice is a private row's text: too long, it keeps its first tokens (a refusal told that some private choice
    # was that long; review 44); the shared label words are public and refused when they cannot fit
    copa = {"premise": "p", "choice1": "a " * 20, "choice2": "b", "question": "cause"}
    out = encode_causal(tokenizer, get_task("COPA"), [copa], 8)
    long_choice = tokenizer(candidate_texts(get_task("COPA"), copa)[0], add_special_tokens=False)["input_ids"]
    row = out["input_ids"][0, 0][out["attention_mask"][0, 0].bool()].tolist()
    assert len(row) == 8 and row[0] == tokenizer.bos_token_id and row[2:] == long_choice[:6]
    assert out["candidate_mask"][0, 0].sum() == 6 and out["candidate_mask"][0, 1].sum() >= 1
    with pytest.raises(ValueError, match="does not fit"):
        encode_causal(tokenizer, get_task("SST-5"), [{"sentence": "fine"}], 1)


def test_causal_datamodule_batches_and_empty_batches(tmp_path, tokenizers):
    write_task_files(tmp_path, "COPA", "superglue", per_class=4)
    with pytest.raises(PrivacyConfigError, match=r"COPA supports prompt modes \('causal',\)"):
        make_dm(tmp_path, "COPA", prompt="mlm")
    dm = make_dm(tmp_path, "COPA", prompt="causal", tokenizer=tokenizers["opt"])
    assert dm.num_classes == 2 and dm.candidates is None and dm.label_words is None
    dm.setup()
    inputs, targets = next(b for b in dm.train_dataloader() if len(b[1]))
    assert set(inputs) == {"input_ids", "attention_mask", "candidate_mask"}
    longest = int(inputs["attention_mask"].sum(-1).max())  # padded to the longest row of the batch
    assert inputs["input_ids"].shape == (len(targets), 2, longest) and longest < 48
    empty_inputs, empty_targets = EmptySafeCollate(dm.private_dataset)([])
    assert {k: tuple(v.shape) for k, v in empty_inputs.items()} == {k: (0, 2, 48) for k in inputs}
    assert empty_targets.shape == (0,) and empty_targets.dtype == torch.long
    dm_sst = make_dm(tmp_path / "sst", "SST-2", prompt="causal", tokenizer=tokenizers["opt"])
    write_task_files(tmp_path / "sst", "SST-2", "glue")
    assert dm_sst.candidates == [" terrible", " great"] and dm_sst.num_candidates == 2
    assert dm_sst.template == "<sentence> It was + <candidate>"
    dm_sst.setup()
    empty_inputs, _ = EmptySafeCollate(dm_sst.private_dataset)([])
    assert empty_inputs["input_ids"].shape == (0, 2, 48)


def test_causal_batches_feed_the_candidate_scorer(tmp_path, tokenizers):
    from lit_zodp.backbones import huggingface

    scorer_class = getattr(huggingface, "HFCandidateScorer", None)
    if scorer_class is None:
        pytest.skip("no HFCandidateScorer backbone")
    write_task_files(tmp_path, "BoolQ", "superglue", per_class=2)
    dm = make_dm(tmp_path, "BoolQ", prompt="causal", tokenizer=tokenizers["opt"])
    dm.setup()
    tok = dm.tokenizer
    config = dict(model_type="opt", vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                  num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=16,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = scorer_class(config=config, num_classes=dm.num_classes).eval()
    inputs, targets = next(iter(dm.test_dataloader()))
    with torch.no_grad():
        assert model(inputs).shape == (len(targets), 2)
        assert model.per_example_loss(inputs, targets).shape == (len(targets),)


def test_gpt2_style_prompt_must_leave_a_token_before_the_candidate(tokenizers):
    tokenizer = load_hf_tokenizer(tokenizers["gpt2"])
    spec = get_task("SST-2")
    longest = max(len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in spec.candidates)
    out = encode_causal(tokenizer, spec, [{"sentence": "fine"}], longest + 1)  # one prompt token left
    assert (out["candidate_mask"][0, :, 0] == 0).all()
    with pytest.raises(ValueError, match="no token before its candidates"):
        encode_causal(tokenizer, spec, [{"sentence": "fine"}], longest)


# ------------------------------------------------------------------------------------- plain


def test_plain_mode_and_empty_batches(tmp_path, tokenizers):
    write_task_files(tmp_path, "RTE", "superglue", per_class=4)
    dm = make_dm(tmp_path, "RTE", prompt="none", tokenizer=tokenizers["minilm"])
    dm.setup()
    inputs, target = dm.test_dataset[0]
    assert set(inputs) == {"input_ids", "attention_mask", "token_type_ids"}
    assert inputs["token_type_ids"].sum() > 0  # a sentence pair
    tok = dm.tokenizer
    assert tok.decode(inputs["input_ids"][inputs["attention_mask"].bool()]).startswith("[CLS] a man plays")
    empty_inputs, _ = EmptySafeCollate(dm.private_dataset)([])
    assert all(v.shape == (0, 48) for v in empty_inputs.values())
    mlm = make_dm(tmp_path, "RTE", tokenizer=tokenizers["minilm"])
    mlm.setup()
    empty_inputs, _ = EmptySafeCollate(mlm.private_dataset)([])
    assert {k: tuple(v.shape) for k, v in empty_inputs.items()} == {"input_ids": (0, 48), "attention_mask": (0, 48)}
    assert mlm.hparams["task"] == "RTE" and mlm.hparams["prompt"] == "mlm"


def test_config_errors_list_the_options(tmp_path):
    with pytest.raises(PrivacyConfigError, match="Unknown task 'sst3'.*SST-2"):
        PromptTextDataModule("sst3", str(tmp_path))
    with pytest.raises(PrivacyConfigError, match="k_shot.*num_train"):
        PromptTextDataModule("SST-2", str(tmp_path), k_shot=4, num_train=10)
    with pytest.raises(PrivacyConfigError, match="prompt"):
        PromptTextDataModule("SST-2", str(tmp_path), prompt="seq2seq")
    with pytest.raises(PrivacyConfigError, match="data_format"):
        PromptTextDataModule("SST-2", str(tmp_path), data_format="csv")
    dm = PromptTextDataModule("TREC", str(tmp_path / "missing"))
    assert dm.num_classes == 6  # known before setup
    with pytest.raises(ConfigError, match=r"^`data.init_args.data_dir`: TREC: data_dir .* is not a folder; .*'Paper configs'"):
        dm.setup()


def test_missing_data_is_a_config_error_naming_the_option(tmp_path):
    """A missing folder or file is a ConfigError (one line, exit code 2 in the CLI) naming the option to set."""
    (tmp_path / "SST-2").mkdir()
    (tmp_path / "SST-2" / "train.tsv").write_text("sentence\tlabel\ngood\t1\n")
    with pytest.raises(ConfigError, match=r"^`data.init_args.data_dir`: SST-2 \(glue layout\): no test file") as info:
        PromptTextDataModule("SST-2", str(tmp_path), data_format="glue").setup()
    assert isinstance(info.value.__cause__, FileNotFoundError) and "\n" not in str(info.value)
    write_task_files(tmp_path / "original", "SST-2", "glue")
    dm = PromptTextDataModule("SST-2", str(tmp_path / "original"), public_task="SST-2",
                              public_data_dir=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"^`data.init_args.public_data_dir`: SST-2: data_dir .* is not a folder"):
        dm.setup()


# ---------------------------------------------------------------------- backbone / prompt checks


def test_a_backbone_that_cannot_read_the_prompts_is_named(tmp_path):
    from lit_zodp.backbones import HFCandidateScorer, HFPromptClassifier, HFSequenceClassifier, tiny_bert_config
    from datamodules.prompt_text import backbone_mismatch

    mlm = PromptTextDataModule("SST-2", str(tmp_path))
    head = HFSequenceClassifier(config=tiny_bert_config())
    message = backbone_mismatch(mlm, head)
    assert "HFSequenceClassifier adds a new random classification head" in message and "\n" not in message
    assert "HFPromptClassifier with label_words ['terrible', 'great']" in message
    prompt = HFPromptClassifier(config=tiny_bert_config(), label_word_ids=[10, 11], mask_token_id=103, lm_type="mlm")
    assert backbone_mismatch(mlm, prompt) is None
    assert backbone_mismatch(PromptTextDataModule("SST-2", str(tmp_path), prompt="none"), head) is None
    causal = PromptTextDataModule("SST-2", str(tmp_path), prompt="causal")
    assert "HFCandidateScorer" in backbone_mismatch(causal, prompt)
    scorer = HFCandidateScorer(config=dict(model_type="opt", vocab_size=64, hidden_size=8, num_hidden_layers=1,
                                           ffn_dim=16, num_attention_heads=2, max_position_embeddings=32,
                                           word_embed_proj_dim=8))
    assert backbone_mismatch(causal, scorer) is None and "candidate rows" in backbone_mismatch(mlm, scorer)
    assert backbone_mismatch(mlm, torch.nn.Linear(2, 2)) is None  # a user's own backbone is trusted


def test_a_tokenizer_that_cannot_be_loaded_is_one_line_naming_the_option(tmp_path):
    from lit_zodp.errors import ConfigError

    write_task_files(tmp_path, "SST-2", "glue", per_class=2)
    dm = make_dm(tmp_path, "SST-2", tokenizer=str(tmp_path / "no-such-tokenizer"))
    with pytest.raises(ConfigError, match=r"could not load `tokenizer`=.*no-such-tokenizer") as excinfo:
        dm.setup()
    assert "\n" not in str(excinfo.value)


# ------------------------------------------------------------------------ separation by text and group


def _write_multirc(root, passages=4, questions=3, answers=3):
    folder = root / "MultiRC"
    folder.mkdir()

    def passage(p):
        return {"text": f"Paragraph {p} about person {p}.", "questions": [
            {"question": f"Question {q} on {p}?", "answers": [{"text": f"answer {a}", "label": a % 2}
                                                              for a in range(answers)]} for q in range(questions)]}

    (folder / "train.jsonl").write_text("".join(json.dumps({"idx": p, "passage": passage(p)}) + "\n"
                                                for p in range(passages)))
    (folder / "val.jsonl").write_text(json.dumps({"idx": 99, "passage": passage(99)}) + "\n")


@pytest.mark.parametrize("data_seed", [0, 1, 2])
def test_multirc_hold_outs_are_carved_by_paragraph(tmp_path, data_seed):
    """One paragraph has many answer rows: none may sit in both the public and the private split
    (row-level carving put all 4 paragraphs on both sides in audit 3)."""
    _write_multirc(tmp_path)
    dm = make_dm(tmp_path, "MultiRC", data_format="superglue", prompt="none", tokenizer="minilm",
                 public_fraction=0.5, val_fraction=0.25, data_seed=data_seed)
    dm.setup("fit")
    paragraph = [record["paragraph"] for record in dm.pool_dataset.records]
    private = {paragraph[i] for i in dm.private_indices}
    assert private and not private & {paragraph[i] for i in dm.public_indices}
    assert not private & {paragraph[i] for i in dm.val_indices}
    assert len(dm.public_indices) % 9 == 0 and len(dm.public_indices) == 18  # whole paragraphs of 9 rows


@pytest.mark.parametrize("repeated", [True, False])
def test_validation_drawn_from_the_training_file_without_dedupe_warns_naming_dedupe(tmp_path, repeated):
    """Whether or not a text repeats (red-team review 17: a warning printed only when a private text repeated a
    validation text was a bit about the private rows); ``dedupe: true`` silences it."""
    folder = tmp_path / "SST-2"
    folder.mkdir()
    rows = [(f"a distinct sentence {i}", i % 2) for i in range(12)]
    rows += [("the same sentence", 1)] * 12 if repeated else [(f"another sentence {i}", 1) for i in range(12)]
    (folder / "train.tsv").write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows))
    (folder / "dev.tsv").write_text("sentence\tlabel\n" + "".join(f"dev {i}\t{i % 2}\n" for i in range(4)))
    no_count = r"^PromptTextDataModule: validation examples are drawn from the training data.*`dedupe: true`"
    with pytest.warns(UserWarning, match=no_count):
        make_dm(tmp_path, "SST-2", prompt="none", tokenizer="minilm", num_dev=8, data_seed=0).setup("fit")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*validation examples are drawn")
        make_dm(tmp_path, "SST-2", prompt="none", tokenizer="minilm", num_dev=8, data_seed=0, dedupe=True).setup("fit")


def test_multirc_validation_rows_drawn_from_private_paragraphs_warn(tmp_path):
    """``num_dev`` draws validation rows from the training file row by row: a paragraph can then
    have rows on both sides, which warns (the carved ``val_fraction`` takes whole paragraphs)."""
    _write_multirc(tmp_path)
    no_count = r"^PromptTextDataModule: the validation rows are drawn row by row from the training file.*`val_fraction`"
    with pytest.warns(UserWarning, match=no_count):
        make_dm(tmp_path, "MultiRC", data_format="superglue", prompt="none", tokenizer="minilm",
                num_dev=8, data_seed=0).setup("fit")


@pytest.mark.parametrize("broken", ["columns", "label"])
def test_a_malformed_rows_refusal_names_its_place_not_its_text(tmp_path, broken):
    """Red-team review 18: the readers quoted the row (``row 78 has 2 columns ...: ['77', 'zebracornflakes ...']``,
    ``example N has no label ...: {...}``), a private row's text in the output."""
    folder = write_task_files(tmp_path, "SNLI" if broken == "columns" else "BoolQ",
                              "glue" if broken == "columns" else "superglue", per_class=6)
    if broken == "columns":
        train = folder / "train.tsv"
        train.write_text(train.read_text() + "77\tzebracornflakes sat on the mat.\n")
    else:
        train = folder / "train.jsonl"
        train.write_text(train.read_text() + json.dumps({"question": "zebracornflakes?", "passage": "p"}) + "\n")
    with pytest.raises(ValueError, match="columns, expected|has no label") as info:
        make_dm(tmp_path, "SNLI" if broken == "columns" else "BoolQ", prompt="none", tokenizer="minilm").setup()
    assert "zebracornflakes" not in str(info.value)


def test_another_data_seed_of_a_k_shot_draw_changes_the_split_id(tmp_path):
    """Review 19: the paper configs draw k_shot and k_dev from the training file by data_seed, with no carved
    held-out part, so the pool size and private count stay the same under another seed while rows that were private
    become validation rows; the split id (which refuses such a resume) now hashes the seed and the validation ids."""
    write_task_files(tmp_path, "SST-5", "glue", per_class=12)

    def drawn(data_seed):
        dm = make_dm(tmp_path, "SST-5", prompt="none", tokenizer="minilm", k_shot=4, k_dev=2, data_seed=data_seed)
        dm.setup("fit")
        return dm

    first, second = drawn(13), drawn(21)
    assert len(first.private_indices) == len(second.private_indices)
    assert first.split_id != second.split_id and first.split_id == drawn(13).split_id


@pytest.mark.parametrize("truncation", ["tail", "fields"])
def test_one_rows_long_fixed_field_is_cut_rather_than_stopping_the_encoding(truncation):
    """Review 19: WSC's spans (and WiC's word) are a row's own fixed fields; one row with a long span raised "the
    masked-LM template needs <its length> tokens" and stopped the run. Now its fixed fields are cut too, after its
    text, and the other rows are encoded as before."""
    from lit_zodp.backbones.huggingface import load_tokenizer

    tokenizer = prepare_tokenizer(load_tokenizer("minilm"))
    spec = get_task("WSC")
    usual = {"text": "The cat sat on the mat because it was warm.", "span1_text": "the cat", "span2_text": "it"}
    long_span = {"text": "Short.", "span1_text": " ".join(["very"] * 60) + " long noun phrase", "span2_text": "it"}
    both = encode_mlm(tokenizer, spec, [usual, long_span], 48, truncation=truncation)
    assert (both["input_ids"] == tokenizer.mask_token_id).sum(1).tolist() == [1, 1]
    assert int(both["attention_mask"][1].sum()) == 48
    alone = encode_mlm(tokenizer, spec, [usual], 48, truncation=truncation)
    assert torch.equal(both["input_ids"][0], alone["input_ids"][0])
