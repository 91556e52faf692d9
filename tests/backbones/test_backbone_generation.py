"""HFAnswerGenerator: the per-example answer NLL that trains, greedy generation and SQuAD's F1 that evaluate."""

import pytest
import torch
import torch.nn.functional as F

from datamodules.qa import QADataModule, QARecord, QARecords, answer_token_ids
from datamodules.testing import QA_WORDS, write_qa_files
from lit_zodp.backbones.generation import (ANSWER_IDS, HFAnswerGenerator, answer_exact_match, answer_f1,
                                           normalize_answer, token_f1)
from lit_zodp.backbones.tiny_hf import save_tiny_pretrained
from lit_zodp.errors import ConfigError


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    path = save_tiny_pretrained(root / "opt", "opt", vocab_texts=[QA_WORDS])
    write_qa_files(root, "SQuAD", train=3, test=2)
    dm = QADataModule("SQuAD", str(root), tokenizer=path, max_length=64, num_train=6, num_dev=2, num_test=4,
                      batch_size=2)
    return path, dm


def records(n):
    """Questions of different prompt lengths (left padding in generation is exercised)."""
    return [QARecord({"title": f"River_{i}", "context": "The river runs through the city . " * (1 + 2 * i),
                      "question": "How many bridges are there ?"}, ("seven", "seven bridges")) for i in range(n)]


def test_squads_normalization_f1_and_exact_match():
    assert normalize_answer("  The Blue,  sky!  ") == "blue sky"
    assert normalize_answer("an apple a day") == "apple day"
    assert token_f1("the Blue sky!", "blue sky") == 1.0
    assert token_f1("blue", "blue sky") == pytest.approx(2 / 3)  # precision 1, recall 1/2
    assert token_f1("blue blue", "blue") == pytest.approx(2 / 3)  # a bag: one shared "blue"
    assert token_f1("red", "blue sky") == 0.0 and token_f1("", "blue") == 0.0 and token_f1("the", "a") == 0.0
    assert answer_f1("blue", ["green", "blue sky", "blue"]) == 1.0 and answer_f1("blue", []) == 0.0
    assert answer_exact_match("The blue.", ["blue", "sky"]) == 1.0 and answer_exact_match("blue sky", ["blue"]) == 0.0


def test_the_per_example_loss_is_the_mean_nll_of_each_answers_tokens(world):
    path, dm = world
    model = HFAnswerGenerator(path, dtype="float64").eval()  # (no dropout: the zeroth-order forwards run in eval mode)
    rows = dm.materialize(QARecords(records(3))).inputs
    losses = model.per_example_loss(rows, torch.zeros(3, dtype=torch.long))
    for i in range(3):
        used = rows["attention_mask"][i, 0].bool()
        ids, answer = rows["input_ids"][i, 0][used], rows["candidate_mask"][i, 0][used].bool()
        log_probs = F.log_softmax(model.model(input_ids=ids[None]).logits[0, :-1].double(), -1)
        token_nll = -log_probs.gather(1, ids[1:, None])[:, 0]  # position t predicts token t + 1
        assert losses[i].item() == pytest.approx(token_nll[answer[1:]].mean().item(), rel=1e-9)


