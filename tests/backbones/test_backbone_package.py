"""Package surface: exports, lazy imports, building backbones from LightningCLI-style configs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import lit_zodp.backbones as backbones


def test_exports_resolve():
    for name in backbones.__all__:
        assert getattr(backbones, name) is not None, name
    assert issubclass(backbones.TimmClassifier, backbones.Backbone)
    assert issubclass(backbones.SentenceEncoderClassifier, backbones.Backbone)


def test_import_does_not_load_timm_or_transformers():
    code = "import sys, lit_zodp.backbones; print('timm' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_module_level_helpers_on_plain_modules():
    model, x, y = torch.nn.Linear(4, 3), torch.randn(5, 4), torch.randint(0, 3, (5,))
    assert backbones.per_example_loss(model, x, y).shape == (5,)
    assert backbones.predict(model, x).shape == (5, 3)


@pytest.mark.parametrize(
    ("class_path", "init_args", "shape"),
    [
        ("lit_zodp.backbones.TinyMLP", {"in_features": 64, "num_classes": 10, "depth": 1}, (2, 1, 8, 8)),
        ("lit_zodp.backbones.TinyCNN", {"in_channels": 3, "width": 4}, (2, 3, 32, 32)),
        (
            "lit_zodp.backbones.TimmClassifier",
            {"model_name": "vit_tiny_patch16_224", "img_size": 32, "patch_size": 4, "num_classes": 10},
            (2, 3, 32, 32),
        ),
    ],
)
def test_build_from_class_path_config(class_path, init_args, shape):
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--model", type=backbones.Backbone)
    config = parser.parse_object({"model": {"class_path": class_path, "init_args": init_args}})
    model = parser.instantiate_classes(config).model
    assert isinstance(model, backbones.Backbone)
    assert model(torch.randn(*shape)).shape == (2, model.num_classes)


def test_build_text_backbone_from_class_path_config(minilm_path):
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--model", type=backbones.Backbone)
    descriptions = ["a negative movie review", ["a positive movie review", "a great film"]]
    init_args = {"model_name_or_path": "minilm", "label_descriptions": descriptions}
    class_path = "lit_zodp.backbones.SentenceEncoderClassifier"
    config = parser.parse_object({"model": {"class_path": class_path, "init_args": init_args}})
    model = parser.instantiate_classes(config).model
    assert model.num_classes == 2 and model.logit_scale == 20.0
