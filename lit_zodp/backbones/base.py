"""The backbone contract every algorithm relies on.

A batch is ``(inputs, targets)``: ``inputs`` is a tensor or a dict of tensors (tokenized text) whose
leading dimension is the batch (it may be 0 under Poisson sampling), ``targets`` a LongTensor.
A backbone maps ``inputs`` to logits and gives one loss per example; ZO algorithms only ever need
the per-example losses, evaluation needs the predictions.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_zodp.errors import ConfigError, PrivacyConfigError
from lit_zodp.per_example.ghost import at_least_float32

Inputs = Union[Tensor, Mapping[str, Tensor]]


def batch_size_of(inputs: Inputs) -> int:
    """Leading dimension of a tensor or of the first tensor of a dict."""
    if isinstance(inputs, Tensor):
        return inputs.shape[0]
    return next(iter(inputs.values())).shape[0]


class Backbone(nn.Module):
    """Base class: subclasses implement ``forward(inputs) -> logits [B, num_classes]``.

    Override :meth:`per_example_loss` or :meth:`predict` for heads that are not plain
    classification (prompt-based scoring, for example).
    """

    num_classes: int
    #: Whether the model's own forwards hold several rows per example (an example's K candidates):
    #: the per-example gradient engine, which takes row ``i`` of a call for example ``i``, refuses it.
    several_rows_per_example: bool = False
    #: Set by ``fixed_forward_rows``: a computation whose shape would depend on several rows of a forward
    #: (e.g. a head over the candidate tokens of all rows) runs row by row instead, so each example's
    #: value is computed the same way whatever its batch-mates (:mod:`lit_zodp.privacy.fixed_shape`).
    row_shapes: bool = False
    #: Options this backbone and its data module both hold under the same name and must agree on (the planted
    #: signal's seed of :class:`~lit_zodp.backbones.phase_retrieval.PhaseRetrievalLoss`): a differing value is
    #: refused at setup in one line (:func:`shared_option_mismatch`); a data module without the option is not checked.
    shared_data_options: tuple[str, ...] = ()

    def data_mismatch(self, *, text: bool, example_shape: Optional[tuple[int, ...]]) -> Optional[str]:
        """Why this backbone cannot read the data module's inputs (``text``: tokenized text; ``example_shape``: one
        example's tensor shape, where the data module declares it), or ``None``. Read at setup, from the data module's
        configuration only, so a mismatch is one line before the first step (review 28): before, it was a traceback
        from the first forward, and one at a private step printed the realized Poisson batch size."""
        return None

    def per_example_loss(self, inputs: Inputs, targets: Tensor) -> Tensor:
        """Cross-entropy of each example, shape ``[B]`` (no reduction), in at least float32 (:func:`loss_logits`)."""
        return F.cross_entropy(loss_logits(self(inputs)), targets, reduction="none")

    def predict(self, inputs: Inputs) -> Tensor:
        """Class scores ``[B, num_classes]`` used for accuracy."""
        return self(inputs)

    def evaluation_metrics(self) -> Optional[dict[str, Any]]:
        """The metrics validation and test log instead of cross-entropy and accuracy, by name (torchmetrics
        ``Metric`` objects, new ones at each call: the module makes one set per stage and logs them as
        ``val_<name>`` / ``test_<name>``), or ``None``: a classifier's ``loss`` and ``acc``. A backbone that
        returns metrics fills them in :meth:`update_evaluation` (e.g. the synthetic quadratic's exact gradient
        norm, :class:`~lit_zodp.backbones.quadratic.QuadraticLoss`)."""
        return None

    def update_evaluation(self, metrics: Mapping[str, Any], inputs: Inputs, targets: Tensor) -> None:
        """Update :meth:`evaluation_metrics`' ``metrics`` with one evaluation batch (no grad)."""
        raise NotImplementedError(f"{type(self).__name__} returns evaluation_metrics but does not update them")


