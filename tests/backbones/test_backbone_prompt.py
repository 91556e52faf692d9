"""Prompt-based backbones as MeZO / DPZero run them: causal-LM candidate scoring, masked-LM label words
at the mask, and the tiny RoBERTa / OPT / BERT checkpoints saved to disk and loaded like hub models."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lit_zodp.backbones import HFCandidateScorer, HFPromptClassifier
from lit_zodp.backbones.tiny_hf import LABEL_WORDS, save_tiny_pretrained
from lit_zodp.zo import PerturbationEngine, central_differences

PROMPTS = [
    "a gripping , beautifully acted film . It was",
    "the plot made no sense at all and the jokes fell flat . It was",
    "Does this mean that the claim is true ? Yes or No ?\n",
    "fun",
]
# multi-token and single-token candidates of different lengths, some with a leading space
CANDIDATES = [
    [" terrible", " great", " a waste of time"],
    [" terrible", " great", " good fun"],
    ["No", "Yes", "Maybe"],
    [" bad", " great film", "!"],
]
TARGETS = torch.tensor([1, 0, 1, 2])


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hf")
    return {family: save_tiny_pretrained(root / family, family) for family in ("roberta", "opt", "bert")}


@pytest.fixture(scope="module")
def scorer(tiny_paths):
    return HFCandidateScorer(tiny_paths["opt"]).eval()


@pytest.fixture(scope="module")
def batch(scorer):
    return candidate_batch(scorer.load_tokenizer(), PROMPTS, CANDIDATES)


def candidate_batch(tokenizer, prompts, candidates):
    """``{input_ids, attention_mask, candidate_mask}`` ``[B, K, L]``: prompt + candidate k, right-padded."""
    rows = []
    for prompt, options in zip(prompts, candidates):
        prompt_ids = tokenizer(prompt)["input_ids"]  # with OPT's </s> BOS
        rows.append([(prompt_ids, tokenizer(c, add_special_tokens=False)["input_ids"]) for c in options])
    length = max(len(p) + len(c) for options in rows for p, c in options)
    shape = (len(rows), len(rows[0]), length)
    ids = torch.full(shape, tokenizer.pad_token_id)
    attention, candidate = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    for b, options in enumerate(rows):
        for k, (p, c) in enumerate(options):
            ids[b, k, : len(p) + len(c)] = torch.tensor(p + c)
            attention[b, k, : len(p) + len(c)] = 1
            candidate[b, k, len(p) : len(p) + len(c)] = 1
    return {"input_ids": ids, "attention_mask": attention, "candidate_mask": candidate}


@torch.no_grad()
def naive_scores(model, batch, length_normalize=False):
    """Full forward per row, full log-softmax, explicit sum over the candidate's positions."""
    size, k, _ = batch["input_ids"].shape
    scores = torch.zeros(size, k)
    for b in range(size):
        for j in range(k):
            ids, mask = batch["input_ids"][b, j], batch["candidate_mask"][b, j]
            logits = model(input_ids=ids[None], attention_mask=batch["attention_mask"][b, j][None]).logits[0]
            log_probs = F.log_softmax(logits.double(), dim=-1)
            positions = [t for t in range(len(ids)) if mask[t]]
            total = sum(log_probs[t - 1, ids[t]] for t in positions)
            scores[b, j] = total / len(positions) if length_normalize else total
    return scores


# ----------------------------------------------------------------------------- candidate scoring


@pytest.mark.parametrize("length_normalize", [False, True])
def test_candidate_scores_equal_the_naive_reference(tiny_paths, batch, length_normalize):
    model = HFCandidateScorer(tiny_paths["opt"], length_normalize=length_normalize).eval()
    expected = naive_scores(model.model, batch, length_normalize)
    with torch.no_grad():
        torch.testing.assert_close(model(batch), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model.predict(batch), expected, atol=1e-5, rtol=1e-5)
        model.max_rows_per_forward = 2  # chunking over rows does not change the scores
        torch.testing.assert_close(model(batch), expected, atol=1e-5, rtol=1e-5)


def test_length_normalization_divides_by_the_candidate_length(tiny_paths, batch):
    summed = HFCandidateScorer(tiny_paths["opt"]).eval()
    mean = HFCandidateScorer(tiny_paths["opt"], length_normalize=True).eval()
    lengths = batch["candidate_mask"].sum(-1)
    assert lengths.max() > 1 and lengths.min() == 1
    with torch.no_grad():
        torch.testing.assert_close(mean(batch), summed(batch) / lengths)


