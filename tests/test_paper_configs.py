"""Every paper config loads and runs a few steps with a tiny random model of the same family.

The configs name real checkpoints (roberta-large, facebook/opt-*) and data folders; here the same
files are run with the model and tokenizer paths pointed at a tiny randomly initialised model of the
same family saved to disk (the real `from_pretrained` path, no download) and the data folder at
small files written in the real formats.
"""

import functools
from pathlib import Path

import pytest
import torch
import yaml

from datamodules.testing import QA_WORDS, write_qa_files, write_task_files
from datamodules.text_tasks import get_task
from lit_zodp.backbones import save_tiny_pretrained
from lit_zodp.cli import build_cli
from tests.conftest import parametrize_configs

ROOT = Path(__file__).resolve().parents[1]
ALL_CONFIGS = sorted((ROOT / "configs" / "dpzero").glob("*.yaml"))
#: Sec. 5.1's synthetic quadratic: no model or data files (:func:`test_synthetic_config_runs_at_a_small_dimension`)
SYNTHETIC = [p for p in ALL_CONFIGS if p.stem.startswith("sec51_")]
CONFIGS = [p for p in ALL_CONFIGS if p not in SYNTHETIC]
#: Run by default: every task of Table 2 and Table 4 once (DPZero at epsilon 2, one MeZO per table), and each
#: first-order method of Table 2 once (AdamW, DP-AdamW, LoRA, DP-LoRA), on tasks of 2, 3 and 6 classes. The others
#: differ from these only in target_epsilon, the task's data (run by the DPZero rows) or in the model id (the same
#: tiny model here): slow.
DEFAULT = {f"table2_roberta-large_{task}_dpzero_eps2" for task in ("mnli", "rte", "snli", "sst2", "sst5", "trec")} | {
    "table4_opt-1.3b_boolq_dpzero_eps2", "table4_opt-1.3b_sst2_dpzero_eps2", "table2_roberta-large_sst2_mezo",
    "table4_opt-1.3b_sst2_mezo", "table2_roberta-large_sst2_adamw", "table2_roberta-large_mnli_dpadamw_eps2",
    "table2_roberta-large_rte_lora", "table2_roberta-large_trec_dplora_eps2", "table5_opt-1.3b_squad_dpzero_eps2",
    "table5_opt-1.3b_drop_mezo"}
FIRST_ORDER_PRIVATE = [p for p in CONFIGS if "dpadamw_eps" in p.stem or "dplora_eps" in p.stem]
#: MeZO-BCD's configs of Hub models (the MiniLM ones run in the movie-review tests; opt-125m in test_cli): the
#: private RoBERTa one by default.
BCD_CONFIGS = sorted(p for p in (ROOT / "configs" / "mezo_bcd").glob("*.yaml") if p.stem.startswith(("roberta", "opt")))
DEFAULT |= {"roberta-large_sst2_dp_mezo_bcd_eps2", "opt-13b_record_mezo_bcd"}
#: MeZO-BCD's Table 2 (OPT-13B), written by configs/mezo_bcd/generate.py: the other files there are hand-written
BCD_TABLE2 = sorted(p for p in BCD_CONFIGS if p.stem.startswith("opt-13b_"))


