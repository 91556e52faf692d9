#!/usr/bin/env python
"""The cost of fixed-shape private forwards (``fixed_forward_rows`` + ``pad_to_max_length``), side by side.

A ZO step forwards its private batch twice. With fixed shapes every forward is ``[rows, max_length]``
(:mod:`lit_zodp.privacy.fixed_shape`): the rows are padded to ``max_length`` tokens and the batch to a
multiple of ``rows``. This measures what that costs against the default (each Poisson batch cut to its
longest row, one forward), on real text: Rotten Tomatoes reviews tokenized for the packaged MiniLM,
Poisson batches of expected size ``--batch`` drawn with a public seed (a benchmark, not a private run).

Configurations, interleaved batch by batch in a rotating order (the machine is shared):
``dynamic`` (the default), ``fixed_length`` (rows of ``max_length``, one forward), ``rows=R`` for
each ``--rows`` (rows of ``max_length`` in chunks of exactly ``R``), and with ``--lengths`` the same
chunks per length bucket (``fixed_forward_lengths``: each row cut to the shortest bucket holding it). Reported: ms per step (two
``DPZero.private_losses`` calls), the ratio to ``dynamic``, and the forwarded tokens per real token.

Usage::

    python benchmarks/bench_fixed_shape.py                    # CPU: batch 32, max_length 64, 40 batches x 3
    benchmarks/gpu_session.sh fixed_shape                     # GPU (MiniLM and the reviews carried)
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _common import machine_info, resolve_device, results_stem, setup_worker, sync, write_results  # noqa: E402


def load_rows(max_length: int, model_path: str = "minilm", data_path: str | None = None):
    """The private split of Rotten Tomatoes as ``[n, max_length]`` ids and masks, and the labels."""
    import torch

    from datamodules import MovieReviewsDataModule

    extra = {"data_path": data_path} if data_path else {}
    data = MovieReviewsDataModule(source="rotten_tomatoes", tokenizer=model_path, max_length=max_length,
                                  batch_size=32, pad_to_max_length=True, **extra)
    data.setup("fit")
    rows = [data.private_dataset[i] for i in range(len(data.private_dataset))]
    ids = torch.stack([r[0]["input_ids"] for r in rows])
    mask = torch.stack([r[0]["attention_mask"] for r in rows])
    return ids, mask, torch.tensor([int(r[1]) for r in rows])


def poisson_batches(n: int, batch: int, count: int, seed: int):
    """``count`` index sets, each example in with probability ``batch / n`` (public seed)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.nonzero(torch.rand(n, generator=g) < batch / n).flatten() for _ in range(count)]


def make_modules(rows_options: list[int], buckets: list[int], dtype: str, device, model_path: str = "minilm"):
    """One DPZero per configuration, all holding the same MiniLM weights."""
    import torch

    from lit_zodp.algorithms import DPZero
    from lit_zodp.backbones import SentenceEncoderClassifier

    torch.manual_seed(0)
    backbone = SentenceEncoderClassifier(model_name_or_path=model_path, num_classes=2)
    backbone = backbone.to(device=device, dtype=getattr(torch, dtype)).eval()
    common = dict(lr=1e-6, clip=50.0, noise_multiplier=1.0)
    modules = {"dynamic": DPZero(backbone, **common), "fixed_length": DPZero(backbone, **common)}
    for rows in rows_options:
        modules[f"rows={rows}"] = DPZero(backbone, fixed_forward_rows=rows, **common)
        if buckets:
            modules[f"rows={rows}, lengths={buckets}"] = DPZero(backbone, fixed_forward_rows=rows,
                                                                fixed_forward_lengths=buckets, **common)
    return modules


def batch_for(name: str, ids, mask, index, device):
    from datamodules.collate import trim_to_longest

    inputs = {"input_ids": ids[index], "attention_mask": mask[index]}
    if name == "dynamic":
        inputs = trim_to_longest(inputs)
    return {k: v.to(device) for k, v in inputs.items()}


def forwarded_tokens(module, inputs, targets) -> int:
    """Tokens the backbone sees for this batch (every chunk of a fixed-shape module)."""
    if module.fixed_shape is None:
        return inputs["input_ids"].numel()
    return sum(chunk["input_ids"].numel() for chunk, _, _ in module.fixed_shape.chunks(inputs, targets))


