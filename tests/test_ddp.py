"""`--trainer.strategy ddp --trainer.devices 2` (CPU, gloo) gives the update of one process.

Parametrized over every registered private algorithm (part of the privacy contract). With test-only
seeds (run seed for directions, noise_seed, sampling_seed): the two ranks sample
disjoint shards of the same mask, all-reduce their clipped sums and add the same noise, so after N
steps the parameters equal those of one process with the same global batch.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from lit_zodp.algorithms import ALGORITHMS
from lit_zodp.cli import build_cli
from lit_zodp.privacy import SpendLog
from tests.test_cli import TINY

PRIVATE = sorted(name for name, cls in ALGORITHMS.items() if cls.private)  # the privacy contract's DDP check
#: TINY's model projects nothing at the default rank, so these two run DP-Adam's path here: slow, beside the
#: projecting-rank DDP test of each (``test_two_ranks_project_on_the_same_subspaces_as_one_process``, slow too).
PROJECTED = {"DPGRAPE", "DPGaLore"}
#: PAZO's public batches: one per step from the DataModule, the same on every rank (slow: ~2 min for the three).
PUBLIC = {name for name in PRIVATE if getattr(ALGORITHMS[name], "needs_public_batches", False)}
PUBLIC_DATA = {"public_fraction": 0.1, "public_in_step": True, "public_batch_size": 6}
#: Options a module needs on TINY (review 58: DPO2NC's default oracle, Alg. 3, refuses TINY's Poisson loader, so both
#: DDP checks failed at its fit start): Alg. 3's tree on a single pass of 16 steps (256 rows, 16 a step), and Alg. 4
#: (``DPO2NC[multi_pass]``) on the Poisson batches; ``DPO2NC[anchored]``: Alg. 3 on an anchored pass.
VARIANTS = {
    "DPO2NC": ({"period": 4, "num_directions": 2}, {"sampling": "single_pass", "batch_size": 16}),
    "DPO2NC[multi_pass]": ({"oracle": "multi_pass", "period": 4, "num_directions": 2}, {}),
    # Alg. 3 with B1 = 4 B2: each step divided by its own expected size, the same on every rank (17 steps)
    "DPO2NC[anchored]": ({"period": 4, "num_directions": 2, "difference_clip": 0.25},
                         {"sampling": "single_pass", "batch_size": 8, "anchor_batch_size": 32, "anchor_period": 4}),
    # Alg. 5: each rank's per-example gradients (torch.func), its examples' points by rank and row
    "DPO2NC[first_order]": ({"estimator": "first_order", "period": 4, "num_directions": 2},
                            {"sampling": "single_pass", "batch_size": 16}),
}


def registry(slow: set) -> list:
    """Every private module and variant, those in ``slow`` marked ``slow``."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name
            for name in PRIVATE + sorted(v for v in VARIANTS if v not in PRIVATE)]


#: DPGD-0th and DP-Adam share DPZero's and DP-SGD's steps but for the release (the privacy component's, one per base
#: in the default suite), so they run with ``-m slow`` (~20 s each on 2 cores: the default suite's budget).
SHARED_PATHS = {"DPGD0th", "DPAdam"}
#: MeZO-BCD's blocks and O2NC's tree, drawn on their bases' secrets, with ``-m slow`` too (stop 59: the default
#: suite took 942 s on two cores, over its 15-minute budget).
REGISTRY = registry(PROJECTED | PUBLIC | set(VARIANTS) - set(PRIVATE) | SHARED_PATHS | {"DPMeZOBCD", "DPO2NC"})
#: The OS-secrets check in the default suite: DPZero's ZO base (rank 0 draws and broadcasts the step's secrets);
#: DP-SGD's first-order base (the same broadcast), MeZO-BCD's blocks and O2NC's tree with ``-m slow`` (stop 59).
OS_SECRETS_REGISTRY = registry(PROJECTED | PUBLIC | set(VARIANTS) - set(PRIVATE) | SHARED_PATHS
                               | {"DPMeZOBCD", "DPO2NC", "DPSGD"})


