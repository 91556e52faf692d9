"""MeZO-BCD (Park et al., "Elucidating Subspace Perturbation in Zeroth-Order Optimization: Theory and
Practice at Scale", Sec. 4, App. D and G): block-coordinate zeroth-order fine-tuning, Algorithms 1-5,
and its private variant.

One block ``B_j`` of the parameters is perturbed and updated per step; the two forwards use the
full model. The block's direction ``u ~ N(0, I_|B_j|)`` is a subset of the engine's layout: the
chunked engine gets one :class:`~lit_zodp.zo.PerturbationEngine` per block, the fused one a
:class:`~lit_zodp.zo.fused.FusedPerturbation` per block at the block's GLOBAL offsets, so with the
fused engine an element's direction does not depend on how the model is split into blocks.

Choices where the paper is silent or ambiguous:

* Private variant (``DPMeZOBCD``) is OURS: the paper has no differential privacy. Each example's
  central difference along ``e_Bj(u)`` is clipped to ``C``, the clipped sum gets one Gaussian scalar
  and is divided by the expected batch size, exactly DPZero's release and accounting (the same step
  plan). The block index ``j``, the seed and ``u`` are public (run seed and step); the adaptive
  scores and the Adam moments only read released values (post-processing).
* Blocks (App. D.1): ``partition="layer"`` counts embeddings, each layer, and head + final norm (the
  paper reports N = 27 for OPT-1.3B, which suggests a split of the embeddings it does not describe;
  here N = 26). See :mod:`lit_zodp.zo.blocks`.
* Random order (Alg. 3): ``pi`` is never initialised before ``t = N`` in the paper; ``pi_0`` is drawn
  at the start. Orders and adaptive draws come from the public run seed.
* Adaptive selection (Alg. 4): the text calls the score a "projected gradient norm" while the
  pseudo-code uses the signed projected gradient: ``adaptive_score="abs"`` (default) or ``"signed"``.
  The warm-up follows the pseudo-code (ascending order), not the text's "random cycle"
  (``warmup_order``).
* Block intervals (Alg. 5): ``steps_per_block = nu`` consecutive steps on one block (default 1 for
  SGD, 50 for Adam); the Adam state lives on the active block only and is reset when an interval ends.
* Weight decay (``weight_decay``, 2+-dimensional tensors) shrinks the active block only, like the
  update: each parameter decays on the steps its block is active.
* Block learning rates (``block_lr``, OURS): the paper uses one ``eta`` for every block (Alg. 1
  line 11), ``block_lr="uniform"`` (default). Its block estimate's second moment grows with the block
  size, ``(|B_j| + 2) ||grad_Bj||^2`` (Sec. 3), and App. D.1 adapts ``eta`` to the partition's
  granularity; ``block_lr="size"`` does the same per block: ``eta_j = eta * min(1, median_k |B_k| /
  |B_j|)``, so a block larger than the median (a vocabulary-sized embedding: 6.7x a layer in MiniLM)
  takes no larger ``eta_j |B_j|`` than a median block; the others keep ``eta``. A list of ``N``
  positive factors sets ``eta_j = eta * factor_j`` directly, in the partition's order (input first):
  e.g. lower rates for the blocks holding most of the curvature (``benchmarks/diagnose_bcd_blocks.py``
  measures each block's share). Each block's rate is its own param group (schedulers scale them all).
  ``block_lr="curvature"`` is the ``size`` rule with the size replaced by the block's Hessian trace
  (a block's size is the trace of an isotropic Hessian, and a ZO step on ``B_j`` injects noise in
  proportion to ``eta_j^2 tr(H_BjBj)``: the expansion in ``benchmarks/diagnose_bcd_blocks.py``):
  ``eta_j = eta * min(1, median_k tr(H_kk) / tr(H_jj))``. At fit start each ``tr(H_jj)`` is
  estimated with forwards only, by the second difference of the batch mean loss along
  ``u ~ N(0, I_|B_j|)`` at the step's ``lam`` (``curvature_probes`` directions per block on each of
  ``curvature_batches`` batches; the directions are public). The probe reads the training data in
  ``MeZOBCD`` and the DataModule's PUBLIC split in ``DPMeZOBCD`` (a rate set from private data would
  be a release the accountant does not see); the factors are kept in checkpoints, so a resumed run
  keeps its rates.

Speed (ours, not the paper's): on CPU, the chunked engine keeps the active block's direction in a
:class:`~lit_zodp.zo.perturbation.DirectionCache` (``cache_direction``), drawing ``u`` once per step
instead of three times (bitwise the same ``u``); it costs one float32 copy of the largest block. The
fused GPU engine draws ``u`` in registers and uses no cache.
"""

