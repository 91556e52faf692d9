"""SQuAD and DROP as MeZO/DPZero read, draw and prompt them (DPZero Table 5): files in the official formats."""

import json

import numpy as np
import pytest
import torch

from datamodules.qa import QADataModule, QARecord, drop_answers, get_qa_task, load_qa
from datamodules.testing import QA_WORDS, squad_official, write_qa_files
from lit_zodp.backbones.generation import ANSWER_IDS, NO_TOKEN
from lit_zodp.backbones.tiny_hf import save_tiny_pretrained
from lit_zodp.errors import ConfigError


@pytest.fixture(scope="module")
def opt_path(tmp_path_factory):
    return save_tiny_pretrained(tmp_path_factory.mktemp("opt"), "opt", vocab_texts=[QA_WORDS])


def squad_hf_rows(data):
    """The rows Hugging Face's ``squad`` builder yields from the official JSON (newest version: nothing stripped)."""
    return [{"id": qa["id"], "title": article["title"], "context": paragraph["context"], "question": qa["question"],
             "answers": {"text": [a["text"] for a in qa["answers"]], "answer_start": [a["answer_start"]
                                                                                      for a in qa["answers"]]}}
            for article in data["data"] for paragraph in article["paragraphs"] for qa in paragraph["qas"]]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_squad_official_json_and_hugging_face_rows_give_the_same_examples_in_the_same_order(tmp_path):
    train, dev = squad_official(3), squad_official(2, offset=50)
    (tmp_path / "official").mkdir()
    (tmp_path / "official" / "train-v1.1.json").write_text(json.dumps(train))
    (tmp_path / "official" / "dev-v1.1.json").write_text(json.dumps(dev))
    (tmp_path / "rows").mkdir()
    write_jsonl(tmp_path / "rows" / "train.jsonl", squad_hf_rows(train))
    write_jsonl(tmp_path / "rows" / "validation.jsonl", squad_hf_rows(dev))
    task = get_qa_task("squad")
    official, rows = load_qa(task, str(tmp_path / "official")), load_qa(task, str(tmp_path / "rows"))
    assert official == rows
    assert len(official["train"]) == 3 * 2 * 2 and len(official["test"]) == 2 * 2 * 2
    first = official["train"][0]
    assert first.fields == {"title": "River_0", "context": train["data"][0]["paragraphs"][0]["context"],
                            "question": " How many bridges are there 0 ? "}
    assert first.answers == ("seven", "seven bridges") and official["train"][1].answers == ("seven",)


def test_drop_answers_are_converted_as_hugging_faces_drop_builder_converts_them(tmp_path):
    blank = {"number": "", "date": {"day": "", "month": "", "year": ""}, "spans": []}
    assert drop_answers([{**blank, "number": "12"}]) == ("12",)
    assert drop_answers([{**blank, "date": {"day": "3", "month": "May", "year": "1850"}}]) == ("3 May 1850",)
    assert drop_answers([{**blank, "date": {"day": "", "month": "May", "year": "1850"}}]) == ("May 1850",)
    assert drop_answers([{**blank, "date": {"day": "1", "month": "", "year": "1990"}}]) == ("1  1990",)  # (as HF)
    assert drop_answers([{**blank, "spans": ["Oak", "Elm"]}, {**blank, "number": "2"}]) == ("Oak", "Elm", "2")
    assert drop_answers([{**blank, "number": "7", "spans": ["Oak"]}]) is None  # mixed kinds: skipped
    assert drop_answers([blank]) is None and drop_answers([]) is None
    folder = write_qa_files(tmp_path, "DROP", train=2, test=1)
    data = load_qa(get_qa_task("drop"), str(folder))
    # train: `answer` only; validation: `validated_answers` (the question of mixed kinds skipped in both)
    assert [r.answers for r in data["train"][:4]] == [("12",), ("3 May 1850",), ("Oak",), ("Oak", "Elm")]
    assert len(data["train"]) == 2 * 4 and len(data["test"]) == 4
    assert [r.answers for r in data["test"]] == [("12", "green"), ("3 May 1850", "green"), ("Oak", "green"),
                                                 ("Oak", "Elm", "green")]
    assert data["train"][0].fields == {"context": "The river Oak 0 and the river Elm were built in 1850 .",
                                       "question": "What is the name of the river 0 ?"}