def test_classification_and_lm_losses(tiny_paths, batch):
    classify = HFCandidateScorer(tiny_paths["opt"], num_classes=3).eval()
    lm = HFCandidateScorer(tiny_paths["opt"], loss="lm").eval()
    with torch.no_grad():
        scores = classify(batch)
        torch.testing.assert_close(classify.per_example_loss(batch, TARGETS),
                                   F.cross_entropy(scores, TARGETS, reduction="none"))
        lm_loss = lm.per_example_loss(batch, TARGETS)
        torch.testing.assert_close(lm_loss, -scores[torch.arange(4), TARGETS])
        assert bool((lm_loss > 0).all())
        torch.testing.assert_close(lm.predict(batch), scores)  # predictions do not depend on the loss
        lm.length_normalize = True
        lengths = batch["candidate_mask"].sum(-1)[torch.arange(4), TARGETS]
        torch.testing.assert_close(lm.per_example_loss(batch, TARGETS), lm_loss / lengths)


@pytest.mark.parametrize("loss", ["classification", "lm"])
def test_per_example_losses_do_not_depend_on_the_batch(tiny_paths, batch, loss, contract, independent):
    model = HFCandidateScorer(tiny_paths["opt"], loss=loss, num_classes=3).eval()
    if loss == "classification":  # logits, CE losses, empty batch and independence together
        contract(model, batch, TARGETS)
    else:
        independent(model, batch, TARGETS, atol=1e-5)


@pytest.mark.parametrize("loss", ["classification", "lm"])
def test_empty_batch(scorer, batch, loss):
    model = copy.deepcopy(scorer).eval()
    model.loss, model.row_shapes = loss, True  # as AlgorithmModule(fixed_forward_rows=...) sets it
    empty = {key: value[:0] for key, value in batch.items()}
    with torch.no_grad():
        assert model(empty).shape == (0, 3)
        assert model.per_example_loss(empty, TARGETS[:0]).shape == (0,)
    losses = model.per_example_loss(empty, TARGETS[:0])
    losses.sum().backward()  # the empty loss is joined to the parameters: zero gradients, not None
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_candidate_scores_are_differentiable(scorer, batch):
    model = copy.deepcopy(scorer).eval()
    model.per_example_loss(batch, TARGETS).sum().backward()
    assert model.model.get_output_embeddings().weight.grad.abs().sum() > 0


def test_head_only_at_candidate_positions_and_full_forward_fallback(scorer, batch, monkeypatch):
    """The head sees only the N candidate-predicting positions; without it the full forward agrees."""
    seen = []
    head = scorer.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    try:
        with torch.no_grad():
            fast = scorer(batch)
    finally:
        handle.remove()
    vocab = scorer.model.config.vocab_size
    assert seen == [(int(batch["candidate_mask"].sum()), vocab)]
    slow = copy.deepcopy(scorer)
    slow.head_name = None
    with torch.no_grad():
        torch.testing.assert_close(slow(batch), fast, atol=1e-5, rtol=1e-5)
    import lit_zodp.backbones.huggingface as hf

    monkeypatch.setattr(hf, "HEAD_CHUNK", 3)  # chunks of positions through the head
    with torch.no_grad():
        torch.testing.assert_close(scorer(batch), fast, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("loss", ["classification", "lm"])
def test_head_calls_of_a_fixed_shape_chunk_do_not_depend_on_the_batch_mates(scorer, batch, loss):
    """Under ``fixed_forward_rows`` every private computation must have a shape set by the row alone; one head
    call on all candidate tokens of a chunk had a size set by the chunk-mates' candidates (audit zo F2)."""
    from lit_zodp.privacy.fixed_shape import FixedShapeForwards

    model = copy.deepcopy(scorer).eval()
    model.loss, model.row_shapes = loss, True  # as AlgorithmModule(fixed_forward_rows=...) sets it
    multi_token_targets = torch.tensor([1, 2, 0, 1])  # the mates' ("lm": only the target) rows differ in length
    calls = []
    head = model.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, out: calls[-1].append(tuple(args[0].shape)))

    def head_inputs_of_first_example(examples):
        calls.clear()
        inputs = {key: value[examples] for key, value in batch.items()}
        for rows, targets, _ in FixedShapeForwards(rows=2).chunks(inputs, multi_token_targets[examples]):
            calls.append([])
            with torch.no_grad():
                model.per_example_loss(rows, targets)
        return calls[0][: 1 if loss == "lm" else 3]  # the first example's rows come first

    try:
        alone = head_inputs_of_first_example(torch.tensor([0]))
        for mates in ([0, 1], [0, 2], [0, 3]):
            assert head_inputs_of_first_example(torch.tensor(mates)) == alone
        with torch.no_grad():
            by_row = model.per_example_loss(batch, multi_token_targets)
            model.row_shapes = False
            torch.testing.assert_close(model.per_example_loss(batch, multi_token_targets), by_row)
    finally:
        handle.remove()