def run(args) -> dict:
    import torch

    setup_worker(args.threads)
    device = resolve_device(args.device)
    model_path, data_path = "minilm", None
    if args.carry:  # a GPU machine without the data extras (benchmarks/gpu_session.sh carry)
        import tempfile

        from bench_mezo_bcd_accuracy import unpack_carry

        model_path, data_path = unpack_carry(Path(args.carry), Path(tempfile.mkdtemp(prefix="minilm_")))
    ids, mask, labels = load_rows(args.max_length, model_path, data_path)
    batches = poisson_batches(len(labels), args.batch, args.batches, args.seed)
    buckets = [int(n) for n in args.lengths.split(",")] if args.lengths else []
    modules = make_modules([int(r) for r in args.rows.split(",")], buckets, args.dtype, device, model_path)
    names = list(modules)
    seconds = {name: [] for name in names}
    for repeat in range(args.repeats + 1):  # the first pass warms up
        totals = dict.fromkeys(names, 0.0)
        for b, index in enumerate(batches):
            order = names[(b + repeat) % len(names):] + names[:(b + repeat) % len(names)]
            for name in order:
                inputs, targets = batch_for(name, ids, mask, index, device), labels[index].to(device)
                sync(device)
                start = time.perf_counter()
                with torch.no_grad():
                    modules[name].private_losses(inputs, targets)
                    modules[name].private_losses(inputs, targets)
                sync(device)
                totals[name] += time.perf_counter() - start
        if repeat:
            for name in names:
                seconds[name].append(totals[name] / len(batches))
    real = sum(int(mask[index].sum()) for index in batches)
    tokens = {name: sum(forwarded_tokens(modules[name], batch_for(name, ids, mask, i, "cpu"), labels[i])
                        for i in batches) for name in names}
    return {name: {"ms_per_step": 1000 * statistics.median(seconds[name]),
                   "ratio_to_dynamic": statistics.median(s / d for s, d in zip(seconds[name], seconds["dynamic"])),
                   "tokens_per_real_token": tokens[name] / real,
                   "samples_ms": [1000 * s for s in seconds[name]]} for name in names}


def markdown(args, results: dict, meta: dict) -> str:
    lines = [f"# Fixed-shape private forwards: cost on `{meta['device']}`", "",
             f"`{meta['command']}`", "",
             f"MiniLM ({args.dtype}), Rotten Tomatoes, Poisson batches of expected size {args.batch}, "
             f"max_length {args.max_length}, {args.batches} batches x {args.repeats} repeats (median); "
             f"{meta['cpu']}, {args.threads} threads; load average {meta['loadavg_start'][0]:.2f} -> "
             f"{meta['loadavg_end'][0]:.2f}.", "",
             "| configuration | ms / step (2 forwards) | ratio to dynamic | forwarded tokens / real token |",
             "|---|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['ms_per_step']:.1f} | {r['ratio_to_dynamic']:.2f} | "
                     f"{r['tokens_per_real_token']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=32, help="expected Poisson batch size")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--rows", default="8,16,32", help="fixed_forward_rows values, comma-separated")
    parser.add_argument("--lengths", default="16,32", help="fixed_forward_lengths buckets ('' for none)")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--carry", metavar="DIR", default=None,
                        help="MiniLM and the reviews from a folder written by bench_mezo_bcd_accuracy.py --pack-carry")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import os

    meta = machine_info() | {"command": "python benchmarks/bench_fixed_shape.py " + shlex.join(argv),
                             "device": args.device}
    results = run(args)
    meta["loadavg_end"] = os.getloadavg()
    if args.device != "cpu":
        import torch

        meta["device"] = torch.cuda.get_device_name()
    text = markdown(args, results, meta)
    print(text)
    write_results(results_stem(args.out, "bench_fixed_shape" + ("" if args.device == "cpu" else "_gpu")),
                  text, {"meta": meta, "args": vars(args), "results": results})


if __name__ == "__main__":
    main(sys.argv[1:])