def test_draws_follow_mezos_sample_train_sets(tmp_path, opt_path):
    folder = write_qa_files(tmp_path, "SQuAD", train=6, test=4)  # 24 training questions, 16 test questions
    dm = QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, max_length=96, num_train=10, num_dev=5, num_test=7,
                      batch_size=2, data_seed=29)
    splits = dm.load_splits()
    data = load_qa(get_qa_task("squad"), str(folder))
    order = np.random.RandomState(29).permutation(24).tolist()  # MeZO: np.random.permutation under temp_seed
    assert splits.train.records == [data["train"][i] for i in order[:10]]
    assert splits.val.records == [data["train"][i] for i in order[10:15]]  # train_samples[-num_dev:]
    assert splits.test.records == [data["test"][i] for i in np.random.RandomState(29).permutation(16)[:7]]
    assert splits.train_groups == [r.fields["context"].strip() for r in splits.train.records]
    other = QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, num_train=10, num_dev=5, num_test=7, data_seed=29,
                         test_seed=0)
    assert other.load_splits().test.records == [data["test"][i] for i in np.random.RandomState(0).permutation(16)[:7]]


def test_a_row_is_the_prompt_then_the_first_gold_answer_and_a_newline(tmp_path, opt_path):
    write_qa_files(tmp_path, "SQuAD", train=3, test=2)
    dm = QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, max_length=96, num_train=6, num_dev=2, num_test=4,
                      batch_size=2)
    record = QARecord({"title": "River_0", "context": "The river 0 runs .", "question": " How many ? "},
                      ("seven", "seven bridges"))
    from datamodules.qa import QARecords

    row = dm.materialize(QARecords([record]))
    tok = dm.tokenizer
    ids, mask = row.inputs["input_ids"][0, 0], row.inputs["candidate_mask"][0, 0].bool()
    used = ids[row.inputs["attention_mask"][0, 0].bool()].tolist()
    prompt = "Title: River_0\nContext: The river 0 runs .\nQuestion: How many ?\nAnswer:"
    assert used == tok(prompt)["input_ids"] + tok(" seven\n", add_special_tokens=False)["input_ids"]
    assert used[0] == tok.bos_token_id  # (OPT's </s> first)
    assert tok.decode(ids[mask]) == " seven\n"
    assert row.targets.tolist() == [0]


def test_long_prompts_are_cut_from_the_left_keeping_the_first_token_and_the_whole_answer(tmp_path, opt_path):
    write_qa_files(tmp_path, "SQuAD", train=3, test=2)
    dm = QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, max_length=12, num_train=6, num_dev=2, batch_size=2)
    from datamodules.qa import QARecords

    record = QARecord({"title": "River_0", "context": "The river runs through the city " * 4, "question": "How ?"},
                      ("seven bridges",))
    row = dm.materialize(QARecords([record])).inputs
    tok = dm.tokenizer
    used = row["input_ids"][0, 0][row["attention_mask"][0, 0].bool()].tolist()
    answer = tok(" seven bridges\n", add_special_tokens=False)["input_ids"]
    full = tok(dm.task.spec.causal[0] + "River_0\nContext: " + "The river runs through the city " * 4
               + "\nQuestion: How ?\nAnswer:", add_special_tokens=False)["input_ids"]
    assert len(used) == 12 and used[0] == tok.bos_token_id and used[-len(answer):] == answer
    assert used[1:-len(answer)] == full[-(12 - 1 - len(answer)):]  # the prompt's tail, ending in "Answer:"


