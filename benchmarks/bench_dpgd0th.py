#!/usr/bin/env python
"""DPGD-0th's per-step cost against MeZO on CPU: what its d-dimensional secret noise vector costs.

DPGD-0th (Zhang et al., Alg. 1) adds a Gaussian vector of the model's dimension to every update; the
perturbation engine draws it chunk by chunk (NumPy Philox, float64) and adds it to the float64 sum
of each chunk's update before the one rounding into the parameter. MeZO runs the same forwards and
engine passes without it. Model: a 64-1024-1024-10 MLP (1.1M parameters) on the digits, expected
Poisson batch 64, 300-step fits alternating between the methods; the median per-step times and the
median of paired ratios are printed.

``--root DIR`` imports the package from another checkout (e.g. a ``git worktree`` of an older
commit), for an A/B of two versions run alternately on the same host.

Usage::

    python benchmarks/bench_dpgd0th.py [--repeats 5] [--threads 1] [--root DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent


def fit_seconds_per_step(method: str, steps: int, datamodule) -> float:
    import lightning.pytorch as pl
    import torch
    from torch import nn

    from lit_zodp.algorithms import DPGD0th, MeZO

    class Clock(pl.Callback):
        start = end = None

        def on_train_batch_start(self, *args):
            self.start = self.start or time.perf_counter()

        def on_train_end(self, *args):
            self.end = time.perf_counter()

    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10))
    module = (MeZO(backbone, lr=1e-3, lam=1e-3, seed=0) if method == "mezo" else
              DPGD0th(backbone, lr=1e-3, lam=1e-3, seed=0, clip=1.0, noise_multiplier=1.0, delta=1e-5))
    clock = Clock()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[clock])
    trainer.fit(module, datamodule=datamodule)
    return (clock.end - clock.start) / (steps - 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--root", default=str(HERE.parent), help="checkout to import lit_zodp and datamodules from")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.root)
    os.environ.setdefault("LIT_ZODP_SPEND_DIR", "/tmp/lit_zodp_bench_spend")
    warnings.filterwarnings("ignore")
    import torch

    import lit_zodp
    from datamodules import DigitsDataModule

    torch.set_num_threads(args.threads)
    datamodule = DigitsDataModule(batch_size=64, val_fraction=0.1)
    times = {"mezo": [], "dpgd0th": []}
    for _ in range(args.repeats):
        for method in times:
            times[method].append(fit_seconds_per_step(method, args.steps, datamodule))
    ratio = statistics.median(d / m for d, m in zip(times["dpgd0th"], times["mezo"]))
    medians = ", ".join(f"{m} {1e3 * statistics.median(v):.1f} ms" for m, v in times.items())
    print(f"{Path(lit_zodp.__file__).parent.parent}: {medians} per step; DPGD-0th / MeZO {ratio:.3f}")


if __name__ == "__main__":
    main()
