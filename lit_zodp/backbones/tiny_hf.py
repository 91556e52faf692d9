"""Tiny RoBERTa / OPT / BERT checkpoints on disk, for tests and smoke runs without any download.

:func:`save_tiny_pretrained` trains a small tokenizer of the family's kind with the ``tokenizers``
library (byte-level BPE for RoBERTa and OPT, WordPiece for BERT), builds a randomly initialised
masked or causal LM (hidden size 32, 2 layers, 2 heads) whose vocabulary is that tokenizer's, and
``save_pretrained``-s both into a directory. Backbones then load the directory exactly as they load
a hub checkpoint (``HFPromptClassifier(model_name_or_path=path, label_words=[...])``).

Family conventions kept: RoBERTa ``<s> ... </s>`` with ``<pad>`` = 1 and a ``<mask>`` that absorbs
the space before it; OPT prepends ``</s>`` (id 2) as its BOS token, pads with ``<pad>`` = 1 on the
right and appends nothing; BERT is lower-cased ``[CLS] ... [SEP]`` with ``[PAD]`` = 0. The common
label words of prompt-based fine-tuning (:data:`LABEL_WORDS`: ``great``, ``terrible``, ``Yes``,
``No``, ``Maybe``...) are single tokens, with and without a leading space.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any, Literal, Optional

import torch

from lit_zodp.backbones.huggingface import _quiet_transformers

Family = Literal["roberta", "opt", "bert"]
FAMILIES: tuple[str, ...] = ("roberta", "opt", "bert")

#: Label words of LM-BFF / MeZO / DPZero templates; each becomes a single token.
LABEL_WORDS: tuple[str, ...] = (
    "great", "terrible", "good", "bad", "Yes", "No", "Maybe", "yes", "no", "maybe", "true", "false",
    "True", "False", "positive", "negative", "neutral", "correct", "incorrect", "right", "wrong",
)

#: Sentences in the style of SST-2, MNLI/RTE/CB, BoolQ and COPA prompts (byte-level BPE and WordPiece
#: learn every word of these whole, so prompts tokenize into words, not characters).
BASE_TEXTS: tuple[str, ...] = (
    "a gripping , beautifully acted film with a score I keep humming days later .",
    "the plot made no sense at all and the jokes fell flat .",
    "I walked out after twenty minutes ; a dull and boring movie .",
    "an instant classic , one of the best movies of the year .",
    "the worst film I have ever seen , a waste of time .",
    "fun , warm and funny , it is a real pleasure to watch .",
    "It was great . It was terrible . It was good . It was bad .",
    "Does this mean that the claim is true ? Yes or No ?",
    "Question : is the sky blue ? Answer : Yes",
    "Question : can a fish climb a tree ? Answer : No",
    "The man broke his toe . What was the cause ? He dropped a hammer on his foot .",
    "The woman felt happy because she won the game , so she smiled .",
    "Premise : a dog runs in the park . Hypothesis : an animal is outside . Maybe",
    "Suppose the movie was long . Can we infer that it was slow ? Yes , No , or Maybe ?",
    "the acting is strong but the story is weak and the ending is sad .",
    "this is a positive review , that is a negative review , and this one is neutral .",
    "The answer is correct . The answer is incorrect . That is right . That is wrong .",
)


def default_vocab_texts() -> list[str]:
    """The tokenizer's training texts: :data:`BASE_TEXTS` plus each label word in several positions."""
    texts = list(BASE_TEXTS)
    for word in LABEL_WORDS:
        # after a space, at the start of a text and of a line, before punctuation
        texts += [f"It was {word} .", f"{word} , it was {word} !", f"? {word}\n{word}"]
    return texts