def test_evaluation_rows_carry_every_gold_answer_and_private_rows_do_not(tmp_path, opt_path):
    write_qa_files(tmp_path, "DROP", train=3, test=2)
    dm = QADataModule("DROP", str(tmp_path), tokenizer=opt_path, max_length=64, num_train=8, num_dev=2, num_test=5,
                      batch_size=2)
    dm.setup()
    assert ANSWER_IDS not in dm.private_dataset.inputs
    splits = dm.load_splits()
    for split, records in ((dm.test_dataset, splits.test.records), (dm.val_dataset, splits.val.records)):
        golds = split.inputs[ANSWER_IDS]
        assert golds.shape[:2] == (len(split), max(len(r.answers) for r in records))
        decoded = [[dm.tokenizer.decode([t for t in answer if t != NO_TOKEN]) for answer in example
                    if any(t != NO_TOKEN for t in answer)] for example in golds.tolist()]
        assert decoded == [list(r.answers) for r in records]
    batch, _ = next(iter(dm.test_dataloader()))
    assert batch[ANSWER_IDS].shape[1:] == dm.test_dataset.inputs[ANSWER_IDS].shape[1:]  # (not cut with the rows)


def test_passages_are_the_groups_so_hold_outs_take_whole_passages(tmp_path, opt_path):
    write_qa_files(tmp_path, "SQuAD", train=6, test=2)
    dm = QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, max_length=64, num_train=None, num_dev=None,
                      val_fraction=0.25, public_fraction=0.25, batch_size=2)
    dm.setup()
    splits = dm.load_splits()
    passage = [splits.train_groups[i] for i in range(len(splits.train))]
    private = {passage[i] for i in dm.private_indices}
    assert dm.val_indices and dm.public_indices
    assert private.isdisjoint(passage[i] for i in dm.val_indices)
    assert private.isdisjoint(passage[i] for i in dm.public_indices)


def test_bad_options_and_missing_files_end_in_one_line_naming_the_option(tmp_path, opt_path):
    with pytest.raises(ConfigError, match="`task`: unknown QA task 'squad2'"):
        QADataModule("squad2", str(tmp_path))
    with pytest.raises(ConfigError, match="`data_format` must be one of"):
        QADataModule("SQuAD", str(tmp_path), data_format="glue")
    with pytest.raises(ConfigError, match="num_train"):
        QADataModule("SQuAD", str(tmp_path), num_train=0)
    dm = QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path)
    with pytest.raises(ConfigError, match=r"`data.init_args.data_dir`: SQuAD: no train-v1.1.json \+ dev-v1.1.json"):
        dm.setup()
    (tmp_path / "squad").mkdir()
    (tmp_path / "squad" / "train-v1.1.json").write_text(json.dumps({"nodata": []}))
    (tmp_path / "squad" / "dev-v1.1.json").write_text(json.dumps({"nodata": []}))
    with pytest.raises(ValueError, match="expected the official JSON with a top-level 'data' list"):
        QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path).setup()


def test_a_private_answer_longer_than_max_length_is_cut_not_refused(tmp_path, opt_path):
    """The answer is a private row's text: a refusal ('a candidate does not fit') told that some private answer
    has max_length tokens or more. It keeps its first tokens, after the BOS and one prompt token."""
    from datamodules.qa import QARecords

    write_qa_files(tmp_path, "SQuAD", train=3, test=2)
    dm = QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, max_length=10, num_train=6, num_dev=2, batch_size=2)
    long = QARecord({"title": "River_0", "context": "The river", "question": "How ?"}, ("seven bridges " * 10,))
    short = QARecord({"title": "River_1", "context": "The river", "question": "How ?"}, ("seven",))
    rows = dm.materialize(QARecords([long, short])).inputs
    answer = dm.tokenizer(" " + "seven bridges " * 10 + "\n", add_special_tokens=False)["input_ids"]
    used = rows["input_ids"][0, 0][rows["attention_mask"][0, 0].bool()].tolist()
    assert used[0] == dm.tokenizer.bos_token_id and used[2:] == answer[:8]
    assert rows["candidate_mask"][0, 0].tolist() == [0, 0] + [1] * 8
    short_answer = dm.tokenizer(" seven\n", add_special_tokens=False)["input_ids"]
    assert rows["candidate_mask"][1, 0].sum().item() == len(short_answer)
    with pytest.raises(ValueError, match="max_length=2 leaves no room"):
        QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, max_length=2, num_train=6, num_dev=2,
                     batch_size=2).materialize(QARecords([short]))


