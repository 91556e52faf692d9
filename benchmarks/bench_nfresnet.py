#!/usr/bin/env python
"""NFResNet18's DP-SGD step on CPU: the standardised conv's layer rule (modes "hooks", "ghost", "bookkeeping") against
the engine's vmap recomputation (mode "vmap"), and the forward alone.

Timed: ``DPSGD.private_gradient(x, y)`` (forward, backward, per-example gradients or norms, flat clip, sum: the
engine's share of a step; the noise and the SGD update add a few parameter-sized passes), after one untimed call
(the engine's checks of a structure it has not seen run once per fit); median of ``--repeats``. Forward: eval mode,
no grad; non-private: forward and backward of the mean loss (the floor). Defaults: batch 16, 32x32 RGB, the cifar
stem, width 1, one torch thread.

Usage::

    python benchmarks/bench_nfresnet.py [--batch 16] [--side 32] [--width 1.0] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--side", type=int, default=32)
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--stem", default="cifar")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["hooks", "ghost", "bookkeeping", "vmap"])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    from lit_zodp.algorithms import DPSGD
    from lit_zodp.backbones import NFResNet18, count_parameters

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    backbone = NFResNet18(width=args.width, stem=args.stem, zero_init_last=False)
    x, y = torch.randn(args.batch, 3, args.side, args.side), torch.randint(0, 10, (args.batch,))
    print(f"NFResNet18 width {args.width}, {args.stem} stem, {count_parameters(backbone):,} parameters, "
          f"batch {args.batch} of {args.side}x{args.side}, {args.threads} thread(s)")
    backbone.eval()
    with torch.no_grad():
        print(f"forward (no grad): {timed(lambda: backbone(x), args.repeats):.3f} s")
    backbone.train()

    def nonprivate() -> None:
        backbone.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(backbone(x), y).backward()

    print(f"non-private forward + backward: {timed(nonprivate, args.repeats):.3f} s")
    backbone.zero_grad(set_to_none=True)
    for mode in args.modes:
        module = DPSGD(backbone, lr=0.1, clip=1.0, noise_multiplier=1.0, grad_mode=mode, seed=0)
        seconds = timed(lambda: module.private_gradient(x, y), args.repeats)
        print(f"DP-SGD private_gradient, grad_mode={mode}: {seconds:.3f} s; recomputed by vmap: "
              f"{len(module.engine.last_recomputed)} of {len(module.engine.names)} parameters")


if __name__ == "__main__":
    main()
