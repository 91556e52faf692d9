"""Empirical privacy audit: what the weights show of one private row, against what the ledger claims.

The attacker of the threat model reads the weights around every step and knows every private row but one, the
canary. The private data here are 8 all-zero rows, which move no release of a model without biases, and in one of
two fits the canary: a row of norm 1e4 labelled with its least likely class, so its every term is clipped to ``C``.
:class:`lit_zodp.callbacks.CanaryAudit` reads each step's release along the canary's term from the weights (and,
for DP-Adam, the optimizer state a checkpoint holds), and returns the weights to the start after each step, so every
step is one trial of the same mechanism. The fits are real ``Trainer.fit`` runs with the secret noise from the OS.

Two parts:

* **Full batch** (every private module): in units of ``C`` the scores are ``N(1, sigma^2)`` with the canary and
  ``N(0, sigma^2)`` without, if the noise, the clipping, the division by ``B`` and the ledger are right. The measured
  ``mu`` (mean shift over spread, with a 95% interval) is set beside the ledger's ``mu`` per step, and the epsilon
  after all steps that the measured ``mu`` implies beside the ledger's (PRV, upper bound). The assumption-free
  Clopper-Pearson bound on one step's epsilon (Jagielski et al. 2020) is set beside one step's accounted epsilon: it
  must stay below it, and is loose by nature.
* **Poisson sampling** (DPZero at a small sigma, where each step shows whether it held the canary): the canary's
  inclusion rate against the accounted ``q`` (Clopper-Pearson interval), the steps whose score says "in" in the fit
  without it (must be 0), and the lag-1 correlation of inclusions (Poisson steps are independent: near 0).

    python benchmarks/audit_privacy.py                    # 2000 steps per module and world, sigma 1 (a few minutes)
    python benchmarks/audit_privacy.py --steps 10000      # intervals of about +-0.03 on mu (13 minutes on 2 busy cores)
    python benchmarks/audit_privacy.py --quick            # 200 steps
"""

from __future__ import annotations

import argparse
import math
import sys
import time

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import _common  # noqa: E402

#: (label, algorithm, overrides) of the full-batch part: every private module, DPZero also with two directions.
CONFIGS = [("DPZero", "DPZero", {}), ("DPZero, 2 directions", "DPZero", {"num_directions": 2}),
           ("DPGD-0th", "DPGD0th", {}), ("DPMeZOBCD", "DPMeZOBCD", {}), ("DPSGD", "DPSGD", {}),
           ("DPAdam", "DPAdam", {}),
           # rank 2 projects the bias-free Linear(10, 3) on its 3-row side: the release is read in the projected space
           ("DPGRAPE, rank 2", "DPGRAPE", {"rank": 2})]
ZERO_ROWS, FEATURES, CLASSES, CANARY_NORM, DELTA = 8, 10, 3, 1e4, 1e-5


def canary_world(with_canary: bool):
    """A bias-free linear classifier, the canary (inputs, label), and the rows: 8 zero rows (+ the canary)."""
    import torch
    from torch import nn

    class BiasFreeLinear(nn.Module):
        num_classes = CLASSES

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.w = nn.Linear(FEATURES, CLASSES, bias=False)

        def forward(self, x):
            return self.w(x)

    backbone = BiasFreeLinear()
    canary = torch.randn(1, FEATURES, generator=torch.Generator().manual_seed(1))
    canary = canary * (CANARY_NORM / canary.norm())
    label = backbone(canary).argmin(1).detach()
    rows = [(torch.zeros(FEATURES), torch.tensor(0))] * ZERO_ROWS
    return backbone, (canary, label), rows + ([(canary[0], label[0])] if with_canary else [])


#: ``--device``: the accelerator of every fit (``cuda``: the fused engine and the device release path).
DEVICE = {"name": "cpu"}


def audited_fit(algorithm: str, overrides: dict, with_canary: bool, steps: int, sigma: float,
                sample_rate: float | None = None) -> tuple[list[float], object]:
    """One fit's scores and its privacy component (full batch, or Poisson at ``sample_rate``)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from datamodules.collate import EmptySafeCollate
    from lit_zodp.algorithms import ALGORITHMS
    from lit_zodp.callbacks import CanaryAudit
    from lit_zodp.privacy import FullBatchSampler, PoissonBatchSampler

    backbone, (canary, label), rows = canary_world(with_canary)
    sampler = (FullBatchSampler(len(rows), steps_per_epoch=steps) if sample_rate is None
               else PoissonBatchSampler(len(rows), sample_rate, steps_per_epoch=steps))
    loader = DataLoader(rows, batch_sampler=sampler, collate_fn=EmptySafeCollate(rows))
    module = ALGORITHMS[algorithm](backbone, lr=0.05, seed=3, clip=1.0, noise_multiplier=sigma, delta=DELTA,
                                   **overrides)
    audit = CanaryAudit(canary, label)
    trainer = pl.Trainer(accelerator="gpu" if DEVICE["name"] == "cuda" else "cpu", devices=1, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[audit])
    trainer.fit(module, loader)
    return audit.scores, module.privacy


def pooled_scores(algorithm: str, overrides: dict, with_canary: bool, steps: int, fit_steps: int,
                  sigma: float) -> tuple[list[float], object]:
    """``steps`` scores from fits of at most ``fit_steps`` steps (the accountant's reach: at sigma 1 the PRV
    accountant cannot compute the epsilon of thousands of full-batch steps, which is in the thousands), and the last
    full-length fit's privacy component."""
    scores, privacy = [], None
    while len(scores) < steps:
        more, component = audited_fit(algorithm, overrides, with_canary, min(fit_steps, steps - len(scores)), sigma)
        scores += more
        privacy = component if privacy is None or len(more) == fit_steps else privacy
    return scores, privacy