def test_bos_token_id_starts_every_row_as_mezos_opt_tokenizer(tmp_path, opt_path):
    """MeZO and DPZero set ``tokenizer.bos_token_id = 0`` on OPT's slow tokenizer, whose rows then start with <s>
    (0) instead of </s> (2); ``bos_token_id: 0`` (the Table 5 configs) gives those rows, training and evaluation,
    and generation reads it as the prompt's first token."""
    from datamodules.qa import QARecords
    from lit_zodp.backbones.generation import HFAnswerGenerator

    write_qa_files(tmp_path, "SQuAD", train=3, test=2)
    plain = QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, max_length=64, num_train=6, num_dev=2,
                         num_test=2, batch_size=2)
    mezo = QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, max_length=64, num_train=6, num_dev=2,
                        num_test=2, batch_size=2, bos_token_id=0)
    records = QARecords(plain.load_splits().train.records[:3])
    before, after = plain.materialize(records).inputs, mezo.materialize(records).inputs
    assert (before["input_ids"][..., 0] == plain.tokenizer.bos_token_id).all() and plain.tokenizer.bos_token_id == 2
    assert (after["input_ids"][..., 0] == 0).all()
    assert torch.equal(after["input_ids"][..., 1:], before["input_ids"][..., 1:])
    mezo.setup()
    assert (mezo.test_dataset.inputs["input_ids"][..., 0] == 0).all()
    assert all(p[0] == 0 for p in HFAnswerGenerator(opt_path).prompts(mezo.test_dataset.inputs))
    for bad in (-1, "0", True):
        with pytest.raises(ConfigError, match="`bos_token_id` must be a token id"):
            QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, bos_token_id=bad)
    with pytest.raises(ConfigError, match="is not in the vocabulary"):
        QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, max_length=64, bos_token_id=10**6).materialize(records)


def test_bos_token_id_starts_every_causal_prompt_row_of_a_classification_task_too(tmp_path, opt_path):
    """Table 4 (OPT on SST-2/BoolQ) as MeZO ran it: every candidate row starts with <s> (0), the rest unchanged."""
    from datamodules import PromptTextDataModule
    from datamodules.testing import write_task_files

    write_task_files(tmp_path, "SST-2", "glue")
    options = dict(prompt="causal", tokenizer=opt_path, max_length=32, num_train=4, num_dev=2, batch_size=2)
    plain = PromptTextDataModule("SST-2", str(tmp_path), **options)
    mezo = PromptTextDataModule("SST-2", str(tmp_path), bos_token_id=0, **options)
    plain.setup(), mezo.setup()
    for split in ("private_dataset", "val_dataset", "test_dataset"):
        before, after = getattr(plain, split).inputs["input_ids"], getattr(mezo, split).inputs["input_ids"]
        assert (before[..., 0] == 2).all() and (after[..., 0] == 0).all()
        assert torch.equal(after[..., 1:], before[..., 1:])
    with pytest.raises(ConfigError, match="`bos_token_id` applies to prompt='causal' only"):
        PromptTextDataModule("SST-2", str(tmp_path), prompt="mlm", tokenizer=opt_path, bos_token_id=0)
    with pytest.raises(ConfigError, match="`bos_token_id` must be a token id"):
        PromptTextDataModule("SST-2", str(tmp_path), prompt="causal", tokenizer=opt_path, bos_token_id="0")


