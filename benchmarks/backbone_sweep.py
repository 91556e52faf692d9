"""Which backbones the first-order engine runs: one checked step per (backbone, grad_mode).

Each backbone takes a clipped-sum step of the per-example gradient engine in train mode (dropout on)
on 8 real movie-review snippets tokenized by the packaged MiniLM tokenizer (rows of different
lengths, padded to the longest), three times per mode (the checks draw secret random projections).
A line per (backbone, mode): ``ok`` or the refusal. The models are the packaged MiniLM and small
random models built from their configurations (no download).

    python benchmarks/backbone_sweep.py [name-filter ...]
"""

from __future__ import annotations

import sys
import warnings
from copy import deepcopy

import torch

from lit_zodp.backbones import HFPromptClassifier, HFSequenceClassifier, SentenceEncoderClassifier, TimmClassifier
from lit_zodp.backbones.base import per_example_loss
from lit_zodp.backbones.huggingface import load_tokenizer, packaged_minilm_path, tiny_bert_config
from lit_zodp.per_example import PerExampleGradientEngine

REVIEWS = ["a great movie", "the worst film I have ever seen in my life, truly awful and boring", "meh",
           "I loved every minute of it, wonderful", "not bad", "an excellent film, well worth seeing today",
           "boring", "one of the best movies ever made, with a fine cast and a great story"]
LABELS = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1])
VOCAB = 30522  # the MiniLM tokenizer's
SMALL = {
    "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, pad_token_id=0, eos_token_id=102),
    "opt": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64, max_position_embeddings=64,
                word_embed_proj_dim=32, pad_token_id=0, eos_token_id=102, bos_token_id=101),
    "roberta": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    max_position_embeddings=80, pad_token_id=0),
    "llama": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=64, max_position_embeddings=64, pad_token_id=0),
    "distilbert": dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64, pad_token_id=0),
    "bart": dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, eos_token_id=102,
                 bos_token_id=101, decoder_start_token_id=102),
    "t5": dict(d_model=32, num_layers=1, num_decoder_layers=1, num_heads=2, d_ff=64, d_kv=16, pad_token_id=0,
               eos_token_id=102),
}


def cases():
    """``(name, build, inputs)`` for every backbone checked."""
    tokenizer = load_tokenizer(packaged_minilm_path())
    text = dict(tokenizer(REVIEWS, padding=True, return_tensors="pt"))
    text.pop("token_type_ids")
    prompts = dict(tokenizer([r + " It was [MASK]." for r in REVIEWS], padding=True, return_tensors="pt"))
    images = torch.randn(len(REVIEWS), 3, 32, 32, generator=torch.Generator().manual_seed(0))
    yield "sentence-encoder-minilm", lambda: SentenceEncoderClassifier("minilm", num_classes=2), text
    yield "sequence-classifier-minilm", lambda: HFSequenceClassifier("minilm", num_classes=2), text
    for family, config in SMALL.items():
        config = dict(model_type=family, vocab_size=VOCAB, **config)
        yield f"sequence-classifier-{family}", lambda c=config: HFSequenceClassifier(config=c, num_classes=2), text
    yield ("mlm-prompt-bert", lambda: HFPromptClassifier(config=tiny_bert_config(), label_words=["bad", "good"],
                                                          tokenizer_name_or_path=packaged_minilm_path()), prompts)
    yield "timm-vit-tiny", lambda: TimmClassifier("vit_tiny_patch16_224", num_classes=2, img_size=32), images
    yield "timm-resnet18-groupnorm", lambda: TimmClassifier("resnet18", num_classes=2, norm_layer="groupnorm"), images


def one_step(model, inputs, mode: str) -> str:
    copy = deepcopy(model)
    try:
        PerExampleGradientEngine(copy, mode=mode).clipped_sum(
            lambda: per_example_loss(copy, inputs, LABELS).float(), 1.0)
        return "ok"
    except Exception as error:  # noqa: BLE001 (reported, the sweep goes on)
        return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


def main(filters: list[str]) -> None:
    warnings.filterwarnings("ignore")
    for name, build, inputs in cases():
        if filters and not any(f in name for f in filters):
            continue
        torch.manual_seed(0)
        model = build().train()
        for mode in ("hooks", "ghost", "bookkeeping"):
            results = sorted({one_step(model, inputs, mode) for _ in range(3)})
            print(f"{name:28s} {mode:12s} {' | '.join(results)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
