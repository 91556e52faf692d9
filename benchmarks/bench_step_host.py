#!/usr/bin/env python
"""Host time a zeroth-order step spends outside its forwards and engine passes, old way against new, in one process.

Two per-step costs every zeroth-order module paid, private or not (issue 8: on an H200 MiniLM's forwards are kernel
launches, so whatever the host does adds to the step):

* ``eval``: the step puts the backbone in eval mode. ``Module.eval()`` sets every layer's flag through
  ``Module.__setattr__``; :class:`lit_zodp.zo.eval_mode.EvalMode` reads the flags of a cached list of the layers and
  calls ``eval()`` only when one is set. Timed on the packaged all-MiniLM-L6-v2 (119 layers) and the
  ``text_host`` BERT of ``bench_privacy_cost.py``, where Lightning left the layers in eval mode (every step but an
  epoch's first).
* ``setattr``: Lightning sets ``_current_fx_name`` on the module at each hook it calls (24 times a step).
  :meth:`lit_zodp.algorithms.base.AlgorithmModule.__setattr__` stores plain values as torch would, without its
  metaclass ``isinstance`` checks. Timed as whole quickstart MeZO fits with the override and without it (deleted from
  the class), alternating in one process, the order rotating; the typical step (the median loop iteration of
  a fit) of each, and the median of the paired ratios.

Usage::

    python benchmarks/bench_step_host.py                      # both parts
    python benchmarks/bench_step_host.py --part setattr --repeats 8 --steps 2000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _common import machine_info, setup_worker  # noqa: E402


def per_call_us(call, number: int = 2000) -> float:
    call()
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def eval_part() -> list[str]:
    from bench_privacy_cost import make_module

    from lit_zodp.backbones import SENTIMENT_LABEL_DESCRIPTIONS, SentenceEncoderClassifier
    from lit_zodp.zo.eval_mode import EvalMode

    backbones = {"all-MiniLM-L6-v2": SentenceEncoderClassifier("minilm", num_classes=2,
                                                               label_descriptions=SENTIMENT_LABEL_DESCRIPTIONS),
                 "text_host BERT 2 x 32": make_module("mezo_no_stats", "text_host").backbone}
    lines = ["| backbone | layers | `eval()` us | `EvalMode.ensure` us (all in eval mode) | after Lightning's `train()` us |",
             "|---|---:|---:|---:|---:|"]
    for name, backbone in backbones.items():
        keeper = EvalMode()
        keeper.ensure(backbone)
        old = per_call_us(backbone.eval)
        new = per_call_us(lambda: keeper.ensure(backbone))
        after_train = per_call_us(lambda: (backbone.train(), keeper.ensure(backbone)), number=500) - per_call_us(
            backbone.train, number=500)
        lines.append(f"| {name} | {len(list(backbone.modules()))} | {old:.1f} | {new:.1f} | {after_train:.1f} |")
    return lines


def setattr_part(steps: int, repeats: int) -> list[str]:
    import bench_privacy_cost as privacy_cost

    from lit_zodp.algorithms import base

    override = base.AlgorithmModule.__dict__["__setattr__"]

    def use(on: bool) -> None:
        if on:
            base.AlgorithmModule.__setattr__ = override
        elif "__setattr__" in base.AlgorithmModule.__dict__:
            del base.AlgorithmModule.__setattr__

    datamodule = privacy_cost.make_datamodule("quickstart")
    privacy_cost.timed_fit("mezo_no_stats", 50, datamodule)  # warm-up
    typical = {True: [], False: []}
    try:
        for repetition in range(repeats):
            for on in ((True, False) if repetition % 2 == 0 else (False, True)):
                use(on)
                fit = privacy_cost.timed_fit("mezo_no_stats", steps, datamodule)
                typical[on].append(fit["median_loop_s"] * 1e3)
                print(f"rep {repetition} override={on}: typical step {typical[on][-1]:.4f} ms", flush=True)
    finally:
        use(True)
    ratios = [a / b for a, b in zip(typical[True], typical[False])]
    return ["| override | typical step per fit (ms) | median |", "|---|---|---:|",
            *(f"| {'on' if on else 'off'} | {', '.join(f'{t:.3f}' for t in typical[on])} | "
              f"{statistics.median(typical[on]):.3f} |" for on in (True, False)),
            "", f"Paired ratio on / off: **{statistics.median(ratios):.3f}** (per repetition "
            f"{min(ratios):.3f}-{max(ratios):.3f})."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["eval", "setattr", "both"], default="both")
    parser.add_argument("--steps", type=int, default=2000, help="steps per quickstart fit (setattr)")
    parser.add_argument("--repeats", type=int, default=6, help="paired fits (setattr)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    setup_worker(args.threads)
    info = machine_info()
    lines = ["# Host time of a zeroth-order step: old way against new", "",
             f"`python benchmarks/bench_step_host.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
             f"{info['cpu']}, {info['cpus']} CPUs, torch {info['torch']}, lightning {info['lightning']}; "
             f"{args.threads} thread(s)", ""]
    if args.part in ("eval", "both"):
        lines += ["## Eval mode each step", "", *eval_part(), ""]
    if args.part in ("setattr", "both"):
        lines += [f"## Module attribute stores (quickstart MeZO, {args.repeats} x {args.steps}-step fits each)", "",
                  *setattr_part(args.steps, args.repeats), ""]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
