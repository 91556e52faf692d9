"""Where a zeroth-order step's time goes outside its two forwards (issue 8's diagnosis tool).

For one model, dtype and batch of ``bench_zo_gpu.py`` (built from its configuration, no weights), fits
MeZO and DPZero through Lightning and reports, per method:

- the Python functions under ``training_step`` by cumulative and by own host time (``cProfile`` over
  ``--steps`` steps after a warm-up fit; on CUDA, time spent waiting for the device shows under ``synchronize`` or
  the first call that reads a device value);
- the device kernels by total CUDA time and the host operators by self CPU time (``torch.profiler``
  over ``--steps`` steps).

    python benchmarks/profile_zo_step.py --model minilm --dtype bf16 --batch 32 --device cuda
    python benchmarks/profile_zo_step.py --model minilm --tiny --device cpu --steps 3      # smoke

Prints the tables and, with ``--out DIR``, writes them to ``DIR/profile_<model>_<dtype>_b<batch>.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent):  # the benchmarks, and lit_zodp without an install
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import bench_zo_gpu as bz  # noqa: E402
from _common import resolve_device, sync  # noqa: E402


def host_profile(module, dataset, steps: int, device) -> str:
    """Host time of the functions called by ``training_step`` over ``steps`` steps: cumulative, then own."""
    profiler = cProfile.Profile()
    original = module.training_step

    def profiled(batch, batch_idx):
        profiler.enable()
        try:
            return original(batch, batch_idx)
        finally:
            profiler.disable()

    module.training_step = profiled
    try:
        bz.fit(module, dataset, steps, device)
    finally:
        del module.training_step
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(30)  # where the host time itself is spent (launchers, tables)
    return text.getvalue()


def device_profile(module, dataset, steps: int, device) -> str:
    """Kernels by CUDA time and operators by self CPU time over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        bz.fit(module, dataset, steps, device)
        sync(device)
    averages = prof.key_averages()
    parts = [averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    if device.type == "cuda":
        parts.append(averages.table(sort_by="self_cuda_time_total", row_limit=25))
    return "\n".join(parts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minilm", choices=bz.MODELS)
    parser.add_argument("--dtype", default="fp32", choices=tuple(bz.DTYPES))
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20, help="profiled steps per method and profiler")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--methods", default="mezo,dpzero", help="comma list from mezo, dpzero")
    parser.add_argument("--tiny", action="store_true", help="the 2-layer, hidden-64 model (CPU smoke)")
    parser.add_argument("--out", default=None, help="folder for the report file")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    batch = args.batch or bz.DEFAULT_BATCHES[args.model][0]
    seq_len = args.seq_len or bz.DEFAULT_SEQ_LEN[args.model]
    base, inputs, targets, dataset = bz.build(args.model, batch, seq_len, args.dtype, device, args.tiny)
    base.eval()
    report = [f"# {args.model} {args.dtype} b{batch} L{seq_len} on {device}, {args.steps} steps per profile"]
    for kind in args.methods.split(","):
        module = bz.timed_module(kind, base, "auto", args.model)
        bz.fit(module, dataset, 3, device)  # warm-up: compilation, first-fit caches
        start = len(module.step_times)
        bz.fit(module, dataset, args.steps, device)
        times = sorted(module.step_times[start:])
        fwd2 = bz.wall_times(lambda: bz.bd.two_forwards(module, inputs, targets), args.steps, device)
        report.append(f"\n## {kind}: step median {1e3 * times[len(times) // 2]:.2f} ms "
                      f"(min {1e3 * times[0]:.2f}, max {1e3 * times[-1]:.2f}); two forwards median "
                      f"{1e3 * sorted(fwd2)[len(fwd2) // 2]:.2f} ms")
        report.append(f"\n### {kind}: host functions under training_step (cProfile, cumulative)\n")
        report.append(host_profile(module, dataset, args.steps, device))
        report.append(f"\n### {kind}: torch.profiler\n")
        report.append(device_profile(module, dataset, args.steps, device))
        print("\n".join(report[-5:]), flush=True)
    if args.out:
        path = Path(args.out) / f"profile_{args.model}_{args.dtype}_b{batch}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(report))
        print(f"wrote {path}")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - start:.0f} s")