def full_batch_row(label: str, algorithm: str, overrides: dict, steps: int, fit_steps: int, sigma: float) -> dict:
    from lit_zodp.privacy.audit import accounted_mu, epsilon_lower_bound, gaussian_epsilon, gaussian_mu, gaussian_spread

    started = time.perf_counter()
    inside, privacy = pooled_scores(algorithm, overrides, True, steps, fit_steps, sigma)
    outside, _ = pooled_scores(algorithm, overrides, False, steps, fit_steps, sigma)
    accounted_steps = privacy.ledger.total_count
    claimed = accounted_mu(privacy.ledger.counts) / math.sqrt(accounted_steps)
    measured = gaussian_mu(inside, outside, confidence=0.95)
    return {"label": label, "steps": steps, "sigma": sigma, "mu_accounted": claimed, "mu_measured": tuple(measured),
            "mu_within": measured.low <= claimed <= measured.high, "fit_steps": accounted_steps,
            "spread_accounted": 1 / claimed, "spread_measured": tuple(gaussian_spread(outside, confidence=0.95)),
            "epsilon_ledger": privacy.epsilon(), "epsilon_from_measured_mu":
                tuple(gaussian_epsilon(math.sqrt(accounted_steps) * max(m, 0.0), DELTA) for m in measured),
            "one_step_epsilon_accounted": gaussian_epsilon(claimed, DELTA),
            "one_step_epsilon_lower_bound": epsilon_lower_bound(inside, outside, delta=DELTA, confidence=0.95),
            "seconds": round(time.perf_counter() - started, 1), "scores_in": inside, "scores_out": outside}


def sampling_row(steps: int, sigma: float, sample_rate: float) -> dict:
    import numpy as np

    from lit_zodp.privacy.audit import clopper_pearson

    started = time.perf_counter()
    # (the RDP accountant: at sigma 0.1 the PRV accountant cannot compute epsilon, which is huge either way)
    inside, privacy = audited_fit("DPZero", {"accountant": "rdp"}, True, steps, sigma, sample_rate)
    outside, _ = audited_fit("DPZero", {"accountant": "rdp"}, False, steps, sigma, sample_rate)
    included = np.asarray(inside) > 0.5
    rate = clopper_pearson(int(included.sum()), included.size, 0.95)
    correlation = float(np.corrcoef(included[:-1], included[1:])[0, 1]) if 0 < included.sum() < included.size else None
    (mechanism, _), = privacy.ledger.counts.items()
    return {"steps": steps, "sigma": sigma, "sample_rate_accounted": mechanism.sample_rate,
            "inclusion_rate": tuple(rate), "rate_within": rate.low <= mechanism.sample_rate <= rate.high,
            "false_inclusions_without_canary": int((np.asarray(outside) > 0.5).sum()),
            "lag1_correlation": correlation, "seconds": round(time.perf_counter() - started, 1),
            "scores_in": inside, "scores_out": outside}


def without_scores(row: dict) -> dict:
    return {key: value for key, value in row.items() if not key.startswith("scores")}


