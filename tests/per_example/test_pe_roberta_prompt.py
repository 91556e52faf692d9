"""The DPZero paper's first-order baselines (Table 2: DP-AdamW, DP-LoRA) train RoBERTa's masked-LM prompt head with
per-example clipping. A tiny RoBERTa ``HFPromptClassifier`` (RoBERTa's position ids from the token ids, its padding
id 1, the MLM head whose ``bias`` is the decoder's, dropout on) gives the engine's flat-clipped sums of one backward
per example, in every mode, with the decoder tied to the word embeddings (Hugging Face's default: one parameter
used twice), untied (``untie_word_embeddings``, the reference models') and with peft LoRA on query/value and a
trained copy of the head (``modules_to_save``)."""

import pytest
import torch

from lit_zodp.backbones import HFPromptClassifier, per_example_loss
from lit_zodp.per_example import PerExampleGradientEngine
from tests.per_example.helpers import assert_rel_close, flat_clipped_sum

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROBERTA = dict(model_type="roberta", vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=32, max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=2,
               hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
MASK, LABEL_WORDS = 4, [7, 9, 11]
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query", "value"], modules_to_save=["lm_head"])


def roberta_prompt(setting: str) -> HFPromptClassifier:
    torch.manual_seed(0)
    options = {"tied": {}, "untied": {"untie_word_embeddings": True},
               "lora": {"untie_word_embeddings": True, "lora": LORA}}[setting]
    model = HFPromptClassifier(config=ROBERTA, label_word_ids=LABEL_WORDS, mask_token_id=MASK, **options)
    if setting == "lora":  # (LoRA's B starts at 0, so A's gradients would all be 0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.3)
    return model.double().train()


def prompt_batch():
    """Rows of 4-9 tokens, ``<s> ... <mask> ... </s>``, right-padded with RoBERTa's pad id 1."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for length in (9, 4, 7, 5, 9, 6):
        body = torch.randint(12, 60, (length - 2,), generator=g)
        body[int(torch.randint(0, length - 2, (1,), generator=g))] = MASK
        rows.append(torch.cat([torch.tensor([0]), body, torch.tensor([2])]))
    ids = torch.ones(len(rows), 9, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = row
    return {"input_ids": ids, "attention_mask": (ids != 1).long()}, torch.tensor([0, 1, 2, 1, 0, 2])


def test_the_three_settings_hold_the_parameters_the_reference_models_train():
    tied, untied, lora = (roberta_prompt(s) for s in ("tied", "untied", "lora"))
    embeddings, decoder = (tied.model.get_input_embeddings().weight, tied.model.lm_head.decoder.weight)
    assert decoder is embeddings  # Hugging Face's RobertaForMaskedLM: one tensor used twice
    assert untied.model.lm_head.decoder.weight is not untied.model.get_input_embeddings().weight
    assert torch.equal(untied.model.lm_head.decoder.weight, untied.model.get_input_embeddings().weight)
    assert untied.model.lm_head.bias is untied.model.lm_head.decoder.bias  # (the head's own tie is kept)
    trained = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n or "lm_head.modules_to_save" in n for n in trained)
    assert {n.split(".")[-4] for n in trained if "lora_" in n} == {"query", "value"}
    assert any(n.endswith("modules_to_save.default.decoder.weight") for n in trained)


@pytest.mark.parametrize("setting", ["tied", "untied", "lora"])
@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping"])
def test_clipped_sums_equal_one_backward_per_example(setting, mode):
    model = roberta_prompt(setting)
    inputs, targets = prompt_batch()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]

    def losses():
        torch.manual_seed(5)  # (the same dropout masks in the engine's forward and the reference's)
        return per_example_loss(model, inputs, targets)

    batch = losses()
    rows = [torch.autograd.grad(batch[i], params, retain_graph=True) for i in range(len(batch))]
    reference = {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}
    clip = float(flat_clipped_sum(reference, names, float("inf"))[1].median())  # (about half the rows clipped)
    sums, norms = flat_clipped_sum(reference, names, clip)
    engine = PerExampleGradientEngine(model, mode=mode)
    assert engine.names == names  # (a tied tensor once)
    out = engine.clipped_sum(losses, clip=clip)
    assert 0 < int((norms > clip).sum()) < len(norms) and not engine.last_recomputed
    for name, got in zip(names, out.grads):
        assert_rel_close(got, sums[name], 1e-9, name)
    torch.testing.assert_close(out.norms.double(), norms, rtol=1e-6, atol=0)
    if setting == "tied":  # the tied tensor's per-example gradient sums its two uses: the embedding rows of the
        embeddings = "model.roberta.embeddings.word_embeddings.weight"  # prompt's tokens and the label words' rows
        assert reference[embeddings][:, 12:].abs().sum() > 0 and reference[embeddings][:, LABEL_WORDS].abs().sum() > 0
