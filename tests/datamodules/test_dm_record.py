"""ReCoRD (SuperGLUE) as MeZO runs it: reading, flattening, MeZO's template, candidates that vary in number, gold
sets, and the accuracy that counts any gold answer."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch

from datamodules import PromptTextDataModule, get_task, load_task
from datamodules.prompt_text import encode_causal, prepare_tokenizer
from datamodules.testing import build_tiny_bpe_tokenizer, record_object, write_task_files
from datamodules.text_tasks import render_text
from lit_zodp.algorithms.base import credited_targets
from lit_zodp.errors import ConfigError, PrivacyConfigError

SPEC = get_task("ReCoRD")

#: one SuperGLUE ReCoRD line in its real nested layout (inclusive entity ends, answers as spans with their text)
PASSAGE = "(CNN) Alice met Bob in Paris. Alice smiled.\n@highlight\nBob flew home\n@highlight\nParis was sunny"


def span(name, nth=0, text=PASSAGE):
    """The ``nth`` mention of ``name``: ``{start, end}`` with SuperGLUE's inclusive end."""
    start = -1
    for _ in range(nth + 1):
        start = text.index(name, start + 1)
    return {"start": start, "end": start + len(name) - 1}


RAW = {
    "source": "Daily mail",
    "passage": {"text": PASSAGE,
                "entities": [span("Alice"), span("Bob"), span("Paris"), span("Alice", 1), span("Bob", 1),
                             span("Paris", 1)]},
    "qas": [
        {"query": "@placeholder was happy in the city .", "idx": 0,
         "answers": [{**span("Alice"), "text": "Alice"}, {**span("Alice", 1), "text": "Alice"}]},
        {"query": "The trip of @placeholder ended ", "idx": 1,
         "answers": [{**span("Bob"), "text": "Bob"}, {**span("Paris"), "text": "Paris"}]},
        {"query": "Nobody knows @placeholder", "idx": 2},  # a hidden answer (SuperGLUE's test file): dropped
    ],
    "idx": 7,
}


@pytest.fixture(scope="module")
def opt_tokenizer(tmp_path_factory):
    from lit_zodp.backbones.huggingface import load_tokenizer

    path = build_tiny_bpe_tokenizer(tmp_path_factory.mktemp("tok") / "opt", "opt", texts=[PASSAGE])
    return path, prepare_tokenizer(load_tokenizer(path))


def write_record(folder, train_objects, val_objects):
    folder.mkdir(parents=True, exist_ok=True)
    for name, objects in (("train", train_objects), ("val", val_objects)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(o) + "\n" for o in objects))
    return folder


def test_a_superglue_record_line_flattens_to_one_example_per_answered_query(tmp_path):
    folder = write_record(tmp_path / "ReCoRD", [RAW], [RAW])
    data = load_task("ReCoRD", tmp_path, "auto")
    assert data.data_format == "superglue" and str(data.task_dir) == str(folder)
    assert len(data.train) == 2  # the unanswered query is no example
    first, second = data.train.records
    # entities: the distinct texts of the spans (ends inclusive), sorted, as Hugging Face's super_glue record
    assert json.loads(first["entities"]) == ["Alice", "Bob", "Paris"]
    assert first["passage"] == PASSAGE and first["query"] == "@placeholder was happy in the city ."
    assert json.loads(first["answers"]) == ["Alice"] and json.loads(second["answers"]) == ["Bob", "Paris"]
    assert data.train.labels == [0, 1]  # the first answer's entity: the candidate MeZO trains on
    # Hugging Face's flat layout (one row per query, texts) reads to the same records
    flat = {"passage": PASSAGE, "query": "The trip of @placeholder ended ", "entities": ["Paris", "Bob", "Alice"],
            "answers": ["Paris", "Bob"], "idx": {"passage": 7, "query": 1}}
    write_record(tmp_path / "hf" / "ReCoRD", [flat], [flat])
    hf = load_task("ReCoRD", tmp_path / "hf", "superglue")
    assert hf.train.records == [second] and hf.train.labels == [1]


