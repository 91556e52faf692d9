"""Does a float32 matmul on this device flush a subnormal operand (red-team review 63)?

    python benchmarks/flush_probe.py [--device cuda]

For each float32 matmul setting ("ieee", "tf32", "bf16") and for bfloat16 operands, forms ``v^T x`` with
``x = [1 + 2^-10, 2^-127]`` and ``v = [1, -2^127]`` (the review's record) and prints ``(v^T x)[0, 0]``: ``2^-10``
(0.000977) where the subnormal's term survives (0 if the operands are rounded to bfloat16,
where ``1 + 2^-10`` rounds to 1), ``1 + 2^-10`` (TF32) or ``1`` (bfloat16) where it is flushed. The
per-example engine forms such sums in float64 under any setting other than "ieee" where a row may hold a
subnormal (``engine._flush_flags``), whether or not the device flushes; this records what the device does.
"""

import argparse

import torch


def record(device, dtype, size=64):
    """``x`` and ``v`` of ``size`` positions by ``size`` features (a tensor-core / AMX shape), the record in the
    first feature's first two positions, zeros elsewhere."""
    x, v = torch.zeros(size, size), torch.zeros(size, size)
    x[0, 0], x[1, 0] = 1.0 + 2.0 ** -10, 2.0 ** -127
    v[0, 0], v[1, 0] = 1.0, -(2.0 ** 127)
    return x.to(device, dtype), v.to(device, dtype)


def product(device, dtype=torch.float32):
    """``(v^T x)[0, 0]`` by ``matmul`` and by ``bmm``."""
    x, v = record(device, dtype)
    return float((v.T @ x)[0, 0].float()), float(torch.bmm(v.T[None], x[None])[0, 0, 0].float())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    backend = torch.backends.cuda.matmul if device == "cuda" else torch.backends.mkldnn.matmul
    previous = backend.fp32_precision
    try:
        for setting in ("ieee", "tf32", "bf16"):
            try:
                backend.fp32_precision = setting
            except (RuntimeError, ValueError) as error:
                print(f"{device} float32 {setting}: not settable ({error})")
                continue
            print(f"{device} float32 {setting}: matmul, bmm = {product(device)} (exact 2^-10 = {2.0 ** -10:.6g})")
    finally:
        backend.fp32_precision = previous
    print(f"{device} bfloat16 operands: matmul, bmm = {product(device, torch.bfloat16)} (0: kept, 1: flushed)")


if __name__ == "__main__":
    main()
