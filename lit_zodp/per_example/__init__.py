"""Per-example gradients, one flat clip, one sum: the engine shared by the DP-SGD-style algorithms.

* :class:`PerExampleGradientEngine`, :class:`ClippedSum` and :class:`MicroBatch` (:mod:`.engine`): modes "hooks",
  "ghost" and "vmap", micro-batching;
* the transform slot (:mod:`.transforms`): :class:`GradientTransform`, :class:`Projection`
  (projected rows, never ``B x out x in``), :class:`Projections`;
* per-layer rules registered by layer type, :func:`register_sampler` / :func:`sampler_for`
  (:mod:`.samplers`: Linear, Embedding, LayerNorm, GroupNorm, RMSNorm; :mod:`.conv`: Conv1d/2d);
* ghost norms (:mod:`.ghost`), the recording hooks (:mod:`.tape`), the coverage check
  (:mod:`.coverage`), refusals (:mod:`.checks`);
* the torch.func reference :func:`per_example_gradients_vmap` and the fallback (:mod:`.reference`).
"""

from lit_zodp.per_example.engine import ClippedParts, ClippedSum, MicroBatch, PerExampleGradientEngine
from lit_zodp.per_example.reference import per_example_gradients_vmap
from lit_zodp.per_example.samplers import register_sampler, sampler_for
from lit_zodp.per_example.transforms import GradientTransform, Projection, Projections

__all__ = [
    "ClippedParts",
    "ClippedSum",
    "GradientTransform",
    "MicroBatch",
    "PerExampleGradientEngine",
    "Projection",
    "Projections",
    "per_example_gradients_vmap",
    "register_sampler",
    "sampler_for",
]