def test_write_task_files_writes_real_record_lines_with_varying_entities(tmp_path):
    folder = write_task_files(tmp_path, "ReCoRD", "superglue", per_class=4, eval_per_class=2)
    lines = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    assert lines[0] == record_object(0)
    for line in lines:  # the spans' texts are what the answers say
        text = line["passage"]["text"]
        for qa in line["qas"]:
            assert all(text[a["start"] : a["end"] + 1] == a["text"] for a in qa["answers"])
    data = load_task("ReCoRD", tmp_path, "superglue")
    counts = [len(json.loads(r["entities"])) for r in data.train.records]
    assert counts == [2, 2, 3, 3, 4, 4, 5, 5] and len(data.test) == 4
    golds = [len(SPEC.varying_candidates(r)[1]) for r in data.train.records]
    assert golds == [1, 1, 1, 1, 1, 2, 1, 1]  # passage 2's second query has two gold entities


def test_prompt_and_candidates_are_mezos_byte_for_byte():
    """ReCoRDTemplateGPT3: encode(sample) = f"{passage}\\n-" with "@highlight\\n" -> "- "; verbalize(sample, c) =
    f"{passage}\\n- {query}" with @placeholder -> c; both .strip(' '). The candidate is what verbalize adds."""
    record = {"passage": PASSAGE, "query": "The trip of @placeholder ended ",
              "entities": json.dumps(["Alice", "Bob", "Paris"]), "answers": json.dumps(["Bob", "Paris"])}
    prompt = "(CNN) Alice met Bob in Paris. Alice smiled.\n- Bob flew home\n- Paris was sunny\n-"
    assert render_text(SPEC.causal, record) == prompt
    candidates, golds = SPEC.varying_candidates(record)
    assert candidates == [" The trip of Alice ended", " The trip of Bob ended", " The trip of Paris ended"]
    assert golds == [1, 2]
    # the full texts MeZO tokenizes
    verbalized = [prompt + c for c in candidates]
    assert verbalized[1] == ("(CNN) Alice met Bob in Paris. Alice smiled.\n- Bob flew home\n- Paris was sunny\n"
                             "- The trip of Bob ended")


def test_encode_pads_each_example_to_k_with_absent_rows_and_marks_its_golds(opt_tokenizer):
    _, tokenizer = opt_tokenizer
    data_objects = [record_object(i) for i in (0, 2, 3)]  # 2, 4 and 5 entities
    records = [r for o in data_objects for r in SPEC.flatten(o)]
    out = encode_causal(tokenizer, SPEC, records, 128)
    assert set(out) == {"input_ids", "attention_mask", "candidate_mask", "gold_mask"}
    assert out["input_ids"].shape == (6, 5, 128) and out["gold_mask"].shape == (6, 5)
    for i, record in enumerate(records):
        candidates, golds = SPEC.varying_candidates(record)
        for j in range(5):
            ids, att, cm = (out[key][i, j] for key in ("input_ids", "attention_mask", "candidate_mask"))
            if j >= len(candidates):  # absent: nothing attended to, no candidate token, pad ids
                assert not att.any() and not cm.any() and bool((ids == tokenizer.pad_token_id).all())
                continue
            assert tokenizer.decode(ids[cm.bool()]) == candidates[j]
            joint = tokenizer(render_text(SPEC.causal, record) + candidates[j])["input_ids"]
            assert ids[att.bool()].tolist() == joint  # MeZO's joint encoding of verbalize(sample, candidate)
        assert out["gold_mask"][i].nonzero().flatten().tolist() == golds
    assert out["gold_mask"][3].tolist() == [0, 1, 1, 0, 0]  # two golds: Bob and London (of Alice, Bob, London, Paris)
    wider = encode_causal(tokenizer, SPEC, records[:2], 128, num_candidates=5)
    assert wider["input_ids"].shape == (2, 5, 128) and torch.equal(wider["input_ids"], out["input_ids"][:2])
    with pytest.raises(ValueError, match="smaller than an example's number of candidates$"):
        encode_causal(tokenizer, SPEC, records, 128, num_candidates=3)