from __future__ import annotations

import math
import time
from functools import partial
from itertools import islice
from typing import Any, Iterable, Optional, Union

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lit_zodp.algorithms.dpzero import DPZero
from lit_zodp.backbones.base import batch_size_of
from lit_zodp.errors import (ConfigError, PrivacyConfigError, check_choice, check_positive, check_positive_int,
                             raise_if_any)
from lit_zodp.privacy import PrivateBatchSampler, clipped_fraction
from lit_zodp.zo import derive_seed, second_differences
from lit_zodp.zo.blocks import (
    ORDERS,
    PARTITIONS,
    BlockPerturbation,
    groups_at_block_rates,
    median_rate_factors,
    partition,
    sample_block,
    softmax_probabilities,
    update_block_idx,
)
from lit_zodp.zo.fused import global_offsets
from lit_zodp.zo.perturbation import DirectionCache

SELECTIONS = ("order", "adaptive")
BLOCK_OPTIMIZERS = ("sgd", "adam")
BLOCK_LRS = ("uniform", "size", "curvature")
#: Spawn key of the curvature probe's (public) directions.
CURVATURE_STREAM = 0xB0E
ADAPTIVE_SCORES = ("abs", "signed")


class DPMeZOBCD(DPZero):
    """Private MeZO-BCD (ours; the paper has no DP variant): Alg. 1 with DPZero's clipped, noised scalar.

    Each step t:
      Alg. 1 line 2   seed s (public: run seed and t); the private batch is Poisson-sampled;
      Alg. 1 line 3   j = UpdateBlockIdx(order, t, N) (Alg. 3), or j ~ softmax(zbar / tau) (Alg. 4);
      Alg. 1 l. 4-7   theta_Bj += lam u; l+_i; theta_Bj -= 2 lam u; l-_i  (per example, full model);
      ours            pg = (sum_i clip_C((l+_i - l-_i) / (2 lam)) + N(0, (sigma C)^2)) / B;
      Alg. 1 l. 9-12  theta_Bj -= lr * pg * u  (the restore +lam u is fused in), or Adam (Alg. 5).

    Args (besides :class:`~lit_zodp.algorithms.ZerothOrderModule`'s):
        partition: ``"layer"`` (App. D.1 default) or ``"linear"``.
        layers_per_block: k consecutive layers per block (the paper's multi-layer: 2).
        order: Alg. 3's ``"ascending"``, ``"descending"``, ``"flip_flop"`` or ``"random"`` (default,
            the paper's best in Table 4).
        selection: ``"order"`` (Alg. 1-3) or ``"adaptive"`` (Alg. 4).
        warmup_steps: Alg. 4's ``T_warm`` in block intervals; ``None``: ``10 N``.
        warmup_order: the order during the warm-up (Alg. 4: ``"ascending"``).
        ema_decay: Alg. 4's ``alpha`` (0.1).
        temperature: Alg. 4's ``tau`` (1.0).
        adaptive_score: ``"abs"`` (the text's norm) or ``"signed"`` (the pseudo-code's value).
        block_optimizer: ``"sgd"`` (Alg. 1) or ``"adam"`` (Alg. 5).
        steps_per_block: Alg. 5's ``nu``; ``None``: 1 for SGD, 50 for Adam.
        betas, adam_eps: Adam's ``(beta1, beta2)`` and ``epsilon`` (0.9, 0.999, 1e-8).
        cache_direction: keep the active block's ``u`` between the passes of a step (one draw instead
            of three; memory: the largest block in float32). ``None``: on with the chunked (CPU)
            engine, off with the fused one, which ignores it.
        block_lr: ``"uniform"`` (the paper: ``lr`` for every block), ``"size"`` (ours:
            ``lr * min(1, median block size / |B_j|)``), ``"curvature"`` (ours: ``lr * min(1, median
            tr(H_kk) / tr(H_jj))``, estimated at fit start), or one positive factor per block (ours:
            ``lr * factor_j``, input first); see the module docstring.
        curvature_batches, curvature_probes: ``block_lr="curvature"``'s probe: batches, and directions
            per block and batch (forwards: ``batches * (1 + 2 * probes * N)``).
    """

    non_private_twin = "MeZOBCD"

    def __init__(self, backbone: nn.Module, *, partition: str = "layer", layers_per_block: int = 1,
                 order: str = "random", selection: str = "order", warmup_steps: Optional[int] = None,
                 warmup_order: str = "ascending", ema_decay: float = 0.1, temperature: float = 1.0,
                 adaptive_score: str = "abs", block_optimizer: str = "sgd",
                 steps_per_block: Optional[int] = None, betas: tuple[float, float] = (0.9, 0.999),
                 adam_eps: float = 1e-8, cache_direction: Optional[bool] = None,
                 block_lr: Union[str, list[float]] = "uniform", curvature_batches: int = 16,
                 curvature_probes: int = 2, **kwargs: Any) -> None:
        raise_if_any([
            check_choice("partition", partition, PARTITIONS),
            check_positive_int("layers_per_block", layers_per_block),
            None if partition != "linear" or layers_per_block == 1 else
            f"`partition='linear'` splits layers; it takes no `layers_per_block` (got {layers_per_block})",
            check_choice("order", order, ORDERS),
            check_choice("selection", selection, SELECTIONS),
            None if warmup_steps is None or warmup_steps == 0 else check_positive_int("warmup_steps", warmup_steps),
            check_choice("warmup_order", warmup_order, ORDERS),
            None if 0 < ema_decay <= 1 else f"Expected `ema_decay` in (0, 1], but got {ema_decay!r}",
            check_positive("temperature", temperature),
            check_choice("adaptive_score", adaptive_score, ADAPTIVE_SCORES),
            check_choice("block_optimizer", block_optimizer, BLOCK_OPTIMIZERS),
            None if steps_per_block is None else check_positive_int("steps_per_block", steps_per_block),
            None if len(betas) == 2 and all(0 <= b < 1 for b in betas) else
            f"Expected `betas` two floats in [0, 1), but got {betas!r}",
            check_positive("adam_eps", adam_eps),
            _check_block_lr(block_lr),
            check_positive_int("curvature_batches", curvature_batches),
            check_positive_int("curvature_probes", curvature_probes),
        ])
        super().__init__(backbone, **kwargs)
        self.partition, self.layers_per_block, self.order = partition, layers_per_block, order
        self.selection, self.warmup_steps, self.warmup_order = selection, warmup_steps, warmup_order
        self.ema_decay, self.temperature, self.adaptive_score = ema_decay, temperature, adaptive_score
        self.block_optimizer = block_optimizer
        self.steps_per_block = steps_per_block or (50 if block_optimizer == "adam" else 1)
        self.betas, self.adam_eps = (float(betas[0]), float(betas[1])), adam_eps
        self.cache_direction = cache_direction
        self.block_lr = block_lr if isinstance(block_lr, str) else [float(f) for f in block_lr]
        self.curvature_batches, self.curvature_probes = curvature_batches, curvature_probes
        self.curvature_factors: Optional[list[float]] = None  # block_lr="curvature": set at fit start
        self.block_curvature: Optional[dict] = None           # the probe's estimates (logs, checkpoints)
        self.block_names = [b.name for b in self.blocks()]
        if not isinstance(block_lr, str) and len(block_lr) != len(self.block_names):
            raise_if_any([f"Expected `block_lr` to hold one factor per block ({len(self.block_names)}: "
                          f"{', '.join(self.block_names)}), but got {len(block_lr)}"])
        self.block_scores = [0.0] * len(self.block_names)    # Alg. 4 line 1: zbar_0 = 0
        self.active_block: Optional[int] = None              # j (1-based) of the current interval
        self.adam_state: Optional[dict[str, list[Tensor]]] = None

    # ----------------------------------------------------------------------------- blocks
    def blocks(self):
        """The partition ``{B_i}_{i=1..N}`` of the trainable parameters, input first (App. D.1)."""
        return partition(self.backbone, self.partition, self.layers_per_block)

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    def perturbed_share(self) -> float:
        """One block of ``N`` per step: a parameter is perturbed on about ``1 / N`` of the steps."""
        return 1.0 / self.num_blocks

    def block_lr_factors(self) -> list[float]:
        """``eta_j / eta`` per block: 1 (``"uniform"``), ``min(1, median_k |B_k| / |B_j|)`` (``"size"``;
        the lower median for an even number of blocks), the same of the traces (``"curvature"``, once
        estimated), or the given factors."""
        if not isinstance(self.block_lr, str):
            return list(self.block_lr)
        if self.block_lr == "curvature":
            if self.curvature_factors is None:
                raise RuntimeError("block_lr='curvature': the rates are estimated when a fit starts "
                                   "(configure_optimizers), or by calibrate_block_rates(batches)")
            return list(self.curvature_factors)
        if self.block_lr == "uniform":
            return [1.0] * self.num_blocks
        return median_rate_factors([b.numel for b in self.blocks()])

    def parameter_groups(self) -> list[dict]:
        """The base groups cut into runs of equal block rate (``block_lr`` other than uniform), in the same order."""
        return groups_at_block_rates(super().parameter_groups(), self.blocks(), self.block_lr_factors(), self.lr)

    def configure_optimizers(self):
        if self.block_lr == "curvature" and self.curvature_factors is None:
            self.calibrate_block_rates(self.curvature_probe_batches())
        return super().configure_optimizers()

    def make_engine(self, params: list[nn.Parameter], offsets: Optional[list[int]] = None) -> BlockPerturbation:
        """One engine per block over the block's parameters, at their global offsets (fused engine)."""
        index = {id(p): i for i, p in enumerate(params)}
        blocks = self.blocks()
        covered = sorted(index[id(p)] for b in blocks for p in b.params if id(p) in index)
        if covered != list(range(len(params))) or sum(len(b.params) for b in blocks) != len(params):
            raise RuntimeError("The block partition must hold every trainable parameter exactly once")
        build = partial(_block_engine, super().make_engine, params, global_offsets(params),
                        self.direction_cache(params, blocks))  # a partial, not a closure: the module pickles
        return BlockPerturbation(params, [[index[id(p)] for p in b.params] for b in blocks], build,
                                 [b.name for b in blocks])

    def direction_cache(self, params: list[nn.Parameter], blocks) -> Optional[DirectionCache]:
        """One cache shared by the blocks' chunked engines, sized to the largest block (``cache_direction``)."""
        wanted = self.cache_direction if self.cache_direction is not None else not self.uses_fused_engine(params)
        return DirectionCache(max(b.numel for b in blocks)) if wanted else None

    # ----------------------------------------------------------------------------- curvature rates (ours)
    def calibrate_block_rates(self, batches: Iterable) -> list[float]:
        """``block_lr="curvature"``: estimate each ``tr(H_jj)`` on ``batches`` and set ``min(1, median / tr)``."""
        started = time.perf_counter()
        traces, errors = self.estimate_block_curvature(batches)
        self.curvature_factors = median_rate_factors(traces)
        self.block_curvature = {"trace": traces, "se": errors, "seconds": time.perf_counter() - started}
        rows = [f"  {name}: tr(H) {t:.4g} +- {e:.2g} -> lr x {f:.3g}"
                for name, t, e, f in zip(self.block_names, traces, errors, self.curvature_factors)]
        rank_zero_info(f"block_lr='curvature' ({self.block_curvature['seconds']:.1f} s):\n" + "\n".join(rows))
        return list(self.curvature_factors)

    @torch.no_grad()
    def estimate_block_curvature(self, batches: Iterable) -> tuple[list[float], list[float]]:
        """Per block, the mean and standard error of ``(f(x + lam u) + f(x - lam u) - 2 f(x)) / lam^2``.

        ``f`` is a batch's mean loss (eval mode), ``u ~ N(0, I_|B_j|)`` on block ``j`` from public seeds,
        ``curvature_probes`` directions per block and batch; the mean is unbiased for ``tr(H_jj)`` up to
        ``O(lam^2)``. Sums are all-reduced over DDP ranks, so every rank gets the same rates. The
        parameters are restored after each probe (as after a step's probe).
        """
        params = [p for group in super().parameter_groups() for p in group["params"]]
        engine = self.make_engine(params)
        mode = self.backbone.training
        self.backbone.eval()
        sums = torch.zeros(3, self.num_blocks, dtype=torch.float64, device=params[0].device)
        try:
            for b, (inputs, targets) in enumerate(batches):
                def loss():
                    return self.private_losses(inputs, targets).double().mean()

                center = loss()
                for j in range(self.num_blocks):
                    engine.activate(j)
                    for k in range(self.curvature_probes):
                        seed = derive_seed(derive_seed(self.run_seed, CURVATURE_STREAM, b), j, k)
                        value = second_differences(engine, seed, self.lam, loss, center)
                        engine.restore_()
                        sums[:, j] += torch.stack([torch.ones_like(value), value, value * value])
        finally:
            engine.restore_()
            self.backbone.train(mode)
        count, total, squares = self.reduce_sum(sums).cpu().unbind()
        if not count.min() > 0:
            raise RuntimeError("block_lr='curvature' found no non-empty batch to probe")
        mean = total / count
        variance = (squares - count * mean * mean).clamp(min=0) / (count - 1).clamp(min=1)
        return mean.tolist(), (variance / count).sqrt().tolist()

    def curvature_probe_batches(self) -> Iterable:
        """The probe's ``curvature_batches`` non-empty batches, on the module's device.

        ``DPMeZOBCD``: the DataModule's public split only. ``MeZOBCD``: training examples (:meth:`training_sample`).
        """
        if self._trainer is None:
            raise RuntimeError("block_lr='curvature' estimates the rates when a fit starts: fit with a "
                               "Trainer, or call calibrate_block_rates(batches) first")
        if self.trainer.ckpt_path is not None:
            raise ConfigError("block_lr='curvature': the checkpoint holds no estimated block rates "
                              "(it was trained with another block_lr); resume with that block_lr")
        if self.private:
            source = getattr(self.trainer.datamodule, "public_dataloader", lambda: None)()
            if source is None:
                raise PrivacyConfigError(
                    f"block_lr='curvature' in {type(self).__name__} estimates the rates on PUBLIC data: give "
                    f"the DataModule a public split (public_fraction > 0), or set block_lr factors")
            batches = source
        else:
            batches = self.training_sample(self.trainer.fit_loop._data_source.dataloader())
        non_empty = (batch for batch in batches if batch_size_of(batch[0]) > 0)
        return (move_data_to_device(batch, self.device) for batch in islice(non_empty, self.curvature_batches))

    def training_sample(self, loaders) -> Iterable:
        """Batches of training examples drawn from the run seed, the training loader's sampler untouched.

        Its dataset and collate function, batches of the loader's expected size; the same batches on
        every DDP rank. Leaving the sampler alone keeps a seeded batch stream the one a run without
        the probe sees.
        """
        loader = loaders.get("private", loaders) if isinstance(loaders, dict) else loaders
        sampler = getattr(loader, "batch_sampler", None)
        size = (round(sampler.description.expected_batch_size) if isinstance(sampler, PrivateBatchSampler)
                else getattr(loader, "batch_size", None) or 32)
        dataset, collate = loader.dataset, loader.collate_fn
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(self.run_seed))
        for start in range(0, len(dataset) - max(size, 1) + 1, max(size, 1)):
            yield collate([dataset[int(i)] for i in order[start:start + size]])

    # ----------------------------------------------------------------------------- the step
    def training_step(self, batch, batch_idx: int) -> None:
        (inputs, targets), _ = self.split_batch(batch)
        size = batch_size_of(inputs)
        block = self.select_block()                                                     # Alg. 1 line 3
        seeds = self.direction_seeds()                                                  # Alg. 1 line 2
        projected, differences = self.released_derivatives(seeds, inputs, targets, size)  # Alg. 1 lines 4-7; + z, / B
        if self.selection == "adaptive":
            self.record_score(block, projected)                                         # Alg. 4 lines 15-21
        coefficients = dict(zip(seeds, projected.unbind()))
        if self.block_optimizer == "adam":
            self.adam_update(coefficients)                                              # Alg. 5 lines 11-15
        else:
            self.update(coefficients, scale=self.update_scale)                          # Alg. 1 lines 9-12
        self.log_step(size, lambda: clipped_fraction(torch.cat(differences), self.clip), active_block=float(block))

    # ----------------------------------------------------------------------------- verbs
    def select_block(self) -> int:
        """``j`` (1-based) of step ``t = global_step + 1``: a new one at the start of each interval of ``nu`` steps."""
        t = self.global_step + 1
        interval = (t - 1) // self.steps_per_block + 1                                  # Alg. 5: t_b
        if (t - 1) % self.steps_per_block == 0 or self.active_block is None:
            self.active_block = self.next_block(interval)
            self.adam_state = None                                                      # Alg. 5 line 3: m = v = 0
        self.engine.activate(self.active_block - 1)
        return self.active_block

    def next_block(self, interval: int) -> int:
        """Alg. 3 (``selection="order"``), or Alg. 4 lines 4-9: warm-up order, then ``j ~ softmax(zbar / tau)``."""
        n = self.num_blocks
        if self.selection == "order":
            return update_block_idx(self.order, interval, n, self.run_seed)
        warmup = 10 * n if self.warmup_steps is None else self.warmup_steps
        if interval <= warmup:
            return update_block_idx(self.warmup_order, interval, n, self.run_seed)
        return sample_block(self.block_probabilities(), self.run_seed, interval)

    def block_probabilities(self) -> list[float]:
        """``p_i = exp(zbar_i / tau) / sum_k exp(zbar_k / tau)`` (Alg. 4 line 7)."""
        return softmax_probabilities(self.block_scores, self.temperature).tolist()

    def record_score(self, block: int, projected: Tensor) -> None:
        """``zbar_j <- alpha pg + (1 - alpha) zbar_j`` for the active block only (released pg: post-processing)."""
        value = float(projected.double().mean())
        score = abs(value) if self.adaptive_score == "abs" else value
        if math.isfinite(score):
            j = block - 1
            self.block_scores[j] = self.ema_decay * score + (1.0 - self.ema_decay) * self.block_scores[j]

    @torch.no_grad()
    def adam_update(self, coefficients: dict[int, Tensor]) -> None:
        """Alg. 5 lines 11-15 on the active block: ``g = pg u``, Adam moments with the interval's local ``t``."""
        params = self.engine.block_params()
        optimizer = self.zo_optimizer
        rates = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
        lrs = [rates[id(p)] for p in params]                                            # eta_t (before the scheduler)
        local_t = self.global_step % self.steps_per_block + 1                           # Alg. 5 line 5: t in 1..nu
        self.update({})                                                                # restore (+lam u); a step
        # moments in float32, or the parameters' dtype where wider (float64: kept, not narrowed)
        g = [torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device) for p in params]
        for seed, c in coefficients.items():                                            # reseed s; u ~ N(0, I_|Bj|)
            for g_i, u_i in zip(g, self.engine.block_direction(seed)):
                g_i.add_(u_i.to(g_i.device, g_i.dtype) * (c.to(g_i.device) / len(coefficients)))
        if self.adam_state is None:
            self.adam_state = {"m": [torch.zeros_like(x) for x in g], "v": [torch.zeros_like(x) for x in g]}
        self.adam_state = {k: [t.to(x.device) for t, x in zip(v, g)] for k, v in self.adam_state.items()}
        beta1, beta2 = self.betas
        for p, lr, g_i, m, v in zip(params, lrs, g, self.adam_state["m"], self.adam_state["v"]):
            m.mul_(beta1).add_(g_i, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g_i, g_i, value=1 - beta2)
            m_hat = m / (1 - beta1 ** local_t)
            v_hat = v / (1 - beta2 ** local_t)
            p.sub_((lr * m_hat / (v_hat.sqrt() + self.adam_eps)).to(p.dtype))

    # ----------------------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        adam = None if self.adam_state is None else {k: [t.cpu() for t in v] for k, v in self.adam_state.items()}
        checkpoint["block_state"] = {"active_block": self.active_block, "scores": list(self.block_scores),
                                     "adam": adam, "curvature_factors": self.curvature_factors,
                                     "block_curvature": self.block_curvature}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("block_state")
        if state is not None:
            self.active_block = state["active_block"]
            self.block_scores = list(state["scores"])
            self.adam_state = state["adam"]
            if self.block_lr == "curvature" and state.get("curvature_factors") is not None:
                if len(state["curvature_factors"]) != self.num_blocks:
                    raise ConfigError(f"The checkpoint's curvature rates are for {len(state['curvature_factors'])} "
                                             f"blocks, but this partition has {self.num_blocks}")
                self.curvature_factors = list(state["curvature_factors"])
                self.block_curvature = state.get("block_curvature")


