#!/usr/bin/env python
"""What the engine's per-step checks cost ("ghost" mode's second-pass checks, the forward re-check), in one process.

``--check norms`` (the default):

"ghost" mode forms the clipped sums from a second backward of ``sum_i f_i loss_i``; when that
backward rounds below float32 (half precision, TF32) its rows are held to the first pass's norm bounds
(``lit_zodp.per_example.engine._within_first_pass_norms``: a second set of guarded norms). This
times ``PerExampleGradientEngine.clipped_sum`` with the check and with it replaced by "no shrink",
interleaved (order alternating), on the same model and batch, and reports the median paired ratio
and the largest shrink ``1 - min_i s_i`` seen over the measured calls (a small clip, so every
example is clipped). Since stop 38 every second pass is checked, float32 included (review 15). The model
builders come from ``bench_dpzero.py``.

``--check rows``: the second-pass verification of every "ghost" step (audit 5 F3: per row,
``u^T G2[r] v = f_r u^T G1[r] v``; ``PerExampleGradientEngine._verify_second_pass``), timed against the
same engine with the row summaries and the comparison replaced by no-ops.

``--check forward``: a step that re-runs the forward's batch-independence check (audit 5 F1;
``recheck_probability=1``) against one that does not (``0``); the expected cost per step is
``recheck_probability x (ratio - 1)``.

``--check replay``: the backbone in training mode with dropout ``--dropout`` (MiniLM's, and the attention's), every
step checked, against the same steps with the two comparisons that replay the step's draws (stop 60: the forward
check's and the gradient halves', ``_refuse_mixing_through_draws``) replaced by no-ops. Every step after the first
is an OS-drawn re-check (the gradient replay on one random split); with ``--first`` the engine forgets the structure
before each step, so every step is its first check (on ``ceil(log2 B)`` splits that separate every pair).

Usage::

    python benchmarks/bench_ghost_check.py --model vit_tiny --batch 32 --dtype bfloat16
    python benchmarks/bench_ghost_check.py --model minilm --batch 32 --seq-len 128 --dtype float32
    python benchmarks/bench_ghost_check.py --model vit_tiny --dtype float32 --check rows
    python benchmarks/bench_ghost_check.py --model minilm --dtype bfloat16 --check forward
    python benchmarks/bench_ghost_check.py --model minilm --batch 32 --seq-len 64 --dtype float32 --check replay
    python benchmarks/bench_ghost_check.py --model minilm --batch 32 --seq-len 64 --dtype float32 --check replay --first
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_dpzero as bd  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_tiny", choices=["vit_tiny", "minilm"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per example (MiniLM)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--clip", type=float, default=1e-3, help="small: every example clipped")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--check", default="norms", choices=["norms", "rows", "forward", "replay"])
    parser.add_argument("--dropout", type=float, default=0.1, help="--check replay: the dropout in training mode")
    parser.add_argument("--first", action="store_true", help="--check replay: every step a structure's first check")
    args = parser.parse_args(argv)

    import torch

    from lit_zodp.per_example import engine as engine_module

    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    backbone, inputs, targets, _ = bd.build_model(args.model, args.batch, args.seq_len, "cpu")
    backbone = backbone.eval().to(dtype)  # eval: no dropout (a random forward is recomputed by vmap)
    if args.check == "replay":
        _train_with_dropout(backbone, args.dropout)
    if not isinstance(inputs, dict):
        inputs = inputs.to(dtype)
    engine = engine_module.PerExampleGradientEngine(backbone, mode="ghost",
                                                    recheck_probability=1.0 if args.check == "replay" else 0.0)
    switch, shrinks = _switch(args.check, engine_module, engine, first=args.first)
    _time_switch(args, engine, switch, backbone, inputs, targets, shrinks)


def _train_with_dropout(backbone, p: float) -> None:
    """Training mode, every dropout at ``p`` (a Hugging Face attention's ``dropout`` attribute too)."""
    from torch import nn

    backbone.train()
    found = 0
    for module in backbone.modules():
        if isinstance(module, nn.Dropout):
            module.p, found = p, found + 1
        elif isinstance(getattr(module, "dropout", None), float):
            module.dropout, found = p, found + 1
    if not found:
        raise SystemExit("--check replay: the model has no dropout to draw")


class _NoSummaries:
    """Row summaries that record nothing (the "without" side of ``--check rows``)."""

    def __init__(self, keys, seed, **options):
        self.keys, self.values = keys, {}

    def __call__(self, *args):
        return None


def _switch(check, engine_module, engine, first: bool = False):
    """``(switch(on), shrinks)``: turn the measured check on or off; ``--check norms`` records each part's
    largest shrink ``1 - min s`` in ``shrinks``."""
    cls, summaries, shrinks = engine_module.PerExampleGradientEngine, engine_module._RowSummaries, []
    verify, norms = cls._verify_second_pass, engine_module._within_first_pass_norms
    from lit_zodp.per_example import gradient_halves
    forward_replay, halves_replay = cls._refuse_mixing_through_draws, gradient_halves._refuse_mixing_through_draws

    def measured_norms(part, factors, batch):
        s = norms(part, factors, batch)
        shrinks.append(float(1 - s.min()))
        return s

    def switch(on: bool) -> None:
        if check == "norms":
            engine_module._within_first_pass_norms = measured_norms if on else (lambda *_: None)
        elif check == "rows":
            engine_module._RowSummaries = summaries if on else _NoSummaries
            cls._verify_second_pass = verify if on else (lambda *a: None)
        elif check == "forward":
            engine.recheck_probability = 1.0 if on else 0.0
        else:
            cls._refuse_mixing_through_draws = forward_replay if on else (lambda *a, **k: None)
            gradient_halves._refuse_mixing_through_draws = halves_replay if on else (lambda *a, **k: None)
            if first:
                engine._misaligned.clear()  # (the structure unknown: its first check)
    return switch, shrinks


def _time_switch(args, engine, switch, backbone, inputs, targets, shrinks) -> None:
    import torch.nn.functional as F

    def step(on: bool) -> float:
        switch(on)
        start = time.perf_counter()
        engine.clipped_sum(lambda: F.cross_entropy(backbone(inputs).float(), targets, reduction="none"), args.clip)
        return time.perf_counter() - start

    step(True), step(False)  # warm-up (the first call also runs the structure's checks)
    shrinks.clear()
    times = {True: [], False: []}
    for r in range(args.repeats):
        for on in ([True, False] if r % 2 == 0 else [False, True]):
            times[on].append(step(on))
    ratios = [a / b for a, b in zip(times[True], times[False])]
    largest = f"; largest shrink {max(shrinks, default=0.0):.2e} over {len(shrinks)} parts" if args.check == "norms" else ""
    print(f"{args.model} batch {args.batch} {args.dtype} --check {args.check}{' --first' if args.first else ''}: with "
          f"{statistics.median(times[True]):.3f} s, without {statistics.median(times[False]):.3f} s per step; "
          f"ratio median {statistics.median(ratios):.4f} (range {min(ratios):.4f}-{max(ratios):.4f}, "
          f"{args.repeats} pairs){largest}")


if __name__ == "__main__":
    main()