def greedy_reference(model, prompt, max_new_tokens, stops):
    """Token by token argmax over the unpadded prompt, stopping at a stop token, in eval mode as generation (in
    training mode dropout drew other tokens: the comparison passed only while both decoded to the same U+FFFD)."""
    ids = list(prompt)
    was_training = model.model.training
    model.model.eval()
    for _ in range(max_new_tokens):
        with torch.no_grad():
            token = int(model.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        if token in stops:
            break
        ids.append(token)
    model.model.train(was_training)
    return model.decode_answer(ids[len(prompt):])


def test_greedy_answers_equal_an_argmax_loop_over_each_unpadded_prompt(world):
    path, dm = world
    model = HFAnswerGenerator(path, max_new_tokens=6, dtype="float64", generation_batch_size=2)
    rows = dm.materialize(QARecords(records(3))).inputs
    prompts = model.prompts(rows)
    tok = dm.tokenizer
    assert tok.decode(prompts[0]).endswith("Question: How many bridges are there ?\nAnswer:")
    assert len({len(p) for p in prompts}) == 3
    stops = model.stop_token_ids()
    assert stops == [tok.eos_token_id, tok("\n", add_special_tokens=False)["input_ids"][-1]]
    assert model.generate_answers(rows) == [greedy_reference(model, p, 6, stops) for p in prompts]
    assert model.model.training  # (generation runs in eval mode and restores the mode)


def test_a_prompt_longer_than_the_positions_allow_is_cut_from_the_left_for_generation(world, monkeypatch):
    path, dm = world
    model = HFAnswerGenerator(path, max_new_tokens=50)
    room = model.model.config.max_position_embeddings  # 128 for the tiny OPT
    seen = {}

    def generate(input_ids, attention_mask, **kwargs):
        seen["ids"], seen["mask"] = input_ids, attention_mask
        return torch.cat([input_ids, torch.full((len(input_ids), 1), 2)], 1)

    monkeypatch.setattr(model.model, "generate", generate)
    long = [2] + list(range(10, 110))  # 101 tokens: BOS + 100
    model._generate([long, [2, 7, 8]])
    kept = seen["ids"][0][seen["mask"][0].bool()].tolist()
    assert len(kept) == room - 50 and kept == [2] + long[-(room - 50 - 1):]
    assert seen["ids"][1][seen["mask"][1].bool()].tolist() == [2, 7, 8]  # left-padded to the longest


def test_evaluation_scores_the_generated_answers_against_every_gold(world):
    path, dm = world
    model = HFAnswerGenerator(path, max_new_tokens=4).eval()  # (Lightning evaluates in eval mode)
    examples = records(4)
    rows = dm.materialize(QARecords(examples)).inputs
    predicted = model.generate_answers(rows)
    assert all(predicted)  # (the tiny model answers something: the test below needs non-empty predictions)
    answers = [(predicted[0], "unrelated"), ("unrelated",), (predicted[2] + " unrelated",), ("x", predicted[3])]
    golds = [QARecord(example.fields, gold) for example, gold in zip(examples, answers)]
    inputs = {**rows, ANSWER_IDS: answer_token_ids(dm.tokenizer, golds)}
    metrics = model.evaluation_metrics()
    model.update_evaluation(metrics, inputs, torch.zeros(4, dtype=torch.long))
    f1 = [answer_f1(p, g.answers) for p, g in zip(predicted, golds)]
    assert f1[0] == f1[3] == 1.0 and 0 < f1[2] < 1
    assert metrics["f1"].compute().item() == pytest.approx(sum(f1) / 4)
    assert metrics["em"].compute().item() == pytest.approx(sum(answer_exact_match(p, g.answers)
                                                               for p, g in zip(predicted, golds)) / 4)
    loss = model.per_example_loss(rows, torch.zeros(4, dtype=torch.long)).double().mean()
    assert metrics["loss"].compute().item() == pytest.approx(loss.item())


def test_fixed_and_invalid_options_are_refused_in_one_line(world):
    path, _ = world
    with pytest.raises(ConfigError, match="`loss` is fixed for HFAnswerGenerator"):
        HFAnswerGenerator(path, loss="classification")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        HFAnswerGenerator(path, max_new_tokens=0)
    model = HFAnswerGenerator(path)
    with pytest.raises(ValueError, match="evaluation batches need `answer_ids`"):
        model.update_evaluation(model.evaluation_metrics(), {"input_ids": torch.zeros(1, 1, 3)}, torch.zeros(1))


def test_backbones_that_cannot_answer_are_refused_in_one_line_before_the_first_step(world):
    """A masked LM is refused before its weights load; a library backbone other than HFAnswerGenerator with
    QADataModule, and HFAnswerGenerator with PromptTextDataModule, are named at the data module's setup (before,
    a masked LM failed at the first validation, a candidate scorer with a traceback of the accuracy metric)."""
    from types import SimpleNamespace

    from datamodules.prompt_text import PromptTextDataModule, backbone_mismatch
    from datamodules.qa import qa_backbone_mismatch
    from lit_zodp.backbones import HFCandidateScorer, tiny_bert_config

    path, dm = world
    with pytest.raises(ConfigError, match=r"^HFAnswerGenerator `model_name_or_path`: .* is a masked LM"):
        HFAnswerGenerator(config=tiny_bert_config())
    generator, scorer = HFAnswerGenerator(path), HFCandidateScorer(path, loss="lm")
    assert qa_backbone_mismatch(dm, generator) is None and qa_backbone_mismatch(dm, torch.nn.Linear(2, 2)) is None
    message = qa_backbone_mismatch(dm, scorer)
    assert "HFCandidateScorer does not do" in message and "HFAnswerGenerator" in message and "\n" not in message
    fresh = QADataModule("SQuAD", dm.data_dir, tokenizer=path, max_length=64, num_train=6, num_dev=2, batch_size=2)
    fresh.trainer = SimpleNamespace(lightning_module=SimpleNamespace(backbone=scorer))
    with pytest.raises(ConfigError, match="^Model/data mismatch: QADataModule gives SQuAD questions"):
        fresh.setup("fit")
    sst2 = PromptTextDataModule("SST-2", dm.data_dir, prompt="causal")
    assert "HFAnswerGenerator generates answers" in backbone_mismatch(sst2, generator)
    assert backbone_mismatch(sst2, scorer) is None


def test_f1_scores_an_unanswerable_first_gold_by_exact_match_as_mezo():
    """MeZO's metrics.py: a first gold 'CANNOTANSWER' or 'no answer' is matched exactly (token F1 gave 'no' 2/3)."""
    assert answer_f1("no", ["no answer"]) == 0.0 and answer_f1("No answer.", ["no answer", "x"]) == 1.0
    assert answer_f1("cannot", ["CANNOTANSWER"]) == 0.0 and answer_f1("CANNOTANSWER", ["CANNOTANSWER"]) == 1.0
    assert answer_f1("no", ["blue", "no answer"]) == pytest.approx(2 / 3)  # (only the first gold is a mark)


def test_answers_are_decoded_as_mezos_transformers_and_golds_as_written(world, monkeypatch):
    """Predictions: MeZO's Transformers 4.28 decoded with its tokenization-space clean-up (" 's" -> "'s", which
    normalizes to "s" joined to the word); gold answers: their text exactly, even under a tokenizer that cleans up."""
    path, dm = world
    model = HFAnswerGenerator(path, max_new_tokens=8).eval()
    tok = model.tokenizer
    said = tok("Oak 's city , do n't", add_special_tokens=False)["input_ids"]
    rows = dm.materialize(QARecords(records(1))).inputs
    width = model.prompts(rows)[0]
    monkeypatch.setattr(model.model, "generate", lambda input_ids, **kw: torch.cat(
        [input_ids, torch.tensor([said + [tok.eos_token_id]])], 1))
    assert model.generate_answers(rows) == ["Oak's city, don't"] and width
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True, raising=False)
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", True,
                        raising=False)
    golds = answer_token_ids(tok, [QARecord(records(1)[0].fields, ("Oak 's city", "do n't"))])
    assert model.gold_answers(golds) == [["Oak 's city", "do n't"]]


