"""TinyMLP and TinyCNN: shapes, contract, input handling, argument checks."""

from __future__ import annotations

import pytest
import torch

from lit_zodp.backbones import TinyCNN, TinyMLP


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_mlp_contract(contract, depth):
    torch.manual_seed(0)
    model = TinyMLP(in_features=64, num_classes=10, hidden=32, depth=depth)
    contract(model, torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,)))


@pytest.mark.parametrize(("channels", "side"), [(1, 8), (1, 28), (3, 32)])
def test_cnn_contract(contract, channels, side):
    torch.manual_seed(0)
    model = TinyCNN(in_channels=channels, num_classes=10, width=4)
    contract(model, torch.randn(5, channels, side, side), torch.randint(0, 10, (5,)))


def test_tiny_models_are_batch_independent_in_train_mode(independent):
    torch.manual_seed(0)
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    for model in (TinyMLP(64, 10), TinyCNN(1, 10, width=4)):
        independent(model.train(), x, y)


def test_cnn_accepts_unbatched_channel_and_flat_inputs():
    model = TinyCNN(in_channels=1, num_classes=3, width=4).eval()
    images = torch.randn(2, 1, 8, 8)
    expected = model(images)
    torch.testing.assert_close(model(images.squeeze(1)), expected)
    torch.testing.assert_close(model(images.flatten(1)), expected)
    assert model(torch.zeros(0, 64)).shape == (0, 3)


def test_integer_and_double_inputs_are_cast():
    model = TinyMLP(4, 2).eval()
    x = torch.arange(8).reshape(2, 4)
    torch.testing.assert_close(model(x), model(x.float()))
    torch.testing.assert_close(model(x.double()), model(x.float()))


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="expects 64 features"):
        TinyMLP(64, 10)(torch.randn(2, 10))
    with pytest.raises(ValueError, match="expects images"):
        TinyCNN(3, 10)(torch.randn(2, 1, 8, 8))


@pytest.mark.parametrize("model, inputs", [(TinyMLP(64, 10), torch.randn(37, 10)),
                                           (TinyCNN(3, 10), torch.randn(37, 1, 8, 8))])
def test_shape_errors_name_the_example_shape_and_no_batch_size(model, inputs):
    """A model/data mismatch on a user's own loader fails at the first private forward: its message names what one
    example looks like, never the realized size of a Poisson batch (a function of the private data; review 17)."""
    with pytest.raises(ValueError) as error:
        model(inputs)
    assert str(tuple(inputs.shape[1:])) in str(error.value) and "37" not in str(error.value)
    with pytest.raises(ValueError, match="square images"):
        TinyCNN(1, 10)(torch.randn(2, 10))


@pytest.mark.parametrize(
    "build",
    [
        lambda: TinyMLP(64, 0),
        lambda: TinyMLP(0, 10),
        lambda: TinyMLP(64, 10, hidden=-1),
        lambda: TinyMLP(64, 10, depth=-1),
        lambda: TinyMLP(64, 10, activation="swish-ish"),
        lambda: TinyCNN(num_classes=0),
        lambda: TinyCNN(width=0),
    ],
)
def test_bad_arguments_raise(build):
    with pytest.raises(ValueError):
        build()
