"""TimmClassifier: ViT-tiny at 32x32, BatchNorm freezing, local checkpoints, errors."""

from __future__ import annotations

import pytest
import torch

from lit_zodp.backbones import TimmClassifier
from lit_zodp.backbones.timm_models import load_state_dict_file, load_weights


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    return TimmClassifier("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=4).eval()


def test_vit_tiny_32px_patch4_contract(vit, contract):
    x, y = torch.randn(3, 3, 32, 32), torch.randint(0, 10, (3,))
    assert vit.model.patch_embed.num_patches == 64
    contract(vit, x, y)


def test_efficientnet_lite_keeps_batchnorm_frozen_in_train_mode(independent):
    torch.manual_seed(0)
    model = TimmClassifier("tf_efficientnet_lite0", num_classes=4).train()
    x, y = torch.randn(3, 3, 32, 32), torch.randint(0, 4, (3,))
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    stats = bn.running_mean.clone()
    assert model.training and not bn.training
    independent(model, x, y, atol=1e-4)
    model.per_example_loss(x, y).sum().backward()
    torch.testing.assert_close(bn.running_mean, stats)


@pytest.mark.parametrize("name", ["test_efficientnet", "test_resnet"])
def test_small_batchnorm_models_contract_in_both_modes(contract, independent, name):
    torch.manual_seed(0)
    model = TimmClassifier(name, num_classes=5)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    contract(model, x, y)
    independent(model.train(), x, y)
    assert model.train().per_example_loss(x[:0], y[:0]).shape == (0,)


def test_batchnorm_trains_when_not_frozen():
    model = TimmClassifier("test_resnet", num_classes=2, freeze_batchnorm=False).train()
    assert all(m.training for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))


def _lightning_style(state):
    return {"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}


@pytest.mark.parametrize("wrap", [lambda s: s, _lightning_style])
def test_checkpoint_by_name_skips_a_head_of_another_size(tmp_path, wrap):
    source = TimmClassifier("test_resnet", num_classes=1000)
    path = tmp_path / "weights.pth"
    torch.save(wrap(source.model.state_dict()), path)
    model = TimmClassifier("test_resnet", num_classes=7, checkpoint_path=str(path))
    torch.testing.assert_close(model.model.conv1[0].weight, source.model.conv1[0].weight)
    assert model.model.fc.weight.shape == (7, model.model.fc.in_features)


def test_checkpoint_with_other_names_loads_by_position(tmp_path):
    """Files in another layout (e.g. efficientnet_lite_pytorch's ``_conv_stem``) load by position."""
    source = TimmClassifier("tf_efficientnet_lite0", num_classes=1000)
    state = source.model.state_dict()
    renamed = {f"_renamed_{i}.{k.rsplit('.', 1)[-1]}": v for i, (k, v) in enumerate(state.items())}
    path = tmp_path / "lite0.pth"
    torch.save(renamed, path)
    model = TimmClassifier("tf_efficientnet_lite0", num_classes=10, checkpoint_path=str(path))
    torch.testing.assert_close(model.model.conv_stem.weight, source.model.conv_stem.weight)
    torch.testing.assert_close(model.model.bn2.running_var, source.model.bn2.running_var)
    assert model.model.classifier.weight.shape == (10, 1280)


def test_safetensors_checkpoint(tmp_path):
    from safetensors.torch import save_file

    source = TimmClassifier("test_resnet", num_classes=3)
    save_file(source.model.state_dict(), str(tmp_path / "w.safetensors"))
    model = TimmClassifier("test_resnet", num_classes=3, checkpoint_path=str(tmp_path / "w.safetensors"))
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model.eval()(x), source.eval()(x))


def test_checkpoint_of_another_model_is_rejected(tmp_path):
    path = str(tmp_path / "w.pth")
    torch.save(TimmClassifier("test_resnet", num_classes=3).model.state_dict(), path)
    with pytest.raises(ValueError, match="does not fit|cannot be matched|do not match"):
        TimmClassifier("vit_tiny_patch16_224", img_size=32, patch_size=4, checkpoint_path=path)


def test_load_state_dict_file_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_state_dict_file(tmp_path / "missing.pth")
    torch.save({"epoch": 3}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="no state dict"):
        load_state_dict_file(tmp_path / "bad.pth")


def test_load_weights_returns_skipped_head():
    source, target = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 5)), torch.nn.Sequential(
        torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)
    )
    skipped = load_weights(target, source.state_dict(), head_keys={"1.weight", "1.bias"})
    assert skipped == ["1.weight", "1.bias"]
    torch.testing.assert_close(target[0].weight, source[0].weight)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model_name": "vit_tinyest_patch16"}, "unknown timm model"),
        ({"num_classes": 0}, "num_classes"),
        ({"drop_rate": 1.5}, "drop_rate"),
        ({"img_size": 0}, "img_size"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TimmClassifier(**kwargs)


def test_data_config(vit):
    assert vit.data_config["input_size"] == (3, 32, 32)