class MeZOBCD(DPMeZOBCD):
    """MeZO-BCD, Algorithms 1-3 of Park et al. (non-private); Alg. 4 and 5 through ``selection``/``block_optimizer``.

    The step of :class:`DPMeZOBCD` with the non-private privacy component:
    ``theta_Bj <- theta_Bj - lr * mean_i clip_C(pg_i) * u``, the mean over the realized batch, no
    noise; ``clip=inf`` (default) is the paper's method.
    """

    private = False

    def __init__(self, backbone: nn.Module, *, clip: float = math.inf, **kwargs: Any) -> None:
        super().__init__(backbone, clip=clip, **kwargs)


def _check_block_lr(block_lr: Any) -> Optional[str]:
    if isinstance(block_lr, str):
        return check_choice("block_lr", block_lr, BLOCK_LRS)
    factors = block_lr if isinstance(block_lr, (list, tuple)) else []
    if factors and all(isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0
                       for f in factors):
        return None
    return (f"Expected `block_lr` in {list(BLOCK_LRS)} or a list of positive factors (one per block), "
            f"but got {block_lr!r}")



def _block_engine(make_engine, params: list[nn.Parameter], layout: list[int], cache, indices: list[int]):
    """The engine of one block: its parameters at their global offsets, sharing the direction cache."""
    return make_engine([params[i] for i in indices], offsets=[layout[i] for i in indices], cache=cache)

__all__ = ["DPMeZOBCD", "MeZOBCD"]
