"""The fused perturbation kernel compiled for an H100 (sm_90) without a GPU: instructions per element.

Triton's CUDA frontend and ptxas (bundled with Triton) compile ``lit_zodp.zo.fused._zo_pass_kernel``;
``nvdisasm`` and ``cuobjdump`` (bundled too) give the SASS and the resources. For each dtype and tile
it reports the loop over a pass's directions (one trip per direction: Philox, Box-Muller, the restore
and the term of every element a thread holds) as instructions per element, the registers, the stack
frame (spills and local arrays), the shared memory, the vector width of the global accesses, and the
special-function instructions. With ``fast_math=False`` (libdevice's software log, sine and cosine) the loop
also holds their large-argument reductions, never entered for Box-Muller's angles: "per element" leaves
out what a forward branch skips together with such a nested loop (predicated instructions still count).

    python benchmarks/kernel_instructions.py                       # fp32 and bf16 at the default tile + 3 others
    python benchmarks/kernel_instructions.py --tiles 2048x4 --dtypes bf16 --software-math

A static count, not a timing: where the pass is bound by arithmetic (bf16 on an H100, issue 8), time
per element follows the executed instructions; ``bench_zo_gpu.py`` times the same tiles on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SIGNATURE = {"table": "*i64", "owners": "*i32", "seeds": "*i64", "scalars": "*fp32", "num_terms": "i32",
             "lrs": "*fp32", "decays": "*fp32"}
CONSTEXPRS = ("DTYPE", "BLOCK", "RESTORE", "UPDATE", "ALIGNED", "FAST_MATH", "HW_ROUND", "ROW")
SASS_LINE = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)[^;]*;")
LABEL = re.compile(r"^\.(L\w+):")
BACK_BRANCH = re.compile(r"BRA\s+`?\(?\.(L\w+)\)?")


def compile_pass_kernel(dtype: str, block: int, warps: int, fast_math: bool):
    """The restore-and-update pass (RESTORE and UPDATE on: the heaviest variant) for sm_90."""
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lit_zodp.zo import fused

    torch_dtype = getattr(torch, DTYPES[dtype])
    values = {"DTYPE": getattr(tl, DTYPES[dtype]), "BLOCK": block, "RESTORE": True, "UPDATE": True,
              "ALIGNED": True, "FAST_MATH": fast_math, "HW_ROUND": True,
              "ROW": fused.row_length(torch_dtype, block, warps)}
    signature = dict(SIGNATURE, **{name: "constexpr" for name in CONSTEXPRS})
    source = ASTSource(fused._zo_pass_kernel, signature, constexprs=values)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}), values["ROW"]


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _on_cubin(kernel, *command: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(kernel.asm["cubin"])
        handle.flush()
        return subprocess.run([*command, handle.name], capture_output=True, text=True, check=True).stdout


def resources(kernel) -> dict:
    text = _on_cubin(kernel, _tool("cuobjdump"), "--dump-resource-usage")
    found = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", text)
    return dict(zip(("registers", "stack", "shared", "local"), map(int, found.groups()))) if found else {}


def loop_body(sass: str) -> tuple[list[str], int]:
    """Opcodes of the first outermost loop (a label ... the backward branch to it), the full-tile path's
    loop over a pass's terms, and how many of them a forward branch skips together with a loop nested
    inside (a software sine's large-argument reduction, never entered for Box-Muller's angles)."""
    labels, opcodes, loops, jumps = {}, [], [], []
    for line in sass.splitlines():
        label = LABEL.match(line.strip())
        if label:
            labels[label.group(1)] = len(opcodes)
            continue
        instruction = SASS_LINE.search(line)
        if not instruction:
            continue
        opcodes.append(instruction.group(1).split(".")[0])
        target = BACK_BRANCH.search(line)
        if target and target.group(1) in labels:
            loops.append((labels[target.group(1)], len(opcodes)))
        elif target:
            jumps.append((len(opcodes), target.group(1)))  # resolved once every label is known

    def inside(a, b, c, d):
        return c <= a and b <= d and (a, b) != (c, d)

    outer = [(a, b) for a, b in loops if not any(inside(a, b, c, d) for c, d in loops)]
    if not outer:
        return [], 0
    start, end = min(outer)
    nested = [(a, b) for a, b in loops if inside(a, b, start, end)]
    cold = set()
    for after, name in jumps:
        target = labels.get(name, -1)
        if start <= after < target <= end and any(after <= a and b <= target for a, b in nested):
            cold.update(range(after, target))
    return opcodes[start:end], len(cold)


def measure(dtype: str, block: int, warps: int, fast_math: bool) -> dict:
    kernel, row = compile_pass_kernel(dtype, block, warps, fast_math)
    body, nested = loop_body(_on_cubin(kernel, _tool("nvdisasm"), "-c"))
    ptx = kernel.asm["ptx"]
    per_thread = block // (32 * warps)
    vector = "v4" if "ld.global.v4" in ptx else "v2" if "ld.global.v2" in ptx else "scalar"
    mix = collections.Counter(body)
    return dict(dtype=dtype, tile=f"{block}x{warps}", row=row, fast_math=fast_math, per_thread=per_thread,
                loop=len(body), nested=nested, per_element=(len(body) - nested) / per_thread, vector=vector,
                mufu=mix.get("MUFU", 0),
                barriers=ptx.count("bar.sync"), top=mix.most_common(6), **resources(kernel))


def render(rows: list[dict]) -> str:
    lines = ["| dtype | tile | log, sin, cos | row | elements / thread | loop instr. (skipped) | per element "
             "| registers | stack B | shared B | access | MUFU in loop | most frequent |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        math = "hardware" if r["fast_math"] else "software"
        top = ", ".join(f"{op} {n}" for op, n in r["top"])
        lines.append(f"| {r['dtype']} | {r['tile']} | {math} | {r['row']} | {r['per_thread']} | "
                     f"{r['loop']} ({r['nested']}) | "
                     f"{r['per_element']:.1f} | {r.get('registers', '?')} | {r.get('stack', '?')} | "
                     f"{r.get('shared', '?')} | {r['vector']} | {r['mufu']} | {top} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from _common import parse_tiles
    from lit_zodp.zo import fused

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="fp32,bf16", help=f"comma list of {sorted(DTYPES)}")
    parser.add_argument("--tiles", default=f"{fused.DEFAULT_BLOCK}x{fused.DEFAULT_WARPS},1024x8,1024x4,512x4",
                        help="BLOCKxWARPS comma list (elements per program x warps)")
    parser.add_argument("--software-math", action="store_true",
                        help="also compile with fast_math=False (libdevice's software log, sine and cosine)")
    args = parser.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"--dtypes: {unknown} not in {sorted(DTYPES)}")
    maths = [True, False] if args.software_math else [True]
    rows = []
    for dtype in dtypes:
        for block, warps in parse_tiles(args.tiles):
            for fast_math in maths:
                rows.append(measure(dtype, block, warps, fast_math))
                print(f"compiled {dtype} {block}x{warps} fast_math={fast_math}", file=sys.stderr, flush=True)
    print(render(rows))


if __name__ == "__main__":
    main()