def test_no_validation_draw_warns_that_validation_runs_on_the_test_set(tmp_path, opt_path, recwarn):
    """num_dev: null and val_fraction 0: validation (and a `test_ckpt: best` selection) read the test set, which
    PromptTextDataModule warns about and QADataModule did in silence."""
    import warnings

    from lit_zodp.errors import LitZodpWarning

    write_qa_files(tmp_path, "SQuAD", train=3, test=2)

    def said(**options):
        dm = QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, max_length=64, num_train=6, batch_size=2,
                          **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dm.setup("fit")
            dm.setup("test")  # (said once)
        return dm, [str(w.message) for w in caught if issubclass(w.category, LitZodpWarning)
                    and "test set" in str(w.message)]

    dm, messages = said(num_dev=None)
    assert dm.val_dataset is dm.test_dataset
    assert messages == ["SQuAD: no validation split (num_dev null, val_fraction 0): validation runs on the test set; "
                        "set num_dev (MeZO: 500) or val_fraction"]
    assert said(num_dev=2)[1] == [] and said(num_dev=None, val_fraction=0.25)[1] == []


@pytest.mark.parametrize("module", ["qa", "prompt"])
def test_validation_on_the_test_set_is_said_on_rank_zero_only(tmp_path, opt_path, module):
    """Review 44: every DDP rank sets up, and the warning came once per rank (2 identical lines on 2 ranks)."""
    import warnings

    from dm_helpers import fake_trainer

    from datamodules import PromptTextDataModule
    from datamodules.testing import write_task_files
    from lit_zodp.errors import LitZodpWarning

    write_qa_files(tmp_path, "SQuAD", train=3, test=2)
    write_task_files(tmp_path, "SST-2", "glue", per_class=4)

    def said(rank):
        if module == "qa":
            dm = QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, max_length=64, num_train=6, num_dev=None,
                              batch_size=2)
        else:
            dm = PromptTextDataModule("SST-2", str(tmp_path), prompt="causal", tokenizer=opt_path, max_length=48,
                                      batch_size=2)
        dm.trainer = fake_trainer(rank, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dm.setup("fit")
        assert dm.val_dataset is dm.test_dataset
        return [str(w.message) for w in caught
                if issubclass(w.category, LitZodpWarning) and "test set" in str(w.message)]

    assert len(said(0)) == 1 and said(1) == []


@pytest.mark.parametrize("num_train,num_dev", [(1000, 3), (10, 2), (20, None)])
def test_a_short_qa_split_draws_as_mezo_and_says_the_same_whatever_one_private_rows_text_is(tmp_path, opt_path,
                                                                                           num_train, num_dev):
    """Review 44: MeZO keeps num_dev for dev when the split is short (dev: the permutation's last num_dev); with
    ``dedupe`` the warning named, and fired on, the examples left once repeats were dropped (one private question
    repeating another changed what setup printed). It names the split's size now."""
    import warnings

    folder = write_qa_files(tmp_path, "SQuAD", train=3, test=2)  # 3 articles x 2 passages x 2 questions: 12
    path = folder / "train-v1.1.json"
    data = json.loads(path.read_text())
    outputs = []
    for repeat in (True, False):
        changed = json.loads(json.dumps(data))
        qas = changed["data"][1]["paragraphs"][0]["qas"]
        qas[1]["question"] = qas[0]["question"] if repeat else "a question found nowhere else"
        path.write_text(json.dumps(changed))
        dm = QADataModule("SQuAD", str(tmp_path), tokenizer=opt_path, max_length=64, num_train=num_train,
                          num_dev=num_dev, batch_size=2, dedupe=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dm.setup("fit")
        outputs.append([str(w.message) for w in caught if "holds" in str(w.message)])
        if not repeat and num_dev == 3:  # 12 examples: MeZO's 1003 are all of them, dev the last 3
            assert (len(dm.pool_dataset), len(dm.val_dataset)) == (9, 3)
    assert outputs[0] == outputs[1]
    assert (outputs[0] == []) if (num_train, num_dev) == (10, 2) else ("12 examples" in outputs[0][0])
