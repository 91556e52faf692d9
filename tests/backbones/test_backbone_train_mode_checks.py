"""The independence checks in training mode on a real text backbone with dropout (audit 8)."""

import warnings

import pytest
import torch

from lit_zodp.algorithms import DPSGD


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_minilm_with_dropout_passes_the_training_mode_checks_without_falling_back(minilm_path, text_batch, mode):
    """MiniLM's hidden and attention dropout (p = 0.1) are taken at their mean, so the halves reproduce the
    whole batch in training mode: no refusal, and no warning that the checks fell back to eval mode."""
    from lit_zodp.backbones import HFSequenceClassifier

    inputs, targets = text_batch
    backbone = HFSequenceClassifier("minilm", num_classes=2)
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in backbone.modules())
    module = DPSGD(backbone, clip=1.0, noise_multiplier=1.0, delta=1e-5, lr=1e-3, grad_mode=mode,
                   recheck_probability=1.0).train()
    module._recheck_pending = True
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*compared it in eval mode")
        module.run_independence_checks(inputs, targets)  # the losses, in the step's mode
        module._recheck_pending = True
        result = module.private_gradient(inputs, targets)  # and the engine's recomputed calls
    assert backbone.training and result.batch_size == len(targets)