def loss_logits(logits: Tensor) -> Tensor:
    """``logits`` in at least float32 for the loss. A 16-bit model's cross-entropy was rounded to its dtype (a loss
    near 2.3 to a step of 0.016 in bfloat16), and a zeroth-order step divides the difference of two such losses by
    ``2 lam``: at ``lam`` 1e-3 each example's central difference moved in steps of 7.8, with an error of 0.50 of the
    derivatives' rms on a digits MLP (0.27 from the same bfloat16 logits in float32; review 30). The first-order
    backward casts the gradient back at the logits."""
    return at_least_float32(logits)


def per_example_loss(model: nn.Module, inputs: Inputs, targets: Tensor, *, total: bool = False,
                     classes: Optional[int] = None) -> Tensor:
    """Per-example losses of any module, shape ``[B]``: its own rule if it is a :class:`Backbone`, else
    cross-entropy. Each value is clipped as one example's contribution, so any other shape (per-token
    losses ``[B, L]``: L clipped values per example, L times the sensitivity) is refused.

    ``total`` (private steps, review 21): a class target outside ``0..C-1`` (``C``: the model's declared classes,
    else ``classes``, else its logits' width) gives its row a NaN loss, which a private step counts as zero like
    any non-finite value; the model never sees it. Before, cross-entropy raised ``IndexError: Target 7 is out of
    bounds`` (on a GPU, a device assert) at the first Poisson batch that sampled the row: whether and when a fit
    failed, and its message, told of one private label."""
    classes = label_classes(model, classes) if total else None
    valid, targets = _valid_targets(targets, classes)
    if hasattr(model, "per_example_loss"):
        losses = model.per_example_loss(inputs, targets)
    else:
        logits = call_model(model, inputs)
        if total and valid is None and isinstance(logits, Tensor) and logits.dim() == 2:
            valid, targets = _valid_targets(targets, logits.shape[-1])
        losses = F.cross_entropy(loss_logits(logits), targets, reduction="none")
    check_one_loss_per_example(losses, len(targets), type(model).__name__)
    return losses if valid is None else torch.where(valid.to(losses.device), losses, torch.nan)


def _valid_targets(targets: Tensor, classes: Optional[int]) -> tuple[Optional[Tensor], Tensor]:
    """Which class targets ``[B]`` lie in ``0..classes-1``, and the targets with the others set to 0 (no host sync);
    ``(None, targets)`` where no number of classes is known or the targets are not class indices."""
    if not classes or not are_class_indices(targets):
        return None, targets
    valid = (targets >= 0) & (targets < classes)
    return valid, torch.where(valid, targets, torch.zeros_like(targets))


def label_classes(model: nn.Module, classes: Optional[int] = None) -> Optional[int]:
    """``C`` of the class targets ``0..C-1`` a private step checks: the model's declared classes, else ``classes``."""
    return num_classes_of(model) or classes


def are_class_indices(targets: Tensor) -> bool:
    """Whether ``targets`` are one class index per row (1-D integers), which a number of classes bounds."""
    dtype = targets.dtype
    return targets.dim() == 1 and not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_one_loss_per_example(losses: Any, size: int, owner: str) -> None:
    """Raise :class:`PrivacyConfigError` unless ``losses`` is a tensor of shape ``[size]``. The message names no size:
    a Poisson batch's realized size, and its padded length, are functions of the private data (red-team review 17)."""
    if isinstance(losses, Tensor) and tuple(losses.shape) == (size,):
        return
    got = (f"are a {losses.dim()}-D tensor" + (" of another length" if losses.dim() == 1 else "")
           if isinstance(losses, Tensor) else f"are a {type(losses).__name__}")
    raise PrivacyConfigError(
        f"The per-example losses of {owner} {got}, but a batch of B examples needs one loss per example, [B]: "
        f"reduce per-token (or per-row) losses to one value per example in its `per_example_loss`, since each "
        f"value is clipped as one example's whole contribution")


