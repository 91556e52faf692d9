"""The Hugging Face backbones' ``untie_word_embeddings`` and ``lora`` options: the reference models of the DPZero
paper's Table 2 (an LM-head decoder of its own; LoRA r = 8, alpha = 16 on query/value with the head trained) built from
a checkpoint folder, as the paper configs build them."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from lit_zodp.backbones import HFCandidateScorer, HFPromptClassifier, HFSequenceClassifier
from lit_zodp.backbones.huggingface import apply_lora, untie_word_embeddings_of
from lit_zodp.backbones.tiny_hf import save_tiny_pretrained
from lit_zodp.errors import ConfigError

WORDS = ["terrible", "great"]
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query", "value"], modules_to_save=["lm_head"])


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_lora")
    return {family: save_tiny_pretrained(root / family, family) for family in ("roberta", "opt")}


def prompts(model):
    tokenizer = model.load_tokenizer()
    texts = [f"fun film . It was {tokenizer.mask_token} .", f"a slog , badly acted . It was {tokenizer.mask_token} ."]
    return dict(tokenizer(texts, padding=True, return_tensors="pt")), torch.tensor([1, 0])


def test_untied_decoder_is_a_copy_whose_gradient_and_the_embeddings_add_up_to_the_tied_one(tiny_paths):
    tied = HFPromptClassifier(tiny_paths["roberta"], label_words=WORDS)
    untied = HFPromptClassifier(tiny_paths["roberta"], label_words=WORDS, untie_word_embeddings=True)
    embeddings, decoder = untied.model.get_input_embeddings().weight, untied.model.lm_head.decoder.weight
    assert tied.model.lm_head.decoder.weight is tied.model.get_input_embeddings().weight
    assert decoder is not embeddings and torch.equal(decoder, embeddings) and decoder.requires_grad
    assert untied.model.lm_head.bias is untied.model.lm_head.decoder.bias
    untied.model.tie_weights()  # (transformers re-ties on some calls: the config says not to)
    assert untied.model.lm_head.decoder.weight is decoder and not untied.model.config.tie_word_embeddings
    batch, targets = prompts(tied)
    tied.eval(), untied.eval()
    F.cross_entropy(tied(batch), targets).backward()
    F.cross_entropy(untied(batch), targets).backward()
    torch.testing.assert_close(untied(batch), tied(batch))  # the same start (zero-shot unchanged)
    torch.testing.assert_close(embeddings.grad + decoder.grad, tied.model.get_input_embeddings().weight.grad)
    assert decoder.grad[untied.label_word_ids].abs().sum() > 0
    others = torch.ones(len(decoder), dtype=torch.bool)
    others[untied.label_word_ids] = False
    assert not decoder.grad[others].any()  # only the label words' rows of the decoder are scored


def test_untying_a_model_without_output_embeddings_is_refused(tiny_paths):
    classifier = HFSequenceClassifier(tiny_paths["roberta"])
    with pytest.raises(ConfigError, match="`untie_word_embeddings`: RobertaForSequenceClassification has no output"):
        untie_word_embeddings_of(classifier.model)


def test_lora_on_the_prompt_classifier_trains_the_adapters_and_a_copy_of_the_head(tiny_paths):
    pytest.importorskip("peft")
    plain = HFPromptClassifier(tiny_paths["roberta"], label_words=WORDS).eval()
    model = HFPromptClassifier(tiny_paths["roberta"], label_words=WORDS, untie_word_embeddings=True, lora=LORA).eval()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    layers = model.model.config.num_hidden_layers
    assert len([n for n in trained if "lora_" in n]) == 2 * 2 * layers  # A and B of query and value, every layer
    assert all("lora_" in n or n.startswith("model.lm_head.modules_to_save.default.") for n in trained)
    lora_a = model.model.roberta.encoder.layer[0].attention.self.query.lora_A["default"]
    assert lora_a.weight.shape == (8, model.model.config.hidden_size)
    assert model.model.roberta.encoder.layer[0].attention.self.query.scaling["default"] == 2.0  # alpha / r
    batch, _ = prompts(model)
    with torch.no_grad():  # LoRA's B starts at 0: the zero-shot start is the plain model's
        torch.testing.assert_close(model(batch), plain(batch))


def test_lora_on_the_sequence_classifier_and_the_candidate_scorer(tiny_paths):
    pytest.importorskip("peft")
    classifier = HFSequenceClassifier(tiny_paths["roberta"], lora={"r": 4, "target_modules": ["query", "value"],
                                                                  "modules_to_save": ["classifier"]})
    trained = [n for n, p in classifier.named_parameters() if p.requires_grad]
    assert any("classifier.modules_to_save" in n for n in trained)
    assert all("lora_" in n or "modules_to_save" in n for n in trained)
    scorer = HFCandidateScorer(tiny_paths["opt"], lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    assert {"lora_" in n for n, p in scorer.named_parameters() if p.requires_grad} == {True}


@pytest.mark.parametrize("lora, match", [
    ({"r": 8, "alpha": 16}, "`lora`: .*alpha.*field names"),
    ({"r": 8, "target_modules": ["no_such_layer"]}, "`lora`: Target modules .*no_such_layer"),
    ({"r": 8, "task_type": "SEQ_CLS"}, "`lora`: task_type cannot be set here"),
    ("r=8", "`lora` takes a mapping"),
])
def test_a_bad_lora_option_is_refused_in_one_line(tiny_paths, lora, match):
    pytest.importorskip("peft")
    with pytest.raises(ConfigError, match=match) as info:
        HFPromptClassifier(tiny_paths["roberta"], label_words=WORDS, lora=lora)
    assert "\n" not in str(info.value)


def test_lora_without_peft_is_refused_in_one_line(tiny_paths, monkeypatch):
    model = HFPromptClassifier(tiny_paths["roberta"], label_words=WORDS).model
    monkeypatch.setitem(sys.modules, "peft", None)  # (an import of peft then raises ImportError)
    with pytest.raises(ConfigError, match=r"^`lora` needs the peft package: pip install peft$"):
        apply_lora(model, LORA)


def test_an_untied_models_weights_loaded_into_a_tied_one_are_refused_in_one_line(tiny_paths):
    """Review 39: a strict ``load_state_dict`` of an untied run's weights (decoder trained apart from the embeddings)
    into a backbone built without ``untie_word_embeddings`` matched every key and silently replaced the embeddings
    by the trained decoder (max |change| 1.0 here). The tied model's weights load into an untied one unchanged."""
    untied = HFPromptClassifier(tiny_paths["roberta"], label_words=WORDS, untie_word_embeddings=True)
    with torch.no_grad():
        untied.model.lm_head.decoder.weight.add_(1.0)
    tied = HFPromptClassifier(tiny_paths["roberta"], label_words=WORDS)
    embeddings = tied.model.get_input_embeddings().weight.detach().clone()
    with pytest.raises(ConfigError, match=r"untie_word_embeddings: true") as info:
        tied.load_state_dict(untied.state_dict())
    assert "\n" not in str(info.value) and torch.equal(tied.model.get_input_embeddings().weight, embeddings)
    again = HFPromptClassifier(tiny_paths["roberta"], label_words=WORDS, untie_word_embeddings=True)
    again.load_state_dict(tied.state_dict())
    assert torch.equal(again.model.lm_head.decoder.weight, embeddings)


@pytest.mark.parametrize("lora, match", [
    ({"r": 8, "target_modules": ["query"], "modules_to_save": ["no_such_head"]}, "`lora`: modules_to_save .*no_such_head"),
    ({"r": "8", "target_modules": ["query"]}, "`lora`: "),
])
def test_a_lora_option_peft_ignores_or_fails_on_is_refused_in_one_line(tiny_paths, lora, match):
    """Review 39: a ``modules_to_save`` naming no module was ignored (the head the user meant to train stayed frozen,
    4 parameters trained); ``r: "8"`` raised peft's bare TypeError."""
    pytest.importorskip("peft")
    with pytest.raises(ConfigError, match=match) as info:
        HFPromptClassifier(tiny_paths["roberta"], label_words=WORDS, lora=lora)
    assert "\n" not in str(info.value)