def test_bad_candidate_inputs(scorer, batch):
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"\[B, K, L\]"):
            scorer({k: v[:, 0] for k, v in batch.items()})
        with pytest.raises(ValueError, match="candidate_mask"):
            scorer({k: v for k, v in batch.items() if k != "candidate_mask"})
        no_candidate = dict(batch, candidate_mask=batch["candidate_mask"].clone())
        no_candidate["candidate_mask"][1, 2] = 0
        with pytest.raises(ValueError, match="at least one candidate token"):
            scorer(no_candidate)
        at_start = dict(batch, candidate_mask=batch["candidate_mask"].clone())
        at_start["candidate_mask"][0, 0, 0] = 1
        with pytest.raises(ValueError, match="position 0"):
            scorer(at_start)
        padded = dict(batch, candidate_mask=batch["candidate_mask"].clone())
        padded["candidate_mask"][0, 0, -1] = 1  # a pad position
        with pytest.raises(ValueError, match="attended"):
            scorer(padded)
        with pytest.raises(ValueError, match="expected 2 candidates"):
            HFCandidateScorer(scorer.tokenizer_path, num_classes=2)(batch)
        lm = copy.deepcopy(scorer)
        lm.loss = "lm"
        with pytest.raises(ValueError, match="one candidate index") as excinfo:
            lm.per_example_loss(batch, torch.tensor([0, 1, 3, 0]))
        assert "[0, 1, 3, 0]" not in str(excinfo.value)  # the private targets are not printed (they were)
    with pytest.raises(ValueError, match="loss must be"):
        HFCandidateScorer(scorer.tokenizer_path, loss="mse")


# ------------------------------------------------------------------ a varying number of candidates (ReCoRD)


def absent_rows(batch, rows):
    """``batch`` with the rows ``[(b, k), ...]`` made absent, as a data module pads an example with fewer
    candidates than ``K``: pad ids, nothing attended to, no candidate token."""
    out = {key: value.clone() for key, value in batch.items()}
    for b, k in rows:
        out["input_ids"][b, k] = 1  # OPT's pad id
        out["attention_mask"][b, k] = 0
        out["candidate_mask"][b, k] = 0
    return out


#: example 0 keeps 2 of its 3 candidates, example 3 keeps 1; the targets are present candidates
ABSENT = [(0, 2), (3, 1), (3, 2)]
PRESENT_TARGETS = torch.tensor([1, 0, 1, 0])


@pytest.mark.parametrize("length_normalize", [False, True])
def test_absent_candidates_score_minus_infinity_and_are_never_run(tiny_paths, batch, length_normalize, monkeypatch):
    model = HFCandidateScorer(tiny_paths["opt"], length_normalize=length_normalize).eval()
    padded = absent_rows(batch, ABSENT)
    rows_run = []
    forward = model.model.base_model.forward
    monkeypatch.setattr(model.model.base_model, "forward",
                        lambda **kw: rows_run.append(kw["input_ids"].shape[0]) or forward(**kw))
    with torch.no_grad():
        full, scores = model(batch), model(padded)
    assert rows_run == [12, 9]  # the 3 absent rows never reach the transformer
    absent = torch.zeros(4, 3, dtype=torch.bool)
    absent[tuple(zip(*ABSENT))] = True
    assert bool(torch.isneginf(scores[absent]).all()) and bool(torch.isfinite(scores[~absent]).all())
    torch.testing.assert_close(scores[~absent], full[~absent], atol=1e-5, rtol=1e-5)  # the rest as without padding
    assert not bool(absent[torch.arange(4), scores.argmax(1)].any())
    # an absent row never wins, even the one that would have had the best score: the runner-up does
    best = full.argmax(1)
    with torch.no_grad():
        without_best = model(absent_rows(batch, [(b, int(best[b])) for b in range(4)]))
    assert torch.equal(without_best.argmax(1), full.scatter(1, best[:, None], float("-inf")).argmax(1))


