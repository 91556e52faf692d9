"""Reference computations for the per-example engine tests (float64 throughout)."""

from __future__ import annotations

import copy
import math
import os
import warnings
import weakref

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from lit_zodp.per_example import PerExampleGradientEngine, per_example_gradients_vmap  # noqa: E402
from lit_zodp.privacy.clipping import SHARE_MARGIN  # noqa: E402

RTOL = 1e-6


def assert_rel_close(actual, expected, rtol=RTOL, name=""):
    """``||actual - expected|| <= rtol * ||expected||`` (plus a floor for exactly-zero gradients)."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    err = (actual - expected).norm().item()
    assert err <= rtol * expected.norm().item() + 1e-12, f"{name}: error {err:.3e}, norm {expected.norm().item():.3e}"


def engine_per_example(model, loss_fn, mode="hooks", recomputed=None):
    """``{name: [B, *shape]}`` from the engine (unclipped), checking ``{parameter: module}`` of
    the vmap fallback (in "vmap" mode: every parameter on the whole module), so that a broken
    layer rule cannot hide behind the fallback."""
    engine = PerExampleGradientEngine(model, mode=mode)
    grads = dict(zip(engine.names, engine.per_example_gradients(loss_fn)))
    expected = {n: "" for n in engine.names} if mode == "vmap" else (recomputed or {})
    assert engine.last_recomputed == expected, engine.last_recomputed
    return grads


def assert_grads_match(actual: dict, expected: dict, rtol=RTOL):
    assert set(actual) == set(expected), set(actual) ^ set(expected)
    for name in expected:
        assert_rel_close(actual[name], expected[name], rtol, name)


def reference(model, loss_of_one, *batch):
    """The torch.func reference, for the trainable parameters."""
    return per_example_gradients_vmap(model, loss_of_one, *batch)


def loop_reference(model, loss_of_one, *batch):
    """Per-example gradients by one backward per example (for forwards vmap cannot run, e.g.
    Hugging Face attention masks with data-dependent checks)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for i in range(batch[0].shape[0]):
        loss = loss_of_one(*(t[i:i + 1] for t in batch))
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for (_, p), g in zip(named, grads)])
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(named)}


def flat_clipped_sum(per_example: dict, names, clip):
    """DP-SGD flat clipping (Abadi et al. 2016): clip each example's concatenated gradient to ``clip``, less the
    library's rounding margin (``SHARE_MARGIN``, audit 14 H1)."""
    flat = torch.cat([per_example[n].reshape(len(per_example[n]), -1) for n in names], 1)
    norms = flat.norm(dim=1)
    factors = torch.ones_like(norms) if math.isinf(clip) else (clip * (1 - SHARE_MARGIN) / norms).clamp(max=1)
    sums = {n: torch.einsum("b,b...->...", factors, per_example[n]) for n in names}
    return sums, norms


def opacus_per_example(model, loss_fn_of):
    """Opacus' ``grad_sample`` (train mode, summed loss) for a copy of ``model``.

    ``loss_fn_of(wrapped)`` runs the wrapped model and returns the per-example losses.
    """
    from opacus import GradSampleModule

    clone = copy.deepcopy(model).train()
    wrapped = GradSampleModule(clone, loss_reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_fn_of(wrapped).sum().backward()
    return {n: p.grad_sample for n, p in clone.named_parameters() if p.requires_grad}


def tiny_vit(seed=0):
    import timm

    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8,
                             depth=1, num_classes=3, embed_dim=24, num_heads=2).double()


def tiny_bert(seed=0, dropout=0.0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16,
                                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return transformers.BertForSequenceClassification(config).double()


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def ce(logits, targets):
    return F.cross_entropy(logits, targets, reduction="none")


class LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an op allocates (a view allocates nothing)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


class LiveLarge(TorchDispatchMode):
    """The most buffers of at least ``numel`` elements that ops produced and that were alive at
    once, as ``{buffer: op}`` (a buffer dies with the last tensor on it, wherever autograd or the
    engine keeps it; an in-place result or a ``detach`` shares its input's buffer)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.tensors, self.alive, self.most = numel, {}, {}, {}

    def _died(self, key):
        self.tensors[key] -= 1
        if not self.tensors[key]:
            del self.tensors[key], self.alive[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                key = t.untyped_storage().data_ptr()
                self.alive.setdefault(key, str(func))
                self.tensors[key] = self.tensors.get(key, 0) + 1
                weakref.finalize(t, self._died, key)
                self.most = max(self.most, dict(self.alive), key=len)
        return out
