#!/usr/bin/env python
"""How close honest rows come to the tolerance of "ghost" mode's second-pass check, over a training run.

The check (``PerExampleGradientEngine._verify_second_pass``, :mod:`lit_zodp.per_example.alignment`)
refuses a step when a row of the second backward is not ``f_r`` times the first's, to within
``2 sqrt(eps) |f_r| ||G_1[r]||``. Rounding alone leaves a gap ``E_r = G_2[r] - f_r G_1[r]``; in
bfloat16 it is largest. This runs ``--steps`` clipped-sum SGD steps of a backbone in ``--dtype`` (the
engine's own checks on), keeps both passes' rows of every checked call, and reports:

* ``rho_r = ||E_r|| / tolerance``, exact (from the kept rows): its median, 99th percentile and largest;
* the check's statistic, the root mean square of its ``K`` projections of ``E_r`` over the tolerance
  (refused above 1), and the same with the first projection alone (the check before 2026-11-25); and
  the mean of ``statistic^2 / rho_r^2``, 1 when the projections add no rounding of their own (the
  statistic is ``rho_r sqrt(chi2_K / K)``: its largest value over many rows exceeds the largest ``rho``);
* the expected number of refused honest steps in a 10,000-step run, extrapolated per row from its
  scale ``s_r`` (estimated by the ``K``-projection statistic: a noisy estimate, which overstates a
  tail): ``sum_r P(chi2_K / K > 1 / s_r^2)`` per step, ``K = 1`` and the engine's ``K``; and the
  scale at which one refusal is expected in such a run.

Usage::

    python benchmarks/ghost_check_margin.py --model vit_tiny --dtype bfloat16 --steps 100
    python benchmarks/ghost_check_margin.py --model minilm --dtype bfloat16 --seq-len 64 --steps 60
    python benchmarks/ghost_check_margin.py --model roberta_base --batch 8 --seq-len 32 --steps 30
    python benchmarks/ghost_check_margin.py --model vit_tiny --dtype float16 --steps 20 --lr 0.1

``roberta_base`` and ``gpt2`` are 12-layer, 768-wide sequence classifiers built from their
configurations (random weights, no download): deeper than the packaged MiniLM (6 layers, 384).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_dpzero as bd  # noqa: E402

#: Configurations of the 12-layer models (transformers' defaults for the rest: RoBERTa-base, GPT-2 small).
CONFIGS = {"roberta_base": dict(model_type="roberta", pad_token_id=1),
           "gpt2": dict(model_type="gpt2", pad_token_id=0)}
POOL = 128  # examples the batches are drawn from (the run memorises them: the gradients change over it)
RUN_STEPS = 10_000


def _keep_rows(alignment, kept: dict) -> None:
    """Wrap the engine's row summaries: every observed row also kept, in float64, per pass."""
    original = alignment._RowSummaries.__call__

    def call(summaries, call, index, grad):
        original(summaries, call, index, grad)
        key = summaries.keys.get(id(call))
        if key is not None and grad.dim() > 0:
            kept[(id(summaries), (key, index))] = grad.detach().double().flatten(1)

    alignment._RowSummaries.__call__ = call


def _instrument(engine_module, alignment, rhos: list, statistics_seen: list):
    """Record, at each second-pass verification, the exact ``rho_r`` and the check's statistic per row."""
    import torch

    kept = {}
    _keep_rows(alignment, kept)
    verify = engine_module.PerExampleGradientEngine._verify_second_pass

    def measured(self, second, calls, factors, ok):
        ok_rows = torch.isfinite(factors) if ok is None else ok
        f = factors.double()
        for entry, (p1, n1, eps) in second.first.values.items():
            g1, g2 = kept.get((id(second.first), entry)), kept.get((id(second.again), entry))
            if g1 is None or g2 is None or entry not in second.again.values:
                continue
            tolerance = 2 * eps * f.abs() * n1.double()
            rho = (g2 - f[:, None] * g1).norm(dim=1) / tolerance
            gap = (second.again.values[entry][0].double() - f[:, None] * p1.double()).abs() / tolerance[:, None]
            keep = ok_rows & (tolerance > 0)
            rhos.append(rho[keep])
            statistics_seen.append(torch.stack([gap.pow(2).mean(-1).sqrt(), gap[:, 0]], 1)[keep])
        kept.clear()
        return verify(self, second, calls, factors, ok)

    engine_module.PerExampleGradientEngine._verify_second_pass = measured