def test_the_classification_loss_over_present_candidates_is_a_cross_entropy_over_them_alone(tiny_paths, batch):
    model = HFCandidateScorer(tiny_paths["opt"], length_normalize=True).eval()
    padded = absent_rows(batch, ABSENT)
    with torch.no_grad():
        losses = model.per_example_loss(padded, PRESENT_TARGETS)
        full = model(batch)
    kept = [[0, 1], [0, 1, 2], [0, 1, 2], [0]]  # the present candidates of each example
    for b, keep in enumerate(kept):  # a reference cross-entropy over the present candidates only
        reference = F.cross_entropy(full[b, keep][None].double(), PRESENT_TARGETS[b : b + 1])
        torch.testing.assert_close(losses[b].double(), reference, atol=1e-5, rtol=1e-5)
    assert float(losses[3]) == 0.0  # one candidate: certain
    lm = HFCandidateScorer(tiny_paths["opt"], loss="lm", length_normalize=True).eval()
    with torch.no_grad():  # LM-style (MeZO's ReCoRD): the target row's NLL, absent rows or not
        torch.testing.assert_close(lm.per_example_loss(padded, PRESENT_TARGETS),
                                   -full[torch.arange(4), PRESENT_TARGETS], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("loss", ["classification", "lm"])
def test_losses_with_absent_candidates_do_not_depend_on_the_batch(tiny_paths, batch, loss, independent):
    model = HFCandidateScorer(tiny_paths["opt"], loss=loss, length_normalize=True).eval()
    independent(model, absent_rows(batch, ABSENT), PRESENT_TARGETS, atol=1e-5)


def test_a_row_attending_to_tokens_without_a_candidate_is_still_refused(scorer, batch):
    no_candidate = dict(batch, candidate_mask=batch["candidate_mask"].clone())
    no_candidate["candidate_mask"][1, 2] = 0  # attention kept: not an absent row
    with torch.no_grad(), pytest.raises(ValueError, match="at least one candidate token"):
        scorer(absent_rows(no_candidate, [(0, 2)]))


# ----------------------------------------------------------------------------- masked LM at the mask


@pytest.mark.parametrize("family", ["roberta", "bert"])
def test_mlm_head_at_the_mask_equals_the_full_forward(tiny_paths, family):
    model = HFPromptClassifier(tiny_paths[family], label_words=["terrible", "great", "Maybe"]).eval()
    assert model.lm_type == "mlm" and model.head_name is not None
    tokenizer = model.load_tokenizer()
    mask = tokenizer.mask_token
    texts = [f"fun film . It was {mask} .", f"a slog . It was {mask} .", f"{mask} , it was bad ."]
    batch = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    seen = []
    handle = model.model.get_submodule(model.head_name).register_forward_hook(
        lambda module, args, out: seen.append(tuple(out.shape)))
    with torch.no_grad():
        gathered = model(batch)
        handle.remove()
        full = model.model(**batch).logits
        expected = full[batch["input_ids"] == model.mask_token_id][:, model.label_word_ids]
    assert seen == [(3, model.model.config.vocab_size)]  # 3 positions, not 3 x L
    torch.testing.assert_close(gathered, expected, atol=1e-6, rtol=1e-6)
    model.head_name = None  # the full-forward fallback (models whose head is not one module)
    with torch.no_grad():
        torch.testing.assert_close(model(batch), expected, atol=1e-6, rtol=1e-6)


def test_causal_label_word_logits_use_only_the_label_word_rows(tiny_paths):
    model = HFPromptClassifier(tiny_paths["opt"], label_words=["terrible", "great"]).eval()
    tokenizer = model.load_tokenizer()
    texts = ["fun film . It was", "a slog , It was bad . It was"]
    batch = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    last = batch["attention_mask"].sum(1) - 1
    with torch.no_grad():
        full = model.model(**batch).logits[torch.arange(2), last][:, model.label_word_ids]
        torch.testing.assert_close(model(batch), full, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- tiny checkpoints on disk


@pytest.mark.parametrize("family, lm_type, model_class", [
    ("roberta", "mlm", "RobertaForMaskedLM"),
    ("opt", "causal", "OPTForCausalLM"),
    ("bert", "mlm", "BertForMaskedLM"),
])
def test_tiny_families_save_and_reload_through_the_prompt_classifier(
    tiny_paths, family, lm_type, model_class
):
    path = tiny_paths[family]
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == family and config["hidden_size"] == 32
    assert config["num_hidden_layers"] == 2 and config["num_attention_heads"] == 2
    words = ["great", "terrible", "Yes", "No", "Maybe"]
    model = HFPromptClassifier(model_name_or_path=path, label_words=words)
    assert type(model.model).__name__ == model_class and model.lm_type == lm_type
    assert model.num_classes == 5 and len(set(model.label_word_ids.tolist())) == 5
    tokenizer = model.load_tokenizer()
    assert model.model.config.vocab_size == len(tokenizer)
    for word in LABEL_WORDS:
        assert len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) == 1, word
    ids = tokenizer("It was great .")["input_ids"]
    if family == "opt":  # OPT: </s> as BOS, nothing appended, right padding with <pad> = 1
        assert ids[0] == tokenizer.bos_token_id == tokenizer.eos_token_id == 2 and ids[-1] != 2
        assert tokenizer.pad_token_id == 1 and tokenizer.padding_side == "right"
    else:
        assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
        spaced = tokenizer(f"It was {tokenizer.mask_token} .")["input_ids"]
        assert len(spaced) == 6  # the mask takes the space before it (RoBERTa's lstrip)
    # the same directory reloads to the same weights (a real from_pretrained path, not a fresh init)
    again = HFPromptClassifier(model_name_or_path=path, label_words=words)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)