def test_max_new_tokens_must_leave_the_prompt_a_token_in_the_models_positions(world):
    """A prompt is cut to the positions less max_new_tokens (its BOS kept); max_new_tokens >= positions - 1 left it
    BOS alone (or nothing) and generated past the positions: F1 of answers to no question, silently."""
    path, _ = world
    room = HFAnswerGenerator(path, max_new_tokens=126)._max_positions()
    assert room == 128  # (the tiny OPT)
    for too_many in (127, 128, 500):
        with pytest.raises(ConfigError, match=r"^HFAnswerGenerator `max_new_tokens`: 1?\d\d\d? leaves no prompt token"):
            HFAnswerGenerator(path, max_new_tokens=too_many)


def test_a_qa_fit_tests_its_best_val_loss_checkpoint_and_reloads_without_its_tokenizer(world, tmp_path, monkeypatch,
                                                                                     spend_log_per_test):
    """Table 5's shape end to end, small: a DPZero fit of HFAnswerGenerator on QADataModule validates every 2 steps,
    tests the lowest val_loss checkpoint (`test_ckpt: best`); `lightning test --ckpt_path` of that checkpoint logs the
    same test metrics; the checkpoint holds no tokenizer (loaded on first use only) and `load_from_checkpoint` with
    the backbone restores every weight."""
    import pickle

    import yaml

    from lit_zodp.algorithms import DPZero
    from lit_zodp.cli import build_cli

    path, dm = world
    monkeypatch.chdir(tmp_path)
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 4, "val_check_interval": 2,
                    "check_val_every_n_epoch": None, "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False,
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": str(tmp_path / "ckpt"), "monitor": "val_loss",
                                                 "save_last": True}}]},
        "model": {"class_path": "lit_zodp.algorithms.DPZero", "init_args": {
            "backbone": {"class_path": "lit_zodp.backbones.HFAnswerGenerator",
                         "init_args": {"model_name_or_path": path, "max_new_tokens": 3}},
            "lr": 1e-2, "clip": 1.0, "noise_multiplier": 1.0, "seed": 7}},
        "data": {"class_path": "datamodules.QADataModule", "init_args": {
            "task": "SQuAD", "data_dir": dm.data_dir, "tokenizer": path, "max_length": 64, "num_train": 6,
            "num_dev": 2, "num_test": 4, "bos_token_id": 0, "batch_size": 3, "eval_batch_size": 2}},
        "test_ckpt": "best",
    }
    (tmp_path / "qa.yaml").write_text(yaml.safe_dump(config))
    fitted = build_cli(["fit", "--config", str(tmp_path / "qa.yaml")])
    best = fitted.trainer.checkpoint_callback.best_model_path
    assert best and fitted.trainer.global_step == 4
    metrics = {k: float(v) for k, v in fitted.trainer.callback_metrics.items() if k.startswith("test_")}
    assert set(metrics) == {"test_loss", "test_f1", "test_em"}
    checkpoint = torch.load(best, weights_only=False, map_location="cpu")
    assert b"Tokenizer" not in pickle.dumps(checkpoint) and fitted.model.backbone._tokenizer is not None
    config.pop("test_ckpt")
    (tmp_path / "qa-test.yaml").write_text(yaml.safe_dump(config))
    tested = build_cli(["test", "--config", str(tmp_path / "qa-test.yaml"), "--ckpt_path", best])
    assert {k: float(v) for k, v in tested.trainer.callback_metrics.items()} == pytest.approx(metrics, rel=1e-9)
    loaded = DPZero.load_from_checkpoint(best, backbone=HFAnswerGenerator(path, max_new_tokens=3))
    assert loaded.backbone._tokenizer is None
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_a_max_length_beyond_the_models_positions_is_refused_at_setup_before_any_row_is_read(world):
    """max_length above the model's positions: a row longer than them ended the fit with an index error in the
    forward only when a private row that long was sampled (a crash whose step told that such a row exists)."""
    from types import SimpleNamespace

    from datamodules.qa import qa_backbone_mismatch

    path, dm = world
    generator = HFAnswerGenerator(path, max_new_tokens=4)
    assert qa_backbone_mismatch(dm, generator) is None  # max_length 64 of 128 positions
    long = QADataModule("SQuAD", "/nonexistent", tokenizer=path, max_length=129, num_train=6, num_dev=2, batch_size=2)
    long.trainer = SimpleNamespace(lightning_module=SimpleNamespace(backbone=generator))
    with pytest.raises(ConfigError, match=r"^`data.init_args.max_length`: 129 is more than the 128 positions of the "
                                          r"backbone's model"):
        long.setup("fit")
    long.max_length = 128
    assert qa_backbone_mismatch(long, generator) is None