def save_tiny_pretrained(
    path: str | os.PathLike,
    family: Family,
    vocab_texts: Optional[list[str]] = None,
    *,
    seed: int = 0,
    max_length: int = 128,
) -> str:
    """Save a tiny randomly initialised LM of ``family`` and its tokenizer to ``path``.

    Args:
        path: Directory to write (created if needed).
        family: ``roberta`` (``RobertaForMaskedLM``), ``opt`` (``OPTForCausalLM``) or ``bert``
            (``BertForMaskedLM``).
        vocab_texts: Extra texts the tokenizer learns whole words from (your prompts, your data),
            added to :func:`default_vocab_texts`.
        seed: Seed of the model's initialisation (the global random state is left untouched).
        max_length: Position embeddings and the tokenizer's ``model_max_length``.

    Returns:
        ``path`` as a string, ready for ``from_pretrained`` or ``model_name_or_path=``.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if isinstance(vocab_texts, str) or not all(isinstance(t, str) for t in vocab_texts or []):
        raise ValueError("vocab_texts must be a list of strings")
    texts = default_vocab_texts() + list(vocab_texts or [])
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tokenizer = _TOKENIZERS[family](texts, max_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _build_model(family, tokenizer, max_length)
    with _quiet_transformers():
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------- tokenizers


def _byte_level_files(texts: Sequence[str], special_tokens: list[str], directory: str) -> None:
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts, vocab_size=4096, min_frequency=1, special_tokens=special_tokens,
                            show_progress=False)
    bpe.save_model(directory)  # vocab.json + merges.txt, the files real RoBERTa / OPT checkpoints ship


def _roberta_tokenizer(texts: Sequence[str], max_length: int) -> Any:
    from tokenizers import AddedToken
    from transformers import RobertaTokenizerFast

    with tempfile.TemporaryDirectory() as directory:
        _byte_level_files(texts, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], directory)
        return RobertaTokenizerFast.from_pretrained(
            directory,
            mask_token=AddedToken("<mask>", lstrip=True, rstrip=False, special=True),
            model_max_length=max_length,
        )


def _opt_tokenizer(texts: Sequence[str], max_length: int) -> Any:
    from transformers import GPT2TokenizerFast

    with tempfile.TemporaryDirectory() as directory:
        _byte_level_files(texts, ["<s>", "<pad>", "</s>", "<unk>"], directory)
        tokenizer = GPT2TokenizerFast.from_pretrained(
            directory,
            bos_token="</s>",  # OPT's convention: every text starts with </s> (id 2), nothing is appended
            eos_token="</s>",
            unk_token="<unk>",
            pad_token="<pad>",
            add_bos_token=True,
            model_max_length=max_length,
        )
    _ensure_bos_prepended(tokenizer)
    return tokenizer


def _ensure_bos_prepended(tokenizer: Any) -> None:
    """Older ``transformers`` ignore ``add_bos_token`` for fast GPT-2 tokenizers: set the template."""
    probe = tokenizer("a")["input_ids"]
    if probe and probe[0] == tokenizer.bos_token_id:
        return
    from tokenizers.processors import TemplateProcessing

    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )


def _bert_tokenizer(texts: Sequence[str], max_length: int) -> Any:
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(
        texts, vocab_size=4096, min_frequency=1, show_progress=False,
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    )
    with tempfile.TemporaryDirectory() as directory:
        wordpiece.save_model(directory)  # vocab.txt
        return BertTokenizerFast.from_pretrained(directory, do_lower_case=True, model_max_length=max_length)


_TOKENIZERS = {"roberta": _roberta_tokenizer, "opt": _opt_tokenizer, "bert": _bert_tokenizer}


# ----------------------------------------------------------------------------- models


def _build_model(family: str, tokenizer: Any, max_length: int) -> Any:
    size = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    if family == "roberta":
        from transformers import RobertaConfig, RobertaForMaskedLM

        config = RobertaConfig(
            **size, intermediate_size=64, type_vocab_size=1,
            max_position_embeddings=max_length + 2,  # RoBERTa's positions start after pad_token_id
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        return RobertaForMaskedLM(config)
    if family == "opt":
        from transformers import OPTConfig, OPTForCausalLM

        config = OPTConfig(
            **size, ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=max_length,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        return OPTForCausalLM(config)
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        **size, intermediate_size=64, max_position_embeddings=max_length,
        pad_token_id=tokenizer.pad_token_id,
    )
    return BertForMaskedLM(config)


__all__ = ["BASE_TEXTS", "FAMILIES", "LABEL_WORDS", "default_vocab_texts", "save_tiny_pretrained"]