def test_save_tiny_pretrained_options(tmp_path):
    state = torch.random.get_rng_state()
    path = save_tiny_pretrained(tmp_path / "opt", "opt", vocab_texts=["zorblax is a quuxish word"], seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global random state is untouched
    tokenizer = HFCandidateScorer(path).load_tokenizer()
    assert len(tokenizer("zorblax is a quuxish word", add_special_tokens=False)["input_ids"]) == 5
    with pytest.raises(ValueError, match="family"):
        save_tiny_pretrained(tmp_path / "t5", "t5")
    with pytest.raises(ValueError, match="vocab_texts"):
        save_tiny_pretrained(tmp_path / "x", "opt", vocab_texts="not a list")


# ----------------------------------------------------------------------------- zeroth-order sanity


def test_zo_central_differences_on_the_candidate_scorer_allocate_no_grad(tiny_paths, batch):
    """MeZO's two-point estimate on OPT candidate scoring: no autograd, no .grad, exact restore; the
    estimate matches the directional derivative that autograd computes on a separate copy."""
    model = HFCandidateScorer(tiny_paths["opt"], dtype="float64").eval()
    reference = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    engine = PerturbationEngine(params)
    grad_modes = []
    hook = model.model.base_model.register_forward_hook(
        lambda *args: grad_modes.append(torch.is_grad_enabled()))

    def losses():
        with torch.no_grad():
            return model.per_example_loss(batch, TARGETS)

    differences = central_differences(engine, seed=7, lam=1e-6, losses=losses)
    engine.restore_()
    hook.remove()
    assert differences.shape == (4,) and grad_modes == [False, False]
    assert all(p.grad is None for p in model.parameters())
    for p, b in zip(params, before):
        torch.testing.assert_close(p, b, atol=1e-12, rtol=0)
    # autograd on an independent copy: d/dlam f(x + lam u) = <grad f_i, u> per example
    u = engine.direction(7)
    ref_params = [p for p in reference.parameters() if p.requires_grad]
    per_example = reference.per_example_loss(batch, TARGETS)
    for i in range(4):
        grads = torch.autograd.grad(per_example[i], ref_params, retain_graph=True, allow_unused=True)
        exact = sum((g * d).sum() for g, d in zip(grads, u) if g is not None)
        assert differences[i].item() == pytest.approx(exact.item(), rel=1e-6)  # O(lam^2) + rounding


def test_mezo_trains_the_candidate_scorer_in_a_lightning_loop(tiny_paths, batch):
    from lit_zodp.algorithms import MeZO
    from tests.conftest import quiet_trainer

    backbone = HFCandidateScorer(tiny_paths["opt"], num_classes=3)
    start = [p.detach().clone() for p in backbone.parameters()]
    module = MeZO(backbone, lr=1e-3, lam=1e-3, seed=0)
    loader = DataLoader([(batch, TARGETS), ({k: v[:0] for k, v in batch.items()}, TARGETS[:0])],
                        batch_size=None)
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(module, loader)
    assert trainer.global_step == 2
    assert all(p.grad is None for p in backbone.parameters())
    assert any(not torch.equal(p, s) for p, s in zip(backbone.parameters(), start))
    with torch.no_grad():
        assert module(batch).shape == (4, 3)


def test_candidate_scorer_from_a_class_path_config(tiny_paths):
    jsonargparse = pytest.importorskip("jsonargparse")
    from lit_zodp.backbones import Backbone

    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--model", type=Backbone)
    class_path = "lit_zodp.backbones.HFCandidateScorer"
    init_args = {"model_name_or_path": tiny_paths["opt"], "num_classes": 3, "loss": "lm",
                 "length_normalize": True}
    config = parser.parse_object({"model": {"class_path": class_path, "init_args": init_args}})
    model = parser.instantiate_classes(config).model
    assert isinstance(model, HFCandidateScorer) and model.loss == "lm" and model.length_normalize
    with pytest.raises(argparse.ArgumentError, match="loss"):
        parser.parse_object({"model": {"class_path": class_path, "init_args": dict(init_args, loss="mse")}})


def test_a_candidate_batch_of_the_wrong_layout_is_refused_naming_no_batch_size_or_length(scorer, batch):
    """The message names the layout expected, never the batch's size or padded length (private under Poisson
    sampling and per-batch padding: review 17)."""
    flat = {key: value[:, 0] for key, value in batch.items()}  # [B, L]: one candidate's rows, not [B, K, L]
    with pytest.raises(ValueError, match=r"\[B, K, L\]; got a 2-D input_ids") as error:
        scorer(flat)
    assert re.findall(r"\d+", str(error.value)) == ["2"]  # the one number: input_ids' dimensions


@pytest.mark.parametrize("length_normalize", [False, True])
def test_under_fixed_forward_rows_absent_candidates_keep_the_forward_shape(tiny_paths, batch, length_normalize,
                                                                             monkeypatch):
    """Review 46: with ``row_shapes`` (``fixed_forward_rows``) the transformer ran only the present rows, so its call's
    row count was set by the chunk-mates' entity counts (ReCoRD), the shape dependence ``fixed_forward_rows``
    excludes. Every row now runs (an absent one as a placeholder whose score is dropped): scores and both losses as
    before, the call ``[B*K, L]`` whatever is absent."""
    for loss in ("classification", "lm"):
        model = HFCandidateScorer(tiny_paths["opt"], loss=loss, length_normalize=length_normalize).eval()
        plain = HFCandidateScorer(tiny_paths["opt"], loss=loss, length_normalize=length_normalize).eval()
        model.row_shapes = True
        padded = absent_rows(batch, ABSENT)
        rows_run = []
        forward = model.model.base_model.forward
        monkeypatch.setattr(model.model.base_model, "forward",
                            lambda **kw: rows_run.append(tuple(kw["input_ids"].shape)) or forward(**kw))
        with torch.no_grad():
            scores, reference = model(padded), plain(padded)
            losses, reference_losses = (model.per_example_loss(padded, PRESENT_TARGETS),
                                        plain.per_example_loss(padded, PRESENT_TARGETS))
        assert rows_run[0] == tuple(batch["input_ids"].flatten(0, 1).shape)  # 12 rows, absent ones included
        assert torch.equal(torch.isneginf(scores), torch.isneginf(reference))
        torch.testing.assert_close(scores, reference, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(losses, reference_losses, atol=1e-5, rtol=1e-5)
        assert bool(torch.isfinite(losses).all())


@pytest.mark.parametrize("loss", ["classification", "lm"])
def test_losses_with_absent_candidates_under_fixed_forward_rows_do_not_depend_on_the_batch(tiny_paths, batch, loss,
                                                                                            independent):
    model = HFCandidateScorer(tiny_paths["opt"], loss=loss, length_normalize=True).eval()
    model.row_shapes = True
    independent(model, absent_rows(batch, ABSENT), PRESENT_TARGETS, atol=1e-5)