def save_scores(path, result: dict) -> None:
    """Every score, in and out, per full-batch row (by label) and of the sampling part: ``numpy.load(path)``."""
    import numpy as np

    arrays = {f"{row['label']}/{side}": np.asarray(row[f"scores_{side}"]) for row in result["full_batch"]
              for side in ("in", "out")}
    if result["sampling"] is not None:
        arrays |= {f"sampling/{side}": np.asarray(result["sampling"][f"scores_{side}"]) for side in ("in", "out")}
    np.savez_compressed(path, **arrays)
    print(f"wrote {path}")


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# Empirical privacy audit ({meta['steps']} steps per module and world)", "",
             f"`{meta['command']}`  ", f"{meta.get('gpu') or meta['cpu']}, torch {meta['torch']}, "
             f"lightning {meta['lightning']}; "
             f"{_common.load_and_total(meta)}", "",
             f"Full batch, sigma {meta['sigma']}, C 1, delta {DELTA}: 8 zero rows, and the canary in one of the two "
             f"fits; {meta['steps']} steps in each, as fits of {meta['fit_steps']} steps. mu: per step, 95% interval. "
             f"epsilon: of one {meta['fit_steps']}-step fit (ledger: PRV upper bound; measured: the interval's ends "
             "composed over its steps as GDP). One step: the accounted epsilon and the "
             "assumption-free Clopper-Pearson lower bound (95%).", "",
             "| module | mu accounted | mu measured [95%] | noise std / C: 1 / mu accounted, measured without the "
             "canary [95%] | epsilon ledger | epsilon from measured mu | one step: accounted / lower bound | s |",
             "|---|---:|---|---|---:|---|---|---:|"]
    for row in result["full_batch"]:
        mu, low, high = row["mu_measured"]
        lines.append(f"| {row['label']} | {row['mu_accounted']:.3f} | {mu:.3f} [{low:.3f}, {high:.3f}]"
                     f"{'' if row['mu_within'] else ' **outside**'} | {row['spread_accounted']:.3f}, "
                     f"{row['spread_measured'][0]:.3f} [{row['spread_measured'][1]:.3f}, {row['spread_measured'][2]:.3f}]"
                     f"{'' if row['spread_measured'][1] <= row['spread_accounted'] <= row['spread_measured'][2] else ' **outside**'}"
                     f" | {row['epsilon_ledger']:.1f} | "
                     f"{row['epsilon_from_measured_mu'][0]:.1f} [{row['epsilon_from_measured_mu'][1]:.1f}, "
                     f"{row['epsilon_from_measured_mu'][2]:.1f}] | {row['one_step_epsilon_accounted']:.2f} / "
                     f"{row['one_step_epsilon_lower_bound']:.2f} | {row['seconds']:.0f} |")
    sampling = result["sampling"]
    if sampling is None:  # (--modules without DPZero)
        return "\n".join(lines)
    rate, low, high = sampling["inclusion_rate"]
    lines += ["", f"Poisson sampling (DPZero, sigma {sampling['sigma']}, each step shows whether it held the canary): "
              f"accounted q {sampling['sample_rate_accounted']:.3f}; the canary's inclusion rate {rate:.3f} "
              f"[{low:.3f}, {high:.3f}]{'' if sampling['rate_within'] else ' **outside**'}; steps read as holding it "
              f"in the fit without it: {sampling['false_inclusions_without_canary']}; lag-1 correlation of "
              f"inclusions {_common.fmt(sampling['lag1_correlation'])}; {sampling['seconds']:.0f} s."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None,
                        help="scores per module, with and without the canary (default 2000; 200 with --quick)")
    parser.add_argument("--fit-steps", type=int, default=400, help="steps per fit (the accountant's reach at sigma 1)")
    parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier of the full-batch part")
    parser.add_argument("--sampling-sigma", type=float, default=0.1)
    parser.add_argument("--sample-rate", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: every fit on the GPU (fused engine, releases summed on the device)")
    parser.add_argument("--quick", action="store_true", help="200 steps per module and world")
    parser.add_argument("--save-scores", action="store_true", help="also write every score to <stem>.npz")
    parser.add_argument("--out", default=None, help="results stem (default benchmarks/results/audit_privacy)")
    parser.add_argument("--modules", default=None,
                        help="comma list of labels' algorithms to audit (e.g. DPGRAPE); default every module and the "
                             "Poisson sampling part")
    args = parser.parse_args(argv)
    if args.steps is None:  # (not `"--steps" in argv`, which missed `--steps=500`)
        args.steps = 200 if args.quick else 2000
    fit_steps = min(args.fit_steps, args.steps)  # the fits' real length: fewer scores than --fit-steps, one shorter fit
    _common.setup_worker(args.threads)
    DEVICE["name"] = args.device
    if args.device == "cuda":
        import torch

        meta_gpu = torch.cuda.get_device_name(0)
    else:
        meta_gpu = None
    started = time.perf_counter()
    meta = _common.machine_info() | {"command": _common.command_line("audit_privacy.py", argv),
                                     "steps": args.steps, "fit_steps": fit_steps, "sigma": args.sigma,
                                     "device": args.device, "gpu": meta_gpu}
    result = {"meta": meta, "full_batch": [], "sampling": None}
    chosen = None if args.modules is None else set(args.modules.split(","))
    unknown = (chosen or set()) - {algorithm for _, algorithm, _ in CONFIGS}
    if unknown:
        parser.error(f"--modules: unknown {sorted(unknown)}; choose from {sorted({a for _, a, _ in CONFIGS})}")
    for label, algorithm, overrides in CONFIGS:
        if chosen is not None and algorithm not in chosen:
            continue
        result["full_batch"].append(full_batch_row(label, algorithm, overrides, args.steps, fit_steps,
                                                   args.sigma))
        print(without_scores(result["full_batch"][-1]), flush=True)
    if chosen is None or "DPZero" in chosen:  # (the sampling part audits DPZero's Poisson inclusions)
        result["sampling"] = sampling_row(args.steps, args.sampling_sigma, args.sample_rate)
        print(without_scores(result["sampling"]), flush=True)
    _common.finish_meta(meta, started)
    text = markdown(result)
    print(text)
    stem = _common.results_stem(args.out, "audit_privacy", args.quick)
    if args.save_scores:
        save_scores(stem.with_suffix(".npz"), result)
    _common.write_results(stem, text, {"meta": meta, "full_batch": [without_scores(row) for row in result["full_batch"]],
                                       "sampling": result["sampling"] and without_scores(result["sampling"])})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