@pytest.mark.parametrize("grad_mode", ["hooks", "ghost", "bookkeeping"])
def test_a_first_order_private_step_clips_each_examples_answer_gradient_as_one_backward_per_example(world, grad_mode):
    """The LM loss forwards one row per example (the answer's), so the per-example engine attributes it as any single
    row model: DP-Adam's clipped sum equals one backward per example, flat-clipped (DP-GRAPE Table 12 trains so)."""
    from lit_zodp.algorithms import DPAdam

    path, dm = world
    clip = 0.05
    module = DPAdam(HFAnswerGenerator(path, dtype="float64"), lr=1e-3, clip=clip, noise_multiplier=0.0, seed=0,
                    grad_mode=grad_mode)
    module.backbone.eval()  # (no dropout: the reference must draw the same forward)
    rows = dm.materialize(QARecords(records(4))).inputs
    targets = torch.zeros(4, dtype=torch.long)
    clipped = module.private_gradient(rows, targets)
    reference = HFAnswerGenerator(path, dtype="float64")
    reference.load_state_dict(module.backbone.state_dict())
    reference.eval()
    params = [p for p in reference.parameters() if p.requires_grad]
    total, norms = [torch.zeros_like(p) for p in params], []
    for i in range(4):
        one = {key: value[i:i + 1] for key, value in rows.items()}
        grads = torch.autograd.grad(reference.per_example_loss(one, targets[:1]).sum(), params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
        norms.append(torch.sqrt(sum(g.pow(2).sum() for g in grads)).item())
        factor = min(1.0, clip / norms[-1])
        total = [t + factor * g for t, g in zip(total, grads)]
    assert min(norms) > clip  # every example is clipped: a misattributed row would show
    for got, want in zip(clipped.grads, total):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(clipped.norms.double(), torch.tensor(norms, dtype=torch.float64), rtol=1e-6, atol=0)


ANSWERS = ("seven", "twelve old stone bridges", "blue green", "The river of Oak and Elm town")


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("grad_mode", ["hooks", "ghost", "bookkeeping"])
def test_answers_of_different_token_counts_clip_as_one_backward_per_example(world, grad_mode, training):
    """A Poisson batch of answers of different lengths (DROP's): the LM head (OPT's, tied to the input embeddings)
    ran on the candidate states of all rows gathered into ``[N, H]``, which is row-first only when every answer has
    the same token count, so the engine found no rule for the tied weight and failed its coverage check (DP-GRAPE
    Table 12's DP-Adam DROP config, at random). The head now runs row-first; the clipped sum and norms equal one
    backward per example in float64, in each mode, batch sizes 1 to 4 (training mode: the secret dropout is
    replayed by the engine; the reference then runs without dropout, so only the sum's coverage is asserted)."""
    from lit_zodp.algorithms import DPAdam

    path, dm = world
    clip = 0.05
    qa = [QARecord({"title": f"River_{i}", "context": "The river runs through the city . " * (1 + 2 * i),
                    "question": "What is the name of the river ?"}, (answer,)) for i, answer in enumerate(ANSWERS)]
    all_rows = dm.materialize(QARecords(qa)).inputs
    counts = all_rows["candidate_mask"][:, 0].sum(1).tolist()
    assert len(set(counts)) == len(ANSWERS)  # every answer a different token count
    for size in (1, 2, 3, 4):
        rows = {key: value[:size] for key, value in all_rows.items()}
        targets = torch.zeros(size, dtype=torch.long)
        module = DPAdam(HFAnswerGenerator(path, dtype="float64"), lr=1e-3, clip=clip, noise_multiplier=0.0, seed=0,
                        grad_mode=grad_mode)
        module.backbone.train(training)
        clipped = module.private_gradient(rows, targets)  # (refused before: no rule for the tied embedding)
        if training:
            continue
        reference = HFAnswerGenerator(path, dtype="float64")
        reference.load_state_dict(module.backbone.state_dict())
        reference.eval()
        params = [p for p in reference.parameters() if p.requires_grad]
        total, norms = [torch.zeros_like(p) for p in params], []
        for i in range(size):
            one = {key: value[i:i + 1] for key, value in rows.items()}
            grads = torch.autograd.grad(reference.per_example_loss(one, targets[:1]).sum(), params, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
            norms.append(torch.sqrt(sum(g.pow(2).sum() for g in grads)).item())
            total = [t + min(1.0, clip / norms[-1]) * g for t, g in zip(total, grads)]
        assert min(norms) > clip
        for got, want in zip(clipped.grads, total):
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(clipped.norms.double(), torch.tensor(norms, dtype=torch.float64), rtol=1e-6, atol=0)


def test_answer_scores_of_different_token_counts_do_not_depend_on_batch_mates(world):
    """Row-first head calls (row i: example i's answer states), and each example's loss in a batch of answers of
    different lengths equals its loss alone."""
    path, dm = world
    model = HFAnswerGenerator(path, dtype="float64").eval()
    qa = [QARecord({"title": "River", "context": "The river runs through the city . ",
                    "question": "What is the name of the river ?"}, (answer,)) for answer in ANSWERS]
    rows = dm.materialize(QARecords(qa)).inputs
    targets = torch.zeros(len(ANSWERS), dtype=torch.long)
    seen = []
    handle = model.model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    try:
        together = model.per_example_loss(rows, targets)
    finally:
        handle.remove()
    assert seen and all(shape[0] == len(ANSWERS) for shape in seen)  # every head call row-first
    alone = torch.cat([model.per_example_loss({k: v[i:i + 1] for k, v in rows.items()}, targets[:1])
                       for i in range(len(ANSWERS))])
    torch.testing.assert_close(together, alone, rtol=1e-12, atol=0)


def test_classification_over_candidate_rows_stays_refused_for_first_order_private_training(world):
    from lit_zodp.algorithms import DPGRAPE
    from lit_zodp.backbones import HFCandidateScorer
    from lit_zodp.errors import PrivacyConfigError

    path, _ = world
    with pytest.raises(PrivacyConfigError, match="several rows per example.*loss: lm"):
        DPGRAPE(HFCandidateScorer(path, num_classes=2), lr=1e-3, clip=1.0, noise_multiplier=1.0)
    assert not HFCandidateScorer(path, loss="lm").several_rows_per_example


@pytest.mark.parametrize("split", ["max_rows_per_forward", "fixed_forward_rows"])
def test_a_candidate_scorer_splitting_its_rows_is_refused_for_first_order_private_training(world, split):
    """Calls without one row per example: the engine could not form the per-example gradients, and the step failed at
    the first Poisson batch larger than the split (so the failure followed the private batch sizes)."""
    from lit_zodp.algorithms import DPAdam
    from lit_zodp.errors import PrivacyConfigError

    path, _ = world
    backbone = HFAnswerGenerator(path, **({"max_rows_per_forward": 2} if split == "max_rows_per_forward" else {}))
    extra = {"fixed_forward_rows": 4} if split == "fixed_forward_rows" else {}
    with pytest.raises(PrivacyConfigError, match=split):
        DPAdam(backbone, lr=1e-3, clip=1.0, noise_multiplier=1.0, **extra)
