"""Backbones that map a batch's inputs to logits and per-example losses (see :mod:`.base`).

The timm and Hugging Face adapters, NFResNet18, and the synthetic problems (quadratic, phase retrieval:
torchmetrics), are imported on first use (``lit_zodp.backbones.TimmClassifier`` works as usual, also as a
LightningCLI ``class_path``), so importing this package stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lit_zodp.backbones.base import (
    Backbone,
    Inputs,
    batch_size_of,
    call_model,
    count_parameters,
    num_classes_of,
    per_example_loss,
    predict,
)
from lit_zodp.backbones.tiny import TinyCNN, TinyMLP

if TYPE_CHECKING:  # pragma: no cover
    from lit_zodp.backbones.generation import HFAnswerGenerator
    from lit_zodp.backbones.huggingface import (
        SENTIMENT_LABEL_DESCRIPTIONS,
        HFCandidateScorer,
        HFPromptClassifier,
        HFSequenceClassifier,
        SentenceEncoderClassifier,
        load_tokenizer,
        resolve_model_path,
        tiny_bert_config,
    )
    from lit_zodp.backbones.lstm import LSTMClassifier
    from lit_zodp.backbones.nfresnet import NFResNet18
    from lit_zodp.backbones.phase_retrieval import PhaseRetrievalLoss
    from lit_zodp.backbones.quadratic import QuadraticLoss
    from lit_zodp.backbones.timm_models import TimmClassifier
    from lit_zodp.backbones.tiny_hf import save_tiny_pretrained

_LAZY = {
    "LSTMClassifier": "lit_zodp.backbones.lstm",
    "NFResNet18": "lit_zodp.backbones.nfresnet",
    "PhaseRetrievalLoss": "lit_zodp.backbones.phase_retrieval",
    "QuadraticLoss": "lit_zodp.backbones.quadratic",
    "TimmClassifier": "lit_zodp.backbones.timm_models",
    "HFAnswerGenerator": "lit_zodp.backbones.generation",
    "HFCandidateScorer": "lit_zodp.backbones.huggingface",
    "HFPromptClassifier": "lit_zodp.backbones.huggingface",
    "HFSequenceClassifier": "lit_zodp.backbones.huggingface",
    "SentenceEncoderClassifier": "lit_zodp.backbones.huggingface",
    "SENTIMENT_LABEL_DESCRIPTIONS": "lit_zodp.backbones.huggingface",
    "load_tokenizer": "lit_zodp.backbones.huggingface",
    "resolve_model_path": "lit_zodp.backbones.huggingface",
    "tiny_bert_config": "lit_zodp.backbones.huggingface",
    "save_tiny_pretrained": "lit_zodp.backbones.tiny_hf",
}


def __getattr__(name: str) -> Any:
    """Import the timm / Hugging Face adapters on first access."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Backbone",
    "HFAnswerGenerator",
    "HFCandidateScorer",
    "HFPromptClassifier",
    "HFSequenceClassifier",
    "Inputs",
    "LSTMClassifier",
    "NFResNet18",
    "PhaseRetrievalLoss",
    "QuadraticLoss",
    "SENTIMENT_LABEL_DESCRIPTIONS",
    "SentenceEncoderClassifier",
    "TimmClassifier",
    "TinyCNN",
    "TinyMLP",
    "batch_size_of",
    "call_model",
    "count_parameters",
    "load_tokenizer",
    "num_classes_of",
    "per_example_loss",
    "predict",
    "resolve_model_path",
    "save_tiny_pretrained",
    "tiny_bert_config",
]