def importable_from(folder) -> dict:
    """The environment of a CLI subprocess that can import the modules a test wrote into ``folder``."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))


def run_ddp(command, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, **kwargs)`` of a DDP fit, run again (up to twice more)
    where rank 0's store could not listen on its port (EADDRINUSE). Lightning picks ``MASTER_PORT`` by binding port 0
    and closing the socket; until the store binds it, any socket of another process (the other pytest-xdist worker's
    DDP fit: its store, gloo's pairs, its connections) may take the same ephemeral port, ~1 in 14-28 thousand per
    socket made in that window. A retry draws another port; a failure of anything else is returned as it is."""
    for _ in range(3):
        result = subprocess.run(command, capture_output=True, text=True, **kwargs)
        if not any(mark in result.stderr.lower() for mark in ("eaddrinuse", "address already in use")):
            break
    return result


def run(tmp_path, name, algorithm, devices, model_args=None, data_args=None, callbacks=()):
    config = yaml.safe_load(yaml.safe_dump(TINY))
    config["trainer"].update(max_steps=16, devices=devices, default_root_dir=str(tmp_path / name),
                             enable_checkpointing=True,
                             callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                         "init_args": {"dirpath": str(tmp_path / name), "save_last": True}},
                                        *callbacks])
    if devices > 1:
        config["trainer"]["strategy"] = "ddp"
    variant_model, variant_data = VARIANTS.get(algorithm, ({}, {}))
    algorithm = algorithm.split("[")[0]
    config["model"]["class_path"] = f"lit_zodp.algorithms.{algorithm}"
    config["model"]["init_args"].update({"seed": 7, "noise_seed": 5, **variant_model, **(model_args or {})})
    config["data"]["init_args"].update({"sampling_seed": 123, "n_samples": 256,
                                        **(PUBLIC_DATA if algorithm in PUBLIC else {}), **variant_data,
                                        **(data_args or {})})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    arguments = ["fit", "--config", str(path), "--test_after_fit", "false"]
    if devices == 1:  # in this process: the same CLI, without ~10 s of imports in a fresh interpreter
        build_cli(arguments)
    else:  # DDP launches its second rank by re-running the command line: a real console script
        executable = shutil.which("lit-zodp") or str(Path(sys.executable).parent / "lit-zodp")
        if not Path(executable).exists():
            pytest.skip("lit-zodp console script not installed (pip install -e .)")
        env = importable_from(tmp_path)
        result = run_ddp([executable, *arguments], cwd=tmp_path, env=env, timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
    checkpoint = torch.load(tmp_path / name / "last.ckpt", weights_only=False, map_location="cpu")
    return checkpoint


@pytest.mark.parametrize("algorithm", REGISTRY)
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


WARM_START = {"class_path": "lit_zodp.callbacks.PublicWarmStart", "init_args": {"epochs": 3, "lr": 0.1}}


@pytest.mark.slow  # three CLI fits, one of them DDP (~1 min on 2 cores); run with -m slow
def test_two_ranks_warm_start_on_the_public_split_as_one_process(tmp_path, spend_log_per_test):
    """PublicWarmStart (PAZO App. C.1): every rank trains on the same public batches, then rank 0's weights are
    broadcast; the private fit that follows equals one process's, and differs from a fit without the warm start."""
    public = {"public_fraction": 0.1}
    single = run(tmp_path, "single", "DPZero", devices=1, data_args=public, callbacks=[WARM_START])
    ddp = run(tmp_path, "ddp", "DPZero", devices=2, data_args=public, callbacks=[WARM_START])
    cold = run(tmp_path, "cold", "DPZero", devices=1, data_args=public)
    assert single["callbacks"]["PublicWarmStart"] == ddp["callbacks"]["PublicWarmStart"] == {"done": True}
    for key, value in single["state_dict"].items():
        torch.testing.assert_close(ddp["state_dict"][key], value, rtol=0, atol=2e-5)
    assert any((cold["state_dict"][k] - v).abs().max() > 1e-3 for k, v in single["state_dict"].items())


RANK_STATE_MODULE = '''
import torch
from lightning.pytorch.callbacks import Callback


class SaveRankState(Callback):
    """Every rank writes its own parameters at the end of the fit (a checkpoint holds rank 0's only)."""

    def __init__(self, dirpath):
        self.dirpath = dirpath

    def on_train_end(self, trainer, pl_module):
        state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        torch.save(state, f"{self.dirpath}/rank{trainer.global_rank}.pt")
'''


def run_with_os_secrets(tmp_path, name, algorithm) -> list[dict]:
    """A 2-rank fit with no test seeds for the noise or the sampling: each rank's final parameters."""
    (tmp_path / "rank_state.py").write_text(RANK_STATE_MODULE)
    run(tmp_path, name, algorithm, devices=2, model_args={"noise_seed": None}, data_args={"sampling_seed": None},
        callbacks=[{"class_path": "rank_state.SaveRankState", "init_args": {"dirpath": str(tmp_path / name)}}])
    return [torch.load(tmp_path / name / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.parametrize("algorithm", OS_SECRETS_REGISTRY)
def test_with_os_secrets_every_rank_applies_the_same_noise_and_batches(tmp_path, algorithm, spend_log_per_test):
    """The real path: rank 0 draws the noise and sampling secrets from the OS and broadcasts them. A rank
    drawing its own would add different noise or sample another mask: the replicas would drift apart
    silently (the test-seeded check above cannot see it: there every rank holds the same seeds)."""
    rank0, rank1 = run_with_os_secrets(tmp_path, "ddp", algorithm)
    start = run_initial_state()
    assert rank0.keys() == rank1.keys()
    for key, value in rank0.items():
        assert torch.equal(value, rank1[key]), f"{key} differs between the ranks"
    assert any(not torch.equal(rank0[k], v) for k, v in start.items()), "training did not change the parameters"


@pytest.mark.slow  # two 2-rank fits (~45 s on 2 cores); run with -m slow
def test_with_os_secrets_two_runs_of_one_config_draw_different_noise(tmp_path, spend_log_per_test):
    """The secrets are fresh per run: the same config does not reproduce the noise (DPZero, 2 ranks)."""
    first, _ = run_with_os_secrets(tmp_path, "ddp", "DPZero")
    again, _ = run_with_os_secrets(tmp_path, "again", "DPZero")
    assert max((again[k] - v).abs().max().item() for k, v in first.items()) > 1e-4


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


#: DP-GRAPE at a rank that projects: TINY's TinyMLP (hidden 8) has no Linear whose smaller side exceeds the default
#: rank 16, so the registry-wide DDP checks above run DP-GRAPE and DP-GaLore with nothing projected (DP-Adam).
PROJECTING = {"rank": 4, "backbone": {"class_path": "lit_zodp.backbones.TinyMLP",
                                      "init_args": {"in_features": 16, "num_classes": 2, "hidden": 32}}}


@pytest.mark.slow  # three CLI fits, two of them DDP (~2 min on 2 cores); run with -m slow
@pytest.mark.parametrize("algorithm", ["DPGRAPE", "DPGaLore"])
def test_two_ranks_project_on_the_same_subspaces_as_one_process(tmp_path, algorithm, spend_log_per_test):
    """Both sides projected (``net.0`` [32, 16] right, ``net.2`` [32, 32] left; the head [2, 32] not): every rank
    draws the same seeded ``P`` (DP-GRAPE: from the broadcast run seed, also when the config sets none) or the same
    SVD of the broadcast release (DP-GaLore), so two ranks equal one process and stay equal to each other."""
    single = run(tmp_path, "single", algorithm, devices=1, model_args=PROJECTING)
    ddp = run(tmp_path, "ddp", algorithm, devices=2, model_args=PROJECTING)
    moments = [state["exp_avg"].shape for state in ddp["optimizer_states"][0]["state"].values()]
    assert (32, 4) in moments and (4, 32) in moments, moments  # (a projection happened, on both sides)
    for key, value in single["state_dict"].items():
        torch.testing.assert_close(ddp["state_dict"][key], value, rtol=0, atol=2e-5)
    (tmp_path / "rank_state.py").write_text(RANK_STATE_MODULE)
    run(tmp_path, "unseeded", algorithm, devices=2, model_args=PROJECTING | {"seed": None, "noise_seed": None},
        data_args={"sampling_seed": None},
        callbacks=[{"class_path": "rank_state.SaveRankState", "init_args": {"dirpath": str(tmp_path / "unseeded")}}])
    rank0, rank1 = (torch.load(tmp_path / "unseeded" / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for key, value in rank0.items():
        assert torch.equal(value, rank1[key]), f"{key} differs between the ranks"


REFUSING_MODULE = '''
from lit_zodp.algorithms import DPZero
from lit_zodp.errors import PrivacyConfigError


class RefusingDPZero(DPZero):
    """Refuses its third step on rank {rank} only, as a check on that rank's own batch would."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == {rank} and self.global_step == 2:
            raise PrivacyConfigError("refused on this rank's batch")
        return super().training_step(batch, batch_idx)
'''


def _processes_running(marker: str) -> list:
    """PIDs whose command line holds ``marker`` (Linux ``/proc``)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:
            continue
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the ranks left running")
@pytest.mark.parametrize("rank", [pytest.param(0, marks=pytest.mark.slow), 1])  # (rank 0's: -m slow, stop 59)
def test_a_refusal_on_one_rank_stops_every_rank_in_one_line_each(tmp_path, rank):
    """A refusal raised on one rank only (a check on its own batch) ends the DDP fit without a
    traceback and without a rank left waiting in a collective (NCCL waits 30 minutes there). Rank 0's
    refusal: its one line, and the rank it started is stopped before it says anything. Rank 1's
    refusal: its one line, and rank 0's "stopped because another rank failed" line (gloo reports the
    closed connection; Lightning's process observer then stops the rest)."""
    executable = shutil.which("lit-zodp") or str(Path(sys.executable).parent / "lit-zodp")
    if not Path(executable).exists():
        pytest.skip("lit-zodp console script not installed (pip install -e .)")
    (tmp_path / "refusing.py").write_text(REFUSING_MODULE.replace("{rank}", str(rank)))
    config = yaml.safe_load(yaml.safe_dump(TINY))
    config["trainer"].update(devices=2, strategy="ddp")
    config["model"]["class_path"] = "refusing.RefusingDPZero"
    path = tmp_path / f"refusal-on-rank-{rank}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = importable_from(tmp_path)
    result = run_ddp([executable, "fit", "--config", str(path)], cwd=tmp_path, env=env, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("lit-zodp: error:")]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors[0] == f"lit-zodp: error: rank {rank}: refused on this rank's batch"
    if rank == 0:
        assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
        assert "stopping the 1 rank(s) it started" in result.stderr
    else:
        assert result.returncode == 1 and len(errors) == 2, result.stderr[-3000:]
        assert errors[1].startswith("lit-zodp: error: rank 0: stopped because another rank failed")
    time.sleep(1)
    assert not _processes_running(str(path)), "a rank is still running"


QA_PROBE_MODULE = '''
import json

from lightning.pytorch.callbacks import Callback

from lit_zodp.backbones import HFAnswerGenerator


class HalfRightGenerator(HFAnswerGenerator):
    """Generates as HFAnswerGenerator, then answers the gold "seven" where the prompt's token sum is odd: F1 and EM
    means strictly between 0 and 1 (a tiny random model's own answers score 0), so a row counted twice shows."""

    def generate_answers(self, inputs):
        generated = super().generate_answers(inputs)
        return ["seven" if sum(p) % 2 else g for p, g in zip(self.prompts(inputs), generated)]


class SaveEvaluation(Callback):
    """Every rank appends its logged val/test metrics to ``<path>.rank<r>.jsonl``."""

    def __init__(self, path):
        self.path = path

    def _save(self, trainer):
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val_", "test_"))}
        with open(f"{self.path}.rank{trainer.global_rank}.jsonl", "a") as handle:
            handle.write(json.dumps(metrics) + "\\n")

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._save(trainer)

    def on_test_end(self, trainer, pl_module):
        self._save(trainer)
'''


def run_qa(tmp_path, name, devices) -> list[list[dict]]:
    """A tiny generative-QA fit (QADataModule + HFAnswerGenerator, validation every 2 steps, the best val_loss
    checkpoint tested): each rank's logged val/test metrics in order."""
    from datamodules.testing import QA_WORDS, write_qa_files
    from lit_zodp.backbones.tiny_hf import save_tiny_pretrained

    opt = tmp_path / "opt"
    if not opt.exists():
        save_tiny_pretrained(opt, "opt", vocab_texts=[QA_WORDS])
        write_qa_files(tmp_path, "SQuAD", train=3, test=3)
        (tmp_path / "qa_probe.py").write_text(QA_PROBE_MODULE)
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": devices, "max_steps": 4, "val_check_interval": 2,
                    "check_val_every_n_epoch": None, "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "default_root_dir": str(tmp_path / name),
                    "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": str(tmp_path / name), "monitor": "val_loss"}},
                                  {"class_path": "qa_probe.SaveEvaluation",
                                   "init_args": {"path": str(tmp_path / name / "metrics")}}]},
        "model": {"class_path": "lit_zodp.algorithms.DPZero", "init_args": {
            "backbone": {"class_path": "qa_probe.HalfRightGenerator",
                         "init_args": {"model_name_or_path": str(opt), "max_new_tokens": 3}},
            "lr": 1e-3, "clip": 1.0, "noise_multiplier": 1.0, "seed": 7, "noise_seed": 5}},
        "data": {"class_path": "datamodules.QADataModule", "init_args": {
            "task": "SQuAD", "data_dir": str(tmp_path), "tokenizer": str(opt), "max_length": 64, "num_train": 8,
            "num_dev": 3, "num_test": 5, "bos_token_id": 0, "batch_size": 4, "eval_batch_size": 2,
            "sampling_seed": 1}},
        "test_ckpt": "best",
    }
    if devices > 1:
        config["trainer"]["strategy"] = "ddp"
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    executable = shutil.which("lit-zodp") or str(Path(sys.executable).parent / "lit-zodp")
    if not Path(executable).exists():
        pytest.skip("lit-zodp console script not installed (pip install -e .)")
    result = run_ddp([executable, "fit", "--config", str(path)], cwd=tmp_path, env=importable_from(tmp_path),
                     timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [[json.loads(line) for line in (tmp_path / name / f"metrics.rank{r}.jsonl").read_text().splitlines()]
            for r in range(devices)]


@pytest.mark.slow  # two CLI fits with generation (~35 s on 2 cores); run with -m slow
def test_two_ranks_evaluate_generated_answers_as_one_process(tmp_path, spend_log_per_test):
    """Generative QA under DDP: each rank generates over the whole evaluation split (shard_eval off) and the
    F1/EM/loss states are summed over the ranks, so validation and test (of the best val_loss checkpoint) log the
    means of one process, every example counted once (5 test rows, 3 validation rows: not divisible by 2)."""
    (single,) = run_qa(tmp_path, "single", devices=1)
    rank0, rank1 = run_qa(tmp_path, "ddp", devices=2)
    assert [list(m) for m in single] == [["val_loss", "val_f1", "val_em"]] * 2 + [["test_loss", "test_f1", "test_em"]]
    assert 0 < single[-1]["test_f1"] < 1 and 0 < single[0]["val_f1"] < 1
    assert rank0 == rank1
    for one, ddp in zip(single, rank0, strict=True):
        assert ddp == pytest.approx(one, rel=1e-6)
