"""Helpers for tests of Triton kernels without a GPU: the interpreter in a subprocess, and compiling to PTX.

Triton reads ``TRITON_INTERPRET=1`` when it is imported, so interpreted runs happen in a subprocess
running a test file as a script (its ``__main__`` saves what the kernels computed); the rest of the
suite keeps a normal Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from filelock import FileLock

try:
    import triton
except ImportError:  # pragma: no cover
    triton = None

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, tmp_path_factory, name: str = "interpreted"):
    """Run ``python script OUT`` under ``TRITON_INTERPRET=1`` and load what it saved to ``OUT``.

    Once per test run: under pytest-xdist the first worker to need it runs it (20-30 s of interpreted kernels on
    two cores) in the workers' shared temporary folder, and the others wait for that file and read it."""
    if triton is None:
        pytest.skip("needs the `triton` package")
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = shared / f"{name}-{Path(script).stem}.pt"
    with FileLock(f"{path}.lock"):
        if not path.exists():
            env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
            partial = path.with_suffix(".partial")
            done = subprocess.run([sys.executable, script, str(partial)], env=env, capture_output=True, text=True,
                                  timeout=600)
            assert done.returncode == 0, done.stderr[-4000:]
            partial.replace(path)
    return torch.load(path, weights_only=False)


def compile_for_sm90(kernel, signature: dict, constexprs: dict, monkeypatch, tmp_path, num_warps: int = 4):
    """The kernel compiled for an H100 (sm_90) by Triton's CUDA frontend and ptxas, without a GPU.

    Skips where this Triton has no CUDA compiler API, backend or ptxas.
    """
    if triton is None:
        pytest.skip("needs the `triton` package")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        pytest.skip("this triton has no CUDA compiler API")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    try:
        return triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except (RuntimeError, FileNotFoundError) as error:  # no NVIDIA backend or ptxas in this install
        if "ptxas" in str(error) or "backend" in str(error).lower():
            pytest.skip(str(error))
        raise