def tensor_data_mismatch(backbone: nn.Module, text: bool, channels: Optional[tuple[str, int]] = None,
                         example_shape: Optional[tuple[int, ...]] = None) -> Optional[str]:
    """The mismatch of a backbone that reads tensors: with tokenized text, or with images of other channels than its
    ``channels`` (the option's name and value)."""
    name = type(backbone).__name__
    if text:
        return (f"the backbone {name} reads tensors, but the data module gives tokenized text: use a text backbone "
                "(e.g. SentenceEncoderClassifier, HFSequenceClassifier), or, if its inputs are tensors, declare their "
                "shape as the data module's `example_shape`")
    if channels is not None and example_shape is not None and len(example_shape) == 3 \
            and example_shape[0] != channels[1]:
        return (f"the backbone {name} has `{channels[0]}` {channels[1]}, but the data's images have shape "
                f"{tuple(example_shape)}: set `{channels[0]}: {example_shape[0]}`")
    return None


def shared_option_mismatch(backbone: nn.Module, datamodule: Any) -> Optional[str]:
    """The first of the backbone's ``shared_data_options`` that the data module holds with another value, as one
    line, or ``None``."""
    _missing = object()
    for name in getattr(backbone, "shared_data_options", ()):
        ours, theirs = getattr(backbone, name), getattr(datamodule, name, _missing)
        if theirs is not _missing and theirs != ours:
            return (f"the backbone {type(backbone).__name__} has `{name}` {ours!r}, but the data module has "
                    f"`{name}` {theirs!r}: set the same `{name}` on both")
    return None


def text_backbone_mismatch(backbone: nn.Module, text: bool, example_shape: Optional[tuple[int, ...]]) -> Optional[str]:
    """The mismatch of a backbone that reads tokenized text with a data module of tensors."""
    if text or example_shape is None:
        return None
    return (f"the backbone {type(backbone).__name__} reads tokenized text, but the data module gives tensors of shape "
            f"{tuple(example_shape)}: use a text data module (e.g. MovieReviewsDataModule) or a tensor backbone "
            "(TinyMLP, TinyCNN, TimmClassifier)")


def predict(model: nn.Module, inputs: Inputs) -> Tensor:
    if hasattr(model, "predict"):
        return model.predict(inputs)
    return call_model(model, inputs)


def call_model(model: nn.Module, inputs: Inputs) -> Tensor:
    """The logits of a plain module called on a tensor, or with keyword arguments for a dict of tensors
    (:func:`logits_of` its output)."""
    output = model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
    return logits_of(output, type(model).__name__)


def logits_of(output: Any, owner: str) -> Tensor:
    """A plain module's logits: its output tensor, or the ``logits`` of a Hugging Face ``ModelOutput`` or a dict (a
    ``transformers`` or ``peft`` model passed as the backbone). Any other output is refused in one line; before,
    a ``SequenceClassifierOutput`` failed the first private step with ``AttributeError: ... 'is_floating_point'``
    (review 34)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("logits"), Tensor):
        return output["logits"]
    raise ConfigError(
        f"The backbone {owner} returned a {type(output).__name__}, but a module that is not a Backbone must return "
        "its logits [B, classes]: a tensor, or a ModelOutput or dict holding `logits` (or subclass Backbone and "
        "override `per_example_loss` and `predict`)")


def num_classes_of(model: nn.Module) -> int | None:
    """The number of output classes a model declares, if any."""
    for attr in ("num_classes", "num_labels"):
        value = getattr(model, attr, None)
        if isinstance(value, int):
            return value
    config = getattr(model, "config", None)
    return getattr(config, "num_labels", None)


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


__all__ = [
    "Backbone",
    "Inputs",
    "batch_size_of",
    "call_model",
    "count_parameters",
    "num_classes_of",
    "per_example_loss",
    "predict",
]