def make_dm(root, tokenizer, **kwargs):
    args = dict(data_format="superglue", prompt="causal", tokenizer=tokenizer, max_length=96, batch_size=4,
                sampling_seed=0, num_train=8, num_dev=2, num_test=4, data_seed=0)
    return PromptTextDataModule("ReCoRD", str(root), **{**args, **kwargs})


def test_every_split_is_padded_to_the_most_candidates_of_any_example(tmp_path, opt_tokenizer):
    path, _ = opt_tokenizer
    write_task_files(tmp_path, "ReCoRD", "superglue", per_class=6, eval_per_class=3)
    dm = make_dm(tmp_path, path)
    assert dm.known_num_classes is None and dm.candidates is None and dm.labels == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup()
    assert dm.num_classes == dm.num_candidates == 5
    for dataset in (dm.private_dataset, dm.val_dataset, dm.test_dataset):
        inputs, targets = dataset.tensors if hasattr(dataset, "tensors") else next(iter(
            torch.utils.data.DataLoader(dataset, batch_size=len(dataset))))
        assert inputs["input_ids"].shape[1] == 5 and inputs["gold_mask"].shape == (len(targets), 5)
        assert bool(inputs["gold_mask"][torch.arange(len(targets)), targets].all())  # the target is a gold
    batch, targets = next(b for b in dm.train_dataloader() if len(b[1]))
    assert batch["gold_mask"].shape == (len(targets), 5)


def test_no_class_draws_and_no_given_num_classes(tmp_path, opt_tokenizer):
    path, _ = opt_tokenizer
    write_task_files(tmp_path, "ReCoRD", "superglue")
    with pytest.raises(PrivacyConfigError, match="ReCoRD has no classes to draw k examples of"):
        make_dm(tmp_path, path, num_train=None, num_dev=None, k_shot=2)
    # a model's num_classes would be compared with (and a mismatch would print) K, a function of the private data
    dm = make_dm(tmp_path, path)
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(num_classes=5, backbone=None))
    with pytest.raises(ConfigError, match="^ReCoRD's examples have varying numbers of candidates: leave the model's"):
        dm.setup()
    assert not dm._ready


def test_the_number_of_entities_of_a_private_example_changes_no_message(tmp_path, opt_tokenizer):
    """Two data sets that differ only in the entities of one training passage: the same warnings, word for word."""
    path, _ = opt_tokenizer
    messages = []
    for extra in (0, 40):
        objects = [record_object(i) for i in range(6)]
        text = objects[3]["passage"]["text"] + "".join(f" Z{n:02d}." for n in range(extra))
        objects[3]["passage"]["text"] = text  # passage 3 (5 entities) gains `extra` more
        objects[3]["passage"]["entities"] += [span(f"Z{n:02d}", text=text) for n in range(extra)]
        folder = write_record(tmp_path / str(extra) / "ReCoRD", objects, [record_object(100 + i) for i in range(3)])
        dm = make_dm(folder.parent, path, num_train=10, num_dev=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dm.setup()
        messages.append([str(w.message) for w in caught])
        assert dm.num_classes == 5 + extra
    assert messages[0] == messages[1]


def test_accuracy_counts_any_gold_candidate():
    logits = torch.tensor([[0.1, 0.9, float("-inf")], [0.8, 0.1, 0.3], [0.2, 0.1, 0.7]])
    targets = torch.tensor([0, 2, 1])  # each example's first gold
    gold = torch.tensor([[1, 1, 0], [0, 0, 1], [0, 1, 1]])  # examples 0 and 2 predict their second gold
    credited = credited_targets(logits, targets, {"gold_mask": gold})
    assert credited.tolist() == [1, 2, 2]
    assert (logits.argmax(1) == credited).tolist() == [True, False, True]
    assert credited_targets(logits, targets, {"input_ids": torch.zeros(3, 3, 2)}) is targets  # other tasks: as is
