"""`--trainer.strategy ddp --trainer.devices 2` (CPU, gloo) gives the update of one process.

Parametrized over every registered private algorithm (part of the privacy contract). With test-only
seeds (run seed for directions, noise_seed, sampling_seed): the two ranks sample
disjoint shards of the same mask, all-reduce their clipped sums and add the same noise, so after N
steps the parameters equal those of one process with the same global batch.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lit_zodp.algorithms import ALGORITHMS
from lit_zodp.cli import build_cli
from lit_zodp.privacy import SpendLog
from tests.test_cli import TINY

PRIVATE = sorted(name for name, cls in ALGORITHMS.items() if cls.private)  # the privacy contract's DDP check


def run(tmp_path, name, algorithm, devices, model_args=None, data_args=None):
    config = yaml.safe_load(yaml.safe_dump(TINY))
    config["trainer"].update(max_steps=16, devices=devices, default_root_dir=str(tmp_path / name),
                             enable_checkpointing=True,
                             callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                         "init_args": {"dirpath": str(tmp_path / name), "save_last": True}}])
    if devices > 1:
        config["trainer"]["strategy"] = "ddp"
    config["model"]["class_path"] = f"lit_zodp.algorithms.{algorithm}"
    config["model"]["init_args"].update(seed=7, noise_seed=5, **(model_args or {}))
    config["data"]["init_args"].update(sampling_seed=123, n_samples=256, **(data_args or {}))
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    arguments = ["fit", "--config", str(path), "--test_after_fit", "false"]
    if devices == 1:  # in this process: the same CLI, without ~10 s of imports in a fresh interpreter
        build_cli(arguments)
    else:  # DDP launches its second rank by re-running the command line: a real console script
        executable = shutil.which("lit-zodp") or str(Path(sys.executable).parent / "lit-zodp")
        if not Path(executable).exists():
            pytest.skip("lit-zodp console script not installed (pip install -e .)")
        result = subprocess.run([executable, *arguments], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
    checkpoint = torch.load(tmp_path / name / "last.ckpt", weights_only=False, map_location="cpu")
    return checkpoint


@pytest.mark.parametrize("algorithm", PRIVATE)
def test_two_ranks_equal_one_process(tmp_path, algorithm, spend_log_per_test):
    single = run(tmp_path, "single", algorithm, devices=1)
    ddp = run(tmp_path, "ddp", algorithm, devices=2)
    assert single["global_step"] == ddp["global_step"] == 16
    start = run_initial_state()
    moved = False
    for key, value in single["state_dict"].items():
        # Per-example float32 losses differ in the last bit between batch shapes, and the central
        # difference divides by 2 lam = 2e-3; 16 such steps drift by ~1e-6. A different direction,
        # mask or noise draw moves the parameters by ~1e-2.
        torch.testing.assert_close(ddp["state_dict"][key], value, rtol=0, atol=2e-5)
        moved |= not torch.equal(value, start[key])
    assert moved, "training did not change the parameters"
    ledger_single = single["privacy"]["ledger"]["entries"]
    assert ledger_single == ddp["privacy"]["ledger"]["entries"]
    assert ledger_single[0]["count"] == 16
    lineage = ddp["privacy"]["plan"]["lineage"]
    assert len(list((spend_log_per_test / lineage).glob("*.json"))) == 1  # rank 0 alone records the branch
    assert sum(SpendLog(spend_log_per_test).released(lineage).values()) == 16


def run_initial_state():
    torch.manual_seed(0)
    from lightning.pytorch import seed_everything

    from lit_zodp.backbones import TinyMLP

    seed_everything(0)
    model = TinyMLP(in_features=16, num_classes=2, hidden=8)
    return {f"backbone.{k}": v for k, v in model.state_dict().items()}


@pytest.mark.slow  # two more CLI fits (~90 s on 2 cores); run with -m slow
def test_two_ranks_probe_the_same_curvature_rates_as_one_process(tmp_path):
    """DPMeZOBCD(block_lr="curvature") probes the public split, the same stream on every rank: both ranks
    set the rates of one process (different rates would split the replicas apart)."""
    options = dict(model_args={"block_lr": "curvature", "curvature_batches": 2}, data_args={"public_fraction": 0.25})
    single = run(tmp_path, "single", "DPMeZOBCD", devices=1, **options)
    ddp = run(tmp_path, "ddp", "DPMeZOBCD", devices=2, **options)
    traces = single["block_state"]["block_curvature"]["trace"]
    assert all(t != 0 for t in traces)
    assert ddp["block_state"]["block_curvature"]["trace"] == pytest.approx(traces, rel=1e-6)
    assert ddp["block_state"]["curvature_factors"] == pytest.approx(single["block_state"]["curvature_factors"])
    for key, value in single["state_dict"].items():
        torch.testing.assert_close(ddp["state_dict"][key], value, rtol=0, atol=2e-5)
