#!/usr/bin/env python
"""Where a GEP step's time goes on the PAZO paper's Table 4 LSTM (embedding 128 over 10,002 words, 2 x 64; 1.4M
parameters), beside DP-SGD's step on the same batches: the anchor gradients (per-example backprop on the public
batch), the anchor subspace (power method and QR per group) and the private clipped parts. Random token ids (290 per
review, a full batch of 64 and a public batch of ``--public-rows``), ``grad_mode: hooks``, one thread.

Usage::

    python benchmarks/profile_gep_lstm.py                    # 3 steps each, 1000 bases in 3 groups (the config's)
    python benchmarks/profile_gep_lstm.py --num-bases 24     # at most num_groups * b' bases
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

from datamodules.collate import text_collate
from lit_zodp.algorithms import DPSGD, GEP
from lit_zodp.algorithms import gep as gep_module
from lit_zodp.backbones import LSTMClassifier
from lit_zodp.privacy import FullBatchSampler


class Reviews(Dataset):
    def __init__(self, rows: int, generator: torch.Generator) -> None:
        self.ids = torch.randint(2, 10_002, (rows, 290), generator=generator)
        self.labels = torch.randint(0, 2, (rows,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}, self.labels[i]


def timed(name: str, fn, record: dict):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        record.setdefault(name, []).append(time.perf_counter() - start)
        return out
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-bases", type=int, default=1000)
    parser.add_argument("--public-rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    import lightning.pytorch as pl

    record: dict[str, list[float]] = {}
    gep_module.anchor_subspace = timed("subspace (power method + QR)", gep_module.anchor_subspace, record)
    GEP.anchor_gradients = timed("anchor gradients", GEP.anchor_gradients, record)
    GEP.private_gradient = timed("GEP private clipped parts", GEP.private_gradient, record)
    DPSGD.private_gradient = timed("DP-SGD private clipped sum", DPSGD.private_gradient, record)
    generator = torch.Generator().manual_seed(0)
    private, public = Reviews(64, generator), Reviews(args.public_rows, generator)
    public_batch = text_collate(False)([public[i] for i in range(len(public))])
    totals = {}
    for cls, options in ((GEP, dict(num_bases=args.num_bases, num_groups=3, embedding_clip=5.0)), (DPSGD, {})):
        torch.manual_seed(0)
        backbone = LSTMClassifier(vocab_size=10_002, embedding_dim=128, hidden_size=64, num_layers=2, num_classes=2)
        module = cls(backbone, lr=0.02, clip=0.5, noise_multiplier=1.0, seed=0, grad_mode="hooks", **options)
        if cls is GEP:
            module.use_public_data([public_batch])
        loader = DataLoader(private, batch_sampler=FullBatchSampler(64, steps_per_epoch=args.steps),
                            collate_fn=text_collate(False))
        trainer = pl.Trainer(max_steps=args.steps, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        start = time.perf_counter()
        trainer.fit(module, loader)
        totals[cls.__name__] = time.perf_counter() - start
    print(f"{args.steps} steps, {args.num_bases} bases in 3 groups, public batch {args.public_rows}, 1 thread")
    for name, seconds in totals.items():
        print(f"  {name}: {seconds:.1f} s for {args.steps} steps ({seconds / args.steps:.1f} s per step)")
    for name, values in record.items():
        print(f"  {name}: " + ", ".join(f"{v:.2f}" for v in values) + " s")


if __name__ == "__main__":
    main()