def load_generator(folder: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"generate_{folder}", ROOT / "configs" / folder / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    return generate


def assert_committed_configs_match_the_generator(folder: str, committed: list) -> None:
    """``configs/<folder>/generate.py`` writes exactly the ``committed`` files, each with the text committed."""
    expected = load_generator(folder).all_configs()
    assert sorted(expected) == committed
    for path, text in expected.items():
        assert path.read_text() == text, f"{path.name} is stale: run python configs/{folder}/generate.py"


@pytest.mark.parametrize("folder, committed", [("dpzero", ALL_CONFIGS), ("mezo_bcd", BCD_TABLE2)])
def test_committed_configs_match_the_generator(folder, committed):
    assert_committed_configs_match_the_generator(folder, committed)


def test_mezo_bcd_table2_covers_its_eleven_columns():
    """Table 2's eleven columns; MeZO's per-task draws and losses (mezo.sh: ReCoRD and COPA LM-style)."""
    configs = {p.stem.split("_")[1]: yaml.safe_load(p.read_text()) for p in BCD_TABLE2}
    assert sorted(configs) == sorted(["sst2", "rte", "cb", "boolq", "wsc", "wic", "multirc", "copa", "record", "squad",
                                      "drop"])
    for task, config in configs.items():
        data, model = config["data"]["init_args"], config["model"]["init_args"]
        assert (data["bos_token_id"], data["batch_size"], data["num_train"], data["num_test"]) == (0, 16, 1000, 1000)
        assert data["num_dev"] == (100 if task in ("cb", "copa") else 500)  # mezo.sh: DEV=100 for CB and Copa
        assert (model["lr"], model["lam"], model["order"], config["trainer"]["max_steps"]) == (1e-5, 1e-3, "random",
                                                                                             20_000)
        backbone = model["backbone"]["init_args"]
        if data.get("prompt") == "causal":  # --train_as_classification but for COPA, ReCoRD (LM-style on the gold)
            assert backbone.get("loss", "classification") == ("lm" if task in ("copa", "record") else "classification")
            assert backbone["length_normalize"] and data["max_length"] == 2048


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("paper")
    words = [w for task in ("SST-5", "TREC", "MNLI", "BoolQ") for w in get_task(task).label_words]
    texts = [" ".join(words * 20), " ".join(f"It was {w}." for w in words * 20), QA_WORDS]
    models = {family: save_tiny_pretrained(root / family, family, vocab_texts=texts)
              for family in ("roberta", "opt")}
    data = {}
    for task in ("SST-2", "SST-5", "SNLI", "MNLI", "RTE", "TREC"):
        write_task_files(root / "original", task, "glue")
    data["original"] = root / "original"
    write_task_files(root / "glue", "SST-2", "glue")
    write_task_files(root / "boolq", "BoolQ", "superglue")  # the original BoolQ's jsonl files (MeZO's)
    data["glue"], data["boolq"] = root / "glue", root / "boolq"
    for task in ("RTE", "CB", "WIC", "WSC", "COPA", "MultiRC", "ReCoRD"):  # SuperGLUE's jsonl (MeZO-BCD's Table 2)
        write_task_files(root / "superglue", task, "superglue")
    data["superglue"] = root / "superglue"
    data["squad"], data["drop"] = write_qa_files(root, "SQuAD"), write_qa_files(root, "DROP")  # official JSON
    return models, data


def overrides(config: dict, models: dict, data: dict) -> list[str]:
    backbone = "--model.init_args.backbone.init_args"
    family = "opt" if "opt" in config["data"]["init_args"]["tokenizer"] else "roberta"
    data_dir = data[Path(config["data"]["init_args"]["data_dir"]).name]
    args = [f"{backbone}.model_name_or_path", models[family], f"{backbone}.dtype", "float32",
            "--data.init_args.tokenizer", models[family], "--data.init_args.data_dir", str(data_dir),
            "--data.init_args.batch_size", "2", "--data.init_args.num_test", "2",
            "--data.init_args.max_length", "64",
            "--trainer.accelerator", "cpu", "--trainer.max_steps", "2", "--trainer.logger", "false",
            "--trainer.val_check_interval", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false"]
    if config["data"]["init_args"].get("k_shot"):  # 2 per class to train, the next 2 for dev (k_dev)
        args += ["--data.init_args.k_shot", "2", "--data.init_args.k_dev", "2"]
    else:
        args += ["--data.init_args.num_train", "6", "--data.init_args.num_dev", "2"]
    return args


@parametrize_configs(CONFIGS + BCD_CONFIGS, DEFAULT)
def test_paper_config_runs_with_a_tiny_model_of_the_same_family(path, tiny_world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    models, data = tiny_world
    config = yaml.safe_load(path.read_text())
    cli = build_cli(["fit", "--config", str(path), *overrides(config, models, data)])
    assert cli.trainer.global_step == 2
    model = cli.model
    if config["model"]["class_path"].endswith(("DPZero", "DPAdam")):
        assert model.privacy.target_epsilon == config["model"]["init_args"]["target_epsilon"]
        assert model.privacy.delta == 1e-5
        assert 0 < model.privacy.ledger.epsilon(model.privacy.delta).upper <= model.privacy.target_epsilon
    backbone = config["model"]["init_args"]["backbone"]["init_args"]
    if backbone.get("untie_word_embeddings"):  # the reference models' own decoder, trained apart from the embeddings
        lm = model.backbone.model
        assert lm.get_input_embeddings().weight is not lm.lm_head.decoder.weight
    if backbone.get("lora"):  # LoRA on query/value and a copy of the LM head train; nothing else
        trained = [n for n, p in model.backbone.named_parameters() if p.requires_grad]
        assert trained and all("lora_" in n or "lm_head.modules_to_save" in n for n in trained)
        assert {id(p) for p in model.engine.params} == {id(p) for p in model.backbone.parameters() if p.requires_grad}
    generative = config["data"]["class_path"] == "datamodules.QADataModule"  # Table 5: F1 of generated answers
    assert ("test_f1" if generative else "test_acc") in cli.trainer.callback_metrics
    dm = cli.datamodule  # validation on dev examples held out of the private pool, never on the test set
    assert dm.val_dataset is not None and dm.val_dataset is not dm.test_dataset and len(dm.val_dataset) > 0
    if config.get("test_ckpt") == "best":  # the best dev checkpoint is the one tested (DPZero's: the lowest val_loss)
        monitor = config["trainer"]["callbacks"][0]["init_args"]["monitor"]
        assert cli.trainer.checkpoint_callback.monitor == monitor
        assert monitor == "val_loss" or path.parent.name == "mezo_bcd"
        assert cli.trainer.checkpoint_callback.best_model_path


def injected_and_rdp_noise(path: Path) -> tuple[float, float, float]:
    """A private config's ``(injected noise std, Opacus RDP sigma of its (eps, delta, q = B / n, T), C / B)``: the
    std its module adds to the clipped sum's mean, planned as a fit of the config would, on a stand-in MLP."""
    from opacus.accountants.utils import get_noise_multiplier

    from lit_zodp import algorithms
    from lit_zodp.privacy import PoissonSampling
    from tests.conftest import mlp

    config = yaml.safe_load(path.read_text())
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    n = data["k_shot"] * len(get_task(data["task"]).label_words) if data.get("k_shot") else data["num_train"]
    B, steps = data["batch_size"], config["trainer"]["max_steps"]
    cls = getattr(algorithms, config["model"]["class_path"].rsplit(".", 1)[1])
    module = cls(mlp(), **{k: v for k, v in model.items() if k != "backbone"})
    module.privacy.plan(step_plan=module.step_plan(), sampling=PoissonSampling(n, B / n), planned_steps=steps)
    (release,) = module.step_plan()
    injected = module.privacy._noise_std(release) / module.privacy.expected_batch_size
    sigma = get_noise_multiplier(target_epsilon=model["target_epsilon"], target_delta=model["delta"],
                                 sample_rate=B / n, steps=steps)
    return injected, sigma, model["clip"] / B


@pytest.mark.parametrize("path", [p for p in CONFIGS if "dpzero_eps" in p.stem], ids=lambda p: p.stem)
def test_paper_config_injects_the_reference_noise(path):
    """std = 2 sigma C / B, sigma = Opacus get_noise_multiplier(eps, delta, q = B / n, T) (DPZero's trainers)."""
    injected, sigma, clip_over_b = injected_and_rdp_noise(path)
    assert "DPZero" in yaml.safe_load(path.read_text())["model"]["class_path"]
    assert injected == pytest.approx(2 * sigma * clip_over_b, rel=1e-12)


@functools.lru_cache
def private_transformers_sigma(target_epsilon, delta, q, steps, threshold=1e-3):
    """The noise multiplier as private-transformers calibrates it (``RDPManager.compute_sigma``): bisection on sigma
    until the bracket is narrower than ``threshold``, returning its upper end, with RDP at Opacus's orders (the same
    orders) and the conversion of Canonne, Kamath and Steinke (Opacus's ``get_privacy_spent``)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp

    def epsilon(sigma):
        orders = RDPAccountant.DEFAULT_ALPHAS
        return rdp.get_privacy_spent(orders=orders, rdp=rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps,
                                                                        orders=orders), delta=delta)[0]

    low, high = 0.1, 4.0
    while epsilon(high) >= target_epsilon:
        high *= 2
    while epsilon(low) <= target_epsilon:
        low /= 2
    while high - low > threshold:
        mid = (low + high) / 2
        low, high = (low, mid) if epsilon(mid) < target_epsilon else (mid, high)
    return high


@pytest.mark.filterwarnings("ignore:Optimal order")
@pytest.mark.parametrize("path", FIRST_ORDER_PRIVATE, ids=lambda p: p.stem)
def test_first_order_paper_config_injects_private_transformers_noise(path):
    """private-transformers' PrivacyEngine: ``(sum_i clip_C(g_i) + N(0, sigma^2 C^2 I)) / B`` with sigma from its RDP
    accountant for (epsilon, delta, q = B / n, T) under add/remove-one neighbours. Ours: Opacus's calibration of the
    same RDP curve (``accountant: rdp``), within 0.3% of private-transformers' bisection, and never above the target."""
    from opacus.accountants.utils import get_noise_multiplier

    from lit_zodp.algorithms import DPAdam
    from lit_zodp.privacy import PoissonSampling
    from tests.conftest import mlp

    config = yaml.safe_load(path.read_text())
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    n = data["k_shot"] * len(get_task(data["task"]).label_words)
    B, steps = data["batch_size"], config["trainer"]["max_steps"]
    assert (steps, B, model["delta"], model["neighbours"], model["accountant"]) == (1000, 64, 1e-5, "add_remove", "rdp")
    module = DPAdam(mlp(), **{k: v for k, v in model.items() if k not in ("backbone", "lr_scheduler")})
    module.privacy.plan(step_plan=module.step_plan(), sampling=PoissonSampling(n, B / n), planned_steps=steps)
    (release,) = module.step_plan()
    injected = module.privacy._noise_std(release) / module.privacy.expected_batch_size
    sigma = get_noise_multiplier(target_epsilon=model["target_epsilon"], target_delta=model["delta"],
                                 sample_rate=B / n, steps=steps)
    assert injected == pytest.approx(sigma * model["clip"] / B, rel=1e-12)  # no factor 2: add/remove-one
    theirs = private_transformers_sigma(model["target_epsilon"], model["delta"], B / n, steps)
    assert injected == pytest.approx(theirs * model["clip"] / B, rel=3e-3)


@pytest.mark.parametrize("path", SYNTHETIC, ids=lambda p: p.stem)
def test_synthetic_config_runs_at_a_small_dimension(path, tmp_path, monkeypatch):
    """DPZero Sec. 5.1 / App. B.1 as configured (Table 6's epsilon, delta, lambda; full batch; x_0 = 0), run through
    the CLI at d = 8 with fewer rows: the same modules, data module and metrics."""
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(path.read_text())
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    assert (model["target_epsilon"], model["delta"], model["clip"] > 0) == (2.0, 1e-6, True)
    assert data["sampling"] == "full_batch" and data["n_train"] == data["n_test"] == 10_000
    assert model["backbone"]["init_args"]["dim"] == data["dim"] and model["backbone"]["init_args"]["init"] == 0
    if "lam" in model:
        assert (model["lam"], model["directions"]) == (1e-4, "sphere")
    cli = build_cli(["fit", "--config", str(path), "--model.init_args.backbone.init_args.dim", "8",
                     "--data.init_args.dim", "8", "--data.init_args.n_train", "200", "--data.init_args.n_test", "100",
                     "--data.init_args.epoch_steps", "4", "--trainer.max_steps", "4", "--trainer.val_check_interval",
                     "2", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
                     "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                     "--trainer.enable_checkpointing", "false"])
    assert cli.trainer.global_step == 4
    assert 0 < cli.model.privacy.ledger.epsilon(1e-6).upper <= 2.0
    assert cli.model.privacy.sampling.name == "full_batch"
    assert "test_grad_norm" in cli.trainer.callback_metrics  # (the test after fit; validation logged val_grad_norm)
    assert cli.model.backbone.x.dtype == torch.float64


def test_every_readme_pointer_of_the_configs_names_a_readme_section():
    """The configs' `(data layout: see README, '<section>')` comments name a section README.md has."""
    import re

    headings = {line.lstrip("#").strip() for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("#")}
    files = [*(ROOT / "configs").rglob("*.yaml"), ROOT / "configs" / "dpzero" / "generate.py"]
    pointers = {path.name: re.findall(r"see README, '([^']+)'", path.read_text()) for path in files}
    pointed = {name: found for name, found in pointers.items() if found}
    # 90 DPZero + 16 MeZO-BCD OPT/RoBERTa + 52 DP-GRAPE (Tables 3, 4, 12) + 25 PAZO (Table 5) + 126 PAZO (Tables 2-4)
    # + 18 PAZO (Table 7)
    assert len([name for name in pointed if name.endswith(".yaml")]) == 327
    assert {title for found in pointed.values() for title in found} <= headings