def expected_refusals(scale, projections: int, steps: int) -> float:
    """``sum_r P(s_r sqrt(chi2_K / K) > 1)`` per measured step, times ``RUN_STEPS``."""
    from scipy.stats import chi2

    scale = scale[scale > 0].numpy()
    return float(chi2.sf(projections / scale ** 2, projections).sum()) / steps * RUN_STEPS


def edge_scale(rows_per_step: int, projections: int) -> float:
    """The scale ``s`` at which every row at ``s`` gives one expected refusal in ``RUN_STEPS`` steps."""
    from scipy.stats import chi2

    return (projections / chi2.isf(1.0 / (rows_per_step * RUN_STEPS), projections)) ** 0.5


def build(model: str, seq_len: int):
    """The backbone and ``POOL`` examples ``(inputs, targets)``."""
    import torch

    if model not in CONFIGS:
        backbone, inputs, targets, _ = bd.build_model(model, POOL, seq_len, "cpu")
        return backbone, inputs, targets
    from lit_zodp.backbones import HFSequenceClassifier

    torch.manual_seed(0)
    backbone = HFSequenceClassifier(config=CONFIGS[model], num_classes=2)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, backbone.model.config.vocab_size, (POOL, seq_len), generator=generator)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return backbone, inputs, torch.randint(0, 2, (POOL,), generator=generator)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_tiny", choices=["vit_tiny", "minilm", *CONFIGS])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per example (MiniLM)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--train-mode", action="store_true", help="dropout on (default: eval mode)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from lit_zodp.errors import PrivacyConfigError
    from lit_zodp.per_example import alignment
    from lit_zodp.per_example import engine as engine_module

    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    backbone, inputs, targets = build(args.model, args.seq_len)
    backbone = backbone.to(dtype).train(args.train_mode)
    if not isinstance(inputs, dict):
        inputs = inputs.to(dtype)
    engine = engine_module.PerExampleGradientEngine(backbone, mode="ghost", recheck_probability=0.0)
    rhos, seen = [], []
    _instrument(engine_module, alignment, rhos, seen)
    params = [p for p in backbone.parameters() if p.requires_grad]
    generator, refused, losses, start = torch.Generator().manual_seed(1), 0, [], time.perf_counter()
    for step in range(args.steps):
        rows = torch.randint(0, POOL, (args.batch,), generator=generator)
        x = {k: v[rows] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[rows]
        y = targets[rows]
        try:
            result = engine.clipped_sum(lambda: F.cross_entropy(backbone(x).float(), y, reduction="none"), args.clip)
        except PrivacyConfigError as error:  # a refusal: counted, the run goes on
            refused += 1
            print(f"step {step}: refused: {str(error)[:160]}", flush=True)
            continue
        with torch.no_grad():
            for param, total in zip(params, result.grads):
                param.add_((total / args.batch).to(param.dtype), alpha=-args.lr)
        if step % 20 == 0 or step == args.steps - 1:
            losses.append(float(F.cross_entropy(backbone(x).float(), y)))
            print(f"step {step}: loss {losses[-1]:.3f}; largest rho so far {float(torch.cat(rhos).max()):.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    rho, (stat, single) = torch.cat(rhos), torch.cat(seen).unbind(1)
    k, per_step = alignment.PROJECTIONS, len(rho) // max(1, args.steps - refused)
    print(f"{args.model} {args.dtype} batch {args.batch}, {args.steps} steps ({refused} refused), "
          f"{len(rho)} rows compared ({per_step} per step); loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"rho = ||E_r|| / tolerance: median {float(rho.median()):.3f}, 99th percentile "
          f"{float(rho.quantile(0.99)):.3f}, largest {float(rho.max()):.3f}")
    print(f"check statistic (refused above 1): {k} projections largest {float(stat.max()):.3f}; "
          f"one projection largest {float(single.max()):.3f}; mean statistic^2 / rho^2 "
          f"{float((stat / rho)[rho > 0].pow(2).mean()):.3f}")
    steps = args.steps - refused
    print(f"expected refused honest steps in a {RUN_STEPS}-step run: one projection "
          f"{expected_refusals(stat, 1, steps):.2e}; {k} projections {expected_refusals(stat, k, steps):.2e}. "
          f"One is expected when rows reach a scale of {edge_scale(per_step, 1):.3f} (one projection), "
          f"{edge_scale(per_step, k):.3f} ({k})")
    print(f"{(time.perf_counter() - start) / args.steps:.2f} s per step with the rows kept")


if __name__ == "__main__":
    main()
