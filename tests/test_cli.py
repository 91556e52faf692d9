"""The CLI as a user runs it: `lightning fit --config ...` end to end, in process and as a console script."""

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from lit_zodp.cli import build_cli, result_line

TINY = {
    "seed_everything": 0,
    "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 30, "logger": False,
                "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False},
    "model": {"class_path": "lit_zodp.algorithms.DPZero", "init_args": {
        "backbone": {"class_path": "lit_zodp.backbones.TinyMLP",
                     "init_args": {"in_features": 16, "num_classes": 2, "hidden": 8}},
        "lr": 0.05, "clip": 1.0, "target_epsilon": 3.0}},
    "data": {"class_path": "datamodules.SyntheticClassificationDataModule",
             "init_args": {"batch_size": 32, "n_samples": 512, "n_features": 16, "num_classes": 2}},
}


QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def write_config(tmp_path, config=TINY, name="tiny.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def test_fit_config_end_to_end_in_process(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["fit", "--config", str(write_config(tmp_path))])
    model = cli.model
    assert cli.trainer.global_step == 30
    assert model.privacy.ledger.total_count == 30
    spent = model.privacy.ledger.epsilon(model.privacy.delta).upper
    assert 2.5 < spent <= 3.0
    assert cli.trainer.callback_metrics["test_acc"] > 0.5  # test set evaluated after fit
    line = result_line(model, cli.datamodule, cli.trainer, {"test_acc": 0.9}, 1.0)
    assert line.startswith("RESULT task=SyntheticClassificationDataModule algorithm=DPZero epsilon=")


def test_the_result_line_names_a_text_modules_paper_task(tmp_path):
    from types import SimpleNamespace

    from datamodules import PromptTextDataModule, QADataModule
    from lit_zodp.algorithms import MeZO
    from tests.conftest import mlp

    trainer = SimpleNamespace(global_step=3)
    for dm, task in ((PromptTextDataModule("sst2", str(tmp_path)), "SST-2"), (QADataModule("drop", str(tmp_path)), "DROP")):
        assert result_line(MeZO(mlp(), lr=0.1), dm, trainer, {}, 1.0).startswith(f"RESULT task={task} algorithm=MeZO ")


def test_bad_config_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(yaml.safe_dump(TINY))
    config["model"]["init_args"]["target_epsilon"] = -1.0
    with pytest.raises(Exception, match="target_epsilon"):
        build_cli(["fit", "--config", str(write_config(tmp_path, config))])


def test_sample_rate_above_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(yaml.safe_dump(TINY))
    config["data"]["init_args"]["batch_size"] = 5000
    with pytest.raises(Exception, match="sample"):
        build_cli(["fit", "--config", str(write_config(tmp_path, config))])


@pytest.mark.parametrize("script", ["lightning", "lit-zodp"])
def test_console_scripts(tmp_path, script):
    executable = shutil.which(script) or str(Path(sys.executable).parent / script)
    if not Path(executable).exists():
        pytest.skip(f"{script} console script not installed (pip install -e .)")
    result = subprocess.run([executable, "fit", "--config", str(write_config(tmp_path))], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "RESULT task=SyntheticClassificationDataModule algorithm=DPZero" in output
    assert "Privacy spent: epsilon" in output
    # none of Lightning's lines a user cannot act on: torch's LeafSpec deprecation inside Lightning, an
    # "override" of this package's own callbacks at the test after fit
    assert "LeafSpec" not in output and "will override existing callbacks" not in output


def test_quickstart_config_runs_a_few_steps(tmp_path, monkeypatch):
    """The README's quickstart config, shortened: real digits, DPZero, epsilon spent <= its target."""
    monkeypatch.chdir(tmp_path)
    root = Path(__file__).resolve().parents[1]
    cli = build_cli(["fit", "--config", str(root / "configs" / "quickstart.yaml"),
                     "--trainer.max_steps", "20", "--trainer.enable_progress_bar", "false"])
    target = cli.model.privacy.target_epsilon
    assert cli.trainer.global_step == 20
    assert 0 < cli.model.privacy.ledger.epsilon(cli.model.privacy.delta).upper <= target
    assert "test_acc" in cli.trainer.callback_metrics


def test_test_subcommand_prints_a_result_line_for_the_untrained_model(tmp_path, monkeypatch, caplog):
    import logging

    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):
        cli = build_cli(["test", "--config", str(write_config(tmp_path))])
    assert cli.trainer.global_step == 0
    assert any("RESULT task=SyntheticClassificationDataModule" in r.getMessage() and "steps=0" in r.getMessage() and "epsilon=0.000" in r.getMessage()
               for r in caplog.records)


def test_movie_review_example_config_runs_two_steps(tmp_path, monkeypatch):
    """The offline MiniLM example (real Rotten Tomatoes reviews), shortened to two steps."""
    monkeypatch.chdir(tmp_path)
    root = Path(__file__).resolve().parents[1]
    cli = build_cli(["fit", "--config", str(root / "configs" / "movie_reviews" / "dpzero_eps2.yaml"),
                     "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
                     "--trainer.accelerator", "cpu", "--test_after_fit", "false",
                     "--data.init_args.max_private_samples", "320"])
    assert cli.trainer.global_step == 2
    assert cli.model.privacy.ledger.total_count == 2


def test_a_configuration_error_ends_in_one_line_and_exit_code_2(tmp_path):
    executable = shutil.which("lit-zodp") or str(Path(sys.executable).parent / "lit-zodp")
    if not Path(executable).exists():
        pytest.skip("lit-zodp console script not installed (pip install -e .)")
    result = subprocess.run([executable, "fit", "--config", str(write_config(tmp_path)), "--model.init_args.clip", "0"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == ["lit-zodp: error: Invalid configuration: Expected `clip` to be a positive float (or inf: `.inf` in YAML), "
                      "but got 0.0"]
    assert "Traceback" not in result.stderr and "Namespace(" not in result.stderr


def _fit_with_checkpoint(tmp_path, *extra, config=TINY, name="tiny.yaml"):
    config = yaml.safe_load(yaml.safe_dump(config))
    config["trainer"].update(enable_checkpointing=True, callbacks=[{
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True}}])
    return build_cli(["fit", "--config", str(write_config(tmp_path, config, name)), "--test_after_fit", "false",
                      *extra])


def test_a_checkpoint_holding_a_test_seed_resumes_with_the_configured_one(tmp_path, monkeypatch):
    """Audit, 2026-11-28: a checkpoint from before ``noise_seed`` left ``hparams`` still carried it, and a resume
    configured with ``noise_seed: null`` kept it (the noise reproducible)."""
    import torch

    monkeypatch.chdir(tmp_path)
    _fit_with_checkpoint(tmp_path, "--trainer.max_steps", "4", "--model.init_args.noise_seed", "5")
    last = tmp_path / "ckpt" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=False)
    assert "noise_seed" not in checkpoint["hyper_parameters"]
    checkpoint["hyper_parameters"]["noise_seed"] = 5  # as an older checkpoint holds it
    torch.save(checkpoint, last)
    resumed = _fit_with_checkpoint(tmp_path, "--trainer.max_steps", "6", "--ckpt_path", str(last))
    assert resumed.model.privacy.noise_seed is None  # fresh noise; the run stays marked: its first 4 steps' noise
    assert resumed.model.privacy.test_seeded  # is reproducible from the first config's seed (review 31)


def test_a_resume_through_the_cli_never_spends_past_the_budget(tmp_path, monkeypatch):
    """The audit's case through the CLI: planned for epsilon 3 over 30 steps, resumed to 60 steps."""
    monkeypatch.chdir(tmp_path)
    first = _fit_with_checkpoint(tmp_path)
    assert first.trainer.global_step == 30
    last = str(tmp_path / "ckpt" / "last.ckpt")
    resumed = _fit_with_checkpoint(tmp_path, "--trainer.max_steps", "60", "--ckpt_path", last)
    assert resumed.trainer.global_step < 60 and resumed.model.privacy.epsilon() <= 3.0
    stricter = _fit_with_checkpoint(tmp_path, "--trainer.max_steps", "60", "--ckpt_path", last,
                                    "--model.init_args.max_epsilon", "2.0")
    assert stricter.model.privacy.budget == 2.0
    assert stricter.model.privacy.ledger.total_count == 30  # 3 > 2 already: not one more step


def test_an_optimizer_override_is_not_an_option(tmp_path, monkeypatch):
    """LightningCLI's `optimizer:` would replace the module's optimizer, whose steps the ledger counts (audit 4)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        build_cli(["fit", "--config", str(write_config(tmp_path)), "--optimizer", "torch.optim.SGD",
                   "--optimizer.lr", "0.05"])


@pytest.mark.parametrize("name", ["quickstart_dpsgd", "quickstart_dpadam", "quickstart_dpgrape", "vit_mnist_dpadam"])
def test_first_order_configs_run_a_few_steps(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "configs" / "first_order" / f"{name}.yaml"
    cli = build_cli(["fit", "--config", str(config), "--trainer.max_steps", "3", "--trainer.accelerator", "cpu",
                     "--trainer.enable_progress_bar", "false", "--test_after_fit", "false",
                     "--data.init_args.batch_size", "16", "--data.init_args.max_private_samples", "800"])
    assert cli.trainer.global_step == cli.model.privacy.steps == 3
    assert 0 < cli.model.privacy.epsilon() <= cli.model.privacy.target_epsilon


# ------------------------------------------------------------------ configuration errors of a new user


@pytest.fixture(scope="module")
def prompt_world(tmp_path_factory):
    """A tiny RoBERTa on disk and GLUE SST-2 files: a Table 2-style prompt config that runs offline."""
    from datamodules.testing import write_task_files
    from lit_zodp.backbones import save_tiny_pretrained

    root = tmp_path_factory.mktemp("prompt_world")
    model = save_tiny_pretrained(root / "roberta", "roberta")
    write_task_files(root / "original", "SST-2", "glue")
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 1, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"class_path": "lit_zodp.algorithms.MeZO", "init_args": {
            "backbone": {"class_path": "lit_zodp.backbones.HFPromptClassifier",
                         "init_args": {"model_name_or_path": model, "label_words": ["terrible", "great"]}},
            "lr": 1.0e-6}},
        "data": {"class_path": "datamodules.PromptTextDataModule", "init_args": {
            "task": "SST-2", "data_dir": str(root / "original"), "tokenizer": model, "faithful": True,
            "max_length": 48, "k_shot": 2, "k_dev": 2, "batch_size": 2}},
    }
    path = root / "prompt.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_config_error_of_any_component_is_caught_by_its_base_class():
    from lit_zodp.cli import configuration_error
    from lit_zodp.errors import AccountingError, ConfigError, PrivacyConfigError

    assert issubclass(PrivacyConfigError, ConfigError) and issubclass(AccountingError, ConfigError)
    assert issubclass(ConfigError, ValueError)
    try:
        try:
            raise ConfigError("bad `label_words`")
        except ConfigError as inner:
            raise ValueError("jsonargparse's wrapper") from inner
    except ValueError as outer:
        assert str(configuration_error(outer)) == "bad `label_words`"
    assert configuration_error(ValueError("other")) is None


def test_replacing_the_prompt_backbone_on_the_command_line_is_refused_in_one_line(prompt_world, tmp_path,
                                                                                   monkeypatch, capsys):
    """jsonargparse drops label_words when the class changes: a new random head would train from chance."""
    from lit_zodp.cli import cli_main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(prompt_world),
                  "--model.init_args.backbone.class_path", "lit_zodp.backbones.HFSequenceClassifier"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lit-zodp: error:")]
    assert len(errors) == 1 and "HFSequenceClassifier adds a new random classification head" in errors[0]
    assert "use class_path lit_zodp.backbones.HFPromptClassifier with label_words ['terrible', 'great']" in errors[0]
    backbone = yaml.safe_load(prompt_world.read_text())["model"]["init_args"]["backbone"]
    backbone["init_args"]["label_words"] = None  # the prompt backbone given again, without its label words
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(prompt_world), "--model.init_args.backbone", json.dumps(backbone)])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lit-zodp: error:")]
    assert len(errors) == 1 and "HFPromptClassifier needs `label_words`" in errors[0]


def test_a_missing_model_id_is_one_line_naming_the_option(prompt_world, tmp_path):
    """Offline, an unknown model id: one line naming the option and what to do, exit code 2, no traceback."""
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "lit_zodp.cli", "fit", "--config", str(prompt_world),
                             "--model.init_args.backbone.init_args.model_name_or_path", "does/not-exist"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == ["lit-zodp: error: could not load `model_name_or_path`='does/not-exist': not a local folder "
                      "and not a model id found in the local Hugging Face cache (downloads are off: HF_HUB_OFFLINE=1); "
                      "give a local folder written by save_pretrained, a model id already downloaded, or 'minilm' "
                      "(packaged, offline), or download it once with HF_HUB_OFFLINE=0"]
    assert "Traceback" not in result.stderr and "Namespace(" not in result.stderr


@pytest.mark.parametrize("arguments, message", [
    (["--ckpt_path", "no-such.ckpt"], "`ckpt_path`: no checkpoint at 'no-such.ckpt'"),
    (["--trainer.max_steps", "-5"], "max_steps"),
])
def test_a_missing_checkpoint_or_a_trainer_misconfiguration_is_one_line(arguments, message, tmp_path, monkeypatch,
                                                                        capsys):
    """Before (audit 5): a 30-39 line traceback, the missing checkpoint only after the data was set up."""
    from lit_zodp.cli import cli_main

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(config), "--trainer.accelerator", "cpu", *arguments])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lit-zodp: error:")]
    assert len(errors) == 1 and message in errors[0], errors


def test_an_unknown_test_ckpt_is_refused_when_parsed(tmp_path, monkeypatch):
    """Before: refused only after the whole fit, and the result line was lost."""
    from lit_zodp.cli import cli_main

    config = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(config), "--test_ckpt", "foo"])
    assert exit_info.value.code == 2


def _stderr_of_a_refused_run(arguments, capsys) -> list[str]:
    """Run the CLI in process; it must exit with code 2; its stderr's lines."""
    from lit_zodp.cli import cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(arguments)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("arguments, typo, message", [
    (["--model.init_args.clipp", "1.0"], None,
     "`model.init_args.clipp`: Option 'clipp' is not accepted by lit_zodp.algorithms.DPZero "
     "(did you mean `model.init_args.clip`?)"),
    (["--model.init_args.clip", "abc"], None, "`model.init_args.clip`: Expected a float. Got value: abc"),
    (["--trainer.max_stepz", "5"], None,
     "unrecognized arguments: --trainer.max_stepz 5 (did you mean `--trainer.max_steps`?)"),
    ([], ("    lam: 0.001", "    lamm: 0.001"),
     "`model.init_args.lamm`: Option 'lamm' is not accepted by lit_zodp.algorithms.DPZero "
     "(did you mean `model.init_args.lam`?)"),
    ([], ("        hidden: 64", "        hiden: 64"),
     "`model.init_args.backbone.init_args.hiden`: Option 'hiden' is not accepted by lit_zodp.backbones.TinyMLP "
     "(did you mean `model.init_args.backbone.init_args.hidden`?)"),
    ([], ("trainer:", "trainr:"),
     "Subcommand 'fit' does not accept option 'trainr.accelerator' (did you mean `trainer.accelerator`?)"),
])
def test_an_option_typo_is_one_line_naming_the_option_and_the_closest_valid_one(arguments, typo, message, tmp_path,
                                                                                 monkeypatch, capsys):
    """Before: jsonargparse's usage (about 60 lines), the reason nested in a union's alternatives."""
    monkeypatch.chdir(tmp_path)
    config = QUICKSTART
    if typo is not None:  # a misspelled key in the config file
        config = tmp_path / "typo.yaml"
        config.write_text(QUICKSTART.read_text().replace(*typo, 1))
    assert _stderr_of_a_refused_run(["fit", "--config", str(config), *arguments], capsys) == [
        f"lit-zodp: error: {message}"]


def test_help_and_print_config_are_unchanged(capsys):
    from lit_zodp.cli import cli_main

    for arguments in (["fit", "--help"], ["fit", "--config", str(QUICKSTART), "--print_config"]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(arguments)
        assert exit_info.value.code == 0
    output = capsys.readouterr().out
    assert "usage:" in output and "--trainer.max_steps" in output and "--model.help" in output
    printed = yaml.safe_load(output[output.index("# lightning.pytorch=="):])
    assert printed["model"]["class_path"] == "lit_zodp.algorithms.DPZero"


def test_a_budget_below_the_target_of_a_new_run_is_one_line_naming_both(tmp_path, monkeypatch, capsys):
    """Before: calibrated for epsilon 4 over the plan, stopped at 2 after 37 of 6000 steps, exit code 0."""
    monkeypatch.chdir(tmp_path)
    arguments = ["fit", "--config", str(QUICKSTART), "--model.init_args.max_epsilon", "2"]
    assert _stderr_of_a_refused_run(arguments, capsys) == [
        "lit-zodp: error: Invalid configuration: Expected `max_epsilon` >= `target_epsilon` for a new run (sigma is "
        "calibrated to spend target_epsilon over the planned steps), but got max_epsilon=2 < target_epsilon=4: set "
        "target_epsilon=2, or drop max_epsilon"]


def _mezo(config=TINY):
    config = yaml.safe_load(yaml.safe_dump(config))
    config["model"]["class_path"] = "lit_zodp.algorithms.MeZO"
    del config["model"]["init_args"]["target_epsilon"]
    return config


def _dpzero_at_noise_1():
    """The TINY DPZero config at a fixed noise multiplier of 1 (no target epsilon)."""
    config = yaml.safe_load(yaml.safe_dump(TINY))
    config["model"]["init_args"].update(target_epsilon=None, noise_multiplier=1.0)
    return config


def test_a_resume_refuses_a_model_class_other_than_the_checkpoints(tmp_path, monkeypatch, capsys):
    """Before: a DPZero config (noise_multiplier 1) resumed from a MeZO checkpoint trained on as MeZO, not private."""
    monkeypatch.chdir(tmp_path)
    _fit_with_checkpoint(tmp_path, config=_mezo())
    private = _dpzero_at_noise_1()
    last = str(tmp_path / "ckpt" / "last.ckpt")
    errors = _stderr_of_a_refused_run(["fit", "--config", str(write_config(tmp_path, private, "private.yaml")),
                                       "--ckpt_path", last], capsys)
    assert errors == [f"lit-zodp: error: `model.class_path`: the checkpoint {last!r} was trained by "
                      "lit_zodp.algorithms.MeZO, but the configuration names lit_zodp.algorithms.DPZero; a resume "
                      "continues the checkpoint's run (privacy included): configure lit_zodp.algorithms.MeZO, or start "
                      "a new run without ckpt_path"]
    private_run = tmp_path / "private"  # the reverse: a private checkpoint, a non-private configuration
    private_run.mkdir()
    _fit_with_checkpoint(private_run)
    errors = _stderr_of_a_refused_run(["fit", "--config", str(write_config(tmp_path, _mezo(), "mezo.yaml")),
                                       "--ckpt_path", str(private_run / "ckpt" / "last.ckpt")], capsys)
    assert len(errors) == 1 and "was trained by lit_zodp.algorithms.DPZero, but the configuration names " \
        "lit_zodp.algorithms.MeZO" in errors[0]


def _as_written_in_python(tmp_path) -> str:
    """The last checkpoint of :func:`_fit_with_checkpoint` as a Trainer of one's own writes it: no LightningCLI
    ``_class_path`` among its options."""
    import torch

    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    del saved["hyper_parameters"]["_class_path"]
    path = str(tmp_path / "python.ckpt")
    torch.save(saved, path)
    return path


def test_a_resume_of_a_checkpoint_written_in_python_is_held_to_its_recorded_class(tmp_path, monkeypatch, capsys):
    """A checkpoint saved by a Trainer of one's own has no LightningCLI ``_class_path``; the algorithm our modules
    record names its class, so the CLI refuses another one in its own line (stop 46)."""
    monkeypatch.chdir(tmp_path)
    _fit_with_checkpoint(tmp_path, config=_mezo())
    python_written = _as_written_in_python(tmp_path)
    private = _dpzero_at_noise_1()
    errors = _stderr_of_a_refused_run(["fit", "--config", str(write_config(tmp_path, private, "private.yaml")),
                                       "--ckpt_path", python_written], capsys)
    assert errors == [f"lit-zodp: error: `model.class_path`: the checkpoint {python_written!r} was trained by "
                      "lit_zodp.algorithms.dpzero.MeZO, but the configuration names lit_zodp.algorithms.DPZero; a "
                      "resume continues the checkpoint's run (privacy included): configure "
                      "lit_zodp.algorithms.dpzero.MeZO, or start a new run without ckpt_path"]


def test_a_private_checkpoint_written_in_python_resumes_through_the_cli(tmp_path, monkeypatch):
    """Before, LightningCLI parsed such a checkpoint's options (no ``_class_path``) as ``LightningModule``'s and
    failed: "`model.init_args.clip`: Option 'clip' is not accepted by lightning.LightningModule" and "Parsing of
    ckpt_path hyperparameters failed!". Its options are the configured class's; the run, its options and its ledger
    continue."""
    monkeypatch.chdir(tmp_path)
    sigma = yaml.safe_load(yaml.safe_dump(TINY))  # (a fixed sigma: a target's plan would allow 0 more steps)
    sigma["model"]["init_args"].update(target_epsilon=None, noise_multiplier=1.0)
    _fit_with_checkpoint(tmp_path, "--trainer.max_steps", "4", "--model.init_args.lr", "0.05", config=sigma)
    python_written = _as_written_in_python(tmp_path)
    with pytest.warns(UserWarning, match=r"lr: configured 0.1, checkpoint 0.05 \(kept\)"):
        cli = build_cli(["fit", "--config", str(write_config(tmp_path, sigma, "again.yaml")), "--trainer.max_steps",
                         "7", "--model.init_args.lr", "0.1", "--ckpt_path", python_written, "--test_after_fit",
                         "false"])
    assert cli.trainer.global_step == 7 and cli.model.lr == 0.05
    assert cli.model.privacy.ledger.total_count == 7


def test_a_resume_names_each_configured_option_the_checkpoint_replaces(tmp_path, monkeypatch):
    """Before: --model.init_args.lr 0.1 on a resume was silently replaced by the checkpoint's 0.05. The
    checkpoint's values are kept (its ledger depends on them); a budget keeps the smaller value and is named
    only when the checkpoint's was kept (target_epsilon 5 > 3), not when the configured one was (max_epsilon)."""
    from lit_zodp.cli import _same

    monkeypatch.chdir(tmp_path)
    _fit_with_checkpoint(tmp_path)
    with pytest.warns(UserWarning, match="with the checkpoint's model options") as record:
        resumed = _fit_with_checkpoint(tmp_path, "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"),
                                       "--model.init_args.lr", "0.1", "--model.init_args.clip", "1",
                                       "--model.init_args.target_epsilon", "5", "--model.init_args.max_epsilon", "2.5")
    warning, = (w for w in record if "model options" in str(w.message))
    message = str(warning.message)
    shown = warnings.formatwarning(warning.message, warning.category, warning.filename, warning.lineno)
    assert shown == f"lit-zodp: warning: {message}\n"  # one line, as the errors (it printed the source line)
    assert message.endswith("not the configured ones: lr: configured 0.1, checkpoint 0.05 (kept); "
                           "target_epsilon: configured 5.0, checkpoint 3.0 (kept)")
    hparams = resumed.model.hparams
    assert (hparams.lr, hparams.clip, hparams.target_epsilon, hparams.max_epsilon) == (0.05, 1.0, 3.0, 2.5)
    assert _same(1, 1.0) and not _same(True, 1) and not _same(None, 0) and _same([16, 32], [16, 32])


def test_a_target_configured_for_a_resume_of_a_fixed_sigma_run_binds_as_its_budget(tmp_path, monkeypatch):
    """Acceptance test (2026-11-28): a run trained at a fixed sigma, resumed with the config's target_epsilon (the
    quickstart's 4.0), was refused ('Give exactly one of `target_epsilon` and `noise_multiplier`') after a warning
    that promised to keep the checkpoint's sigma. The sigma is kept and the target binds as max_epsilon."""
    monkeypatch.chdir(tmp_path)
    fixed = yaml.safe_load(yaml.safe_dump(TINY))
    fixed["model"]["init_args"].update(target_epsilon=None, noise_multiplier=1.0)
    _fit_with_checkpoint(tmp_path, config=fixed)
    last = str(tmp_path / "ckpt" / "last.ckpt")
    with pytest.warns(UserWarning, match=r"fixed noise_multiplier=1.0, which a target cannot calibrate: the "
                                         r"configured target_epsilon=3.0 binds as max_epsilon=3.0"):
        resumed = _fit_with_checkpoint(tmp_path, "--trainer.max_steps", "400", "--ckpt_path", last)
    privacy, hparams = resumed.model.privacy, resumed.model.hparams
    assert (hparams.target_epsilon, hparams.noise_multiplier, hparams.max_epsilon) == (None, 1.0, 3.0)
    assert privacy.noise_multiplier == 1.0 and privacy.budget == 3.0
    assert 30 < privacy.ledger.total_count < 400 and privacy.epsilon() <= 3.0  # stopped by the budget


def test_testing_a_checkpoint_reports_its_steps_and_a_stray_file_is_one_line(tmp_path, monkeypatch, caplog, capsys):
    """Acceptance test (2026-11-28): `lightning test --ckpt_path` of a 30-step checkpoint printed steps=0, and a
    --ckpt_path naming a file that is no checkpoint ended in torch's 24-line traceback after the data's setup."""
    import logging

    monkeypatch.chdir(tmp_path)
    _fit_with_checkpoint(tmp_path)
    last = str(tmp_path / "ckpt" / "last.ckpt")
    with caplog.at_level(logging.INFO):
        tested = build_cli(["test", "--config", str(write_config(tmp_path)), "--ckpt_path", last])
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RESULT")][-1]
    assert " steps=30 " in line and f"epsilon={tested.model.privacy.epsilon():.3f}" in line
    stray = tmp_path / "notes.ckpt"
    stray.write_text("hello")
    lines = _stderr_of_a_refused_run(["fit", "--config", str(write_config(tmp_path)), "--ckpt_path", str(stray)],
                                     capsys)
    assert lines == [f"lit-zodp: error: `ckpt_path`: {str(stray)!r} cannot be read as a checkpoint "
                     "(not a file torch.save wrote)"]


@pytest.mark.parametrize("arguments, epsilon, spent", [
    (["--data.init_args.sampling", "shuffle"], r"epsilon=\d+\.\d{3}\(poisson-assumed\) ",
     "upper bound ASSUMING POISSON SAMPLING, which shuffled batches do not satisfy: not a guarantee"),
    (["--model.init_args.target_epsilon", "null", "--model.init_args.noise_multiplier", "0"], "epsilon=inf ",
     "Privacy spent: not private: epsilon = inf after 3 steps"),
    (["--model.init_args.noise_seed", "5"], r"epsilon=\d+\.\d{3}\(test-seeded\) ",
     "the noise is REPRODUCIBLE from `noise_seed` (tests only): not a guarantee"),
])
def test_the_result_line_and_summary_say_when_epsilon_is_no_guarantee(arguments, epsilon, spent, tmp_path,
                                                                       monkeypatch, caplog):
    """Before: a shuffled run's epsilon printed like a guarantee; sigma 0 reported "after 0 steps"."""
    import logging
    import re

    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO):
        build_cli(["fit", "--config", str(write_config(tmp_path)), "--trainer.max_steps", "3", *arguments])
    messages = [r.getMessage() for r in caplog.records]
    result, = (m for m in messages if m.startswith("RESULT"))
    assert re.search(epsilon, result) and "steps=3 " in result
    assert any(spent in m for m in messages if m.startswith("Privacy spent"))


def test_package_warnings_are_one_line_and_others_keep_their_format():
    """``LitZodpWarning`` prints as ``lit-zodp: warning: ...``; a plain ``UserWarning`` and Lightning's
    own warnings keep Python's and Lightning's formats (the formatter is chained, not replaced)."""
    import lightning
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    from lit_zodp.errors import LitZodpWarning

    assert warnings.formatwarning("check it", LitZodpWarning, "x.py", 3, "src") == "lit-zodp: warning: check it\n"
    assert warnings.formatwarning("plain", UserWarning, "x.py", 3, "src") == "x.py:3: UserWarning: plain\n  src\n"
    inside = str(Path(lightning.__file__).parent / "pytorch" / "trainer" / "trainer.py")
    assert warnings.formatwarning("theirs", PossibleUserWarning, inside, 7, "src") == f"{inside}:7: theirs\n"


def test_a_paper_config_without_its_data_folder_is_one_line_naming_data_dir(tmp_path, monkeypatch, capsys):
    """Acceptance test (2026-11-28): a paper config run where its data folder is missing (the packaged MiniLM in
    place of OPT-125M) ended in a 46-line traceback, FileNotFoundError, exit code 1."""
    monkeypatch.chdir(tmp_path)  # no data/glue here
    config = Path(__file__).resolve().parents[1] / "configs" / "mezo_bcd" / "opt-125m_sst2_mezo_bcd.yaml"
    lines = _stderr_of_a_refused_run(["fit", "--config", str(config), "--trainer.accelerator", "cpu",
                                      "--model.init_args.backbone.init_args.model_name_or_path", "minilm",
                                      "--model.init_args.backbone.init_args.dtype", "float32",
                                      "--data.init_args.tokenizer", "minilm", "--trainer.max_steps", "2"], capsys)
    assert [line for line in lines if line.startswith("lit-zodp: error:")] == [
        "lit-zodp: error: `data.init_args.data_dir`: SST-2: data_dir 'data/glue' is not a folder; get the task's "
        "files (README, 'Paper configs') and set `data_dir` to their folder"]
    assert not any("Traceback" in line for line in lines)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "\n### Paper configs\n" in readme


def test_inf_on_the_command_line_is_told_its_yaml_spelling(tmp_path, monkeypatch, capsys):
    """Acceptance test (2026-11-28): `--model.init_args.clip inf` said only "Expected a float. Got value: inf"
    while the library's messages said "(or inf)"; YAML, which reads the command line, spells it `.inf`."""
    monkeypatch.chdir(tmp_path)
    config = str(write_config(tmp_path, _mezo()))
    assert _stderr_of_a_refused_run(["fit", "--config", config, "--model.init_args.clip", "inf"], capsys) == [
        "lit-zodp: error: `model.init_args.clip`: Expected a float. Got value: inf: write `.inf` (the command line "
        "and configs are YAML, where `inf` is a string)"]
    lines = _stderr_of_a_refused_run(["fit", "--config", config, "--model.init_args.noise_multiplier=-inf"], capsys)
    assert len(lines) == 1 and lines[0].startswith("lit-zodp: error: `model.init_args.noise_multiplier`: Expected a float")
    assert lines[0].endswith("write `-.inf` (the command line and configs are YAML, where `-inf` is a string)")
    lines = _stderr_of_a_refused_run(["fit", "--config", config, "--model.init_args.lr", "NaN"], capsys)
    assert lines[0].endswith("write `.nan` (the command line and configs are YAML, where `NaN` is a string)")
    cli = build_cli(["fit", "--config", config, "--model.init_args.clip", ".inf", "--trainer.max_steps", "1",
                     "--test_after_fit", "false"])
    assert cli.model.hparams.clip == float("inf") and cli.trainer.global_step == 1


def test_the_quickstart_logs_without_the_logging_interval_warning(tmp_path, monkeypatch):
    """Acceptance test (2026-11-28): `log_every_n_steps: 50` with 20-batch epochs warned once a logger was on."""
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_cli(["fit", "--config", str(QUICKSTART), "--trainer.logger", "true", "--trainer.max_steps", "2",
                   "--trainer.enable_progress_bar", "false", "--test_after_fit", "false"])
    assert not [w for w in caught if "logging interval" in str(w.message)]


def test_the_readme_resume_command_writes_a_checkpoint_and_the_resume_continues_epsilon(tmp_path, monkeypatch):
    """Acceptance test (2026-11-28): the quickstart validates (and so checkpoints) every 50 epochs, so a short fit
    with `--trainer.enable_checkpointing true` wrote no checkpoint to resume; the README adds
    `--trainer.check_val_every_n_epoch 1`. A fixed sigma (no budget) lets the resume run on."""
    monkeypatch.chdir(tmp_path)
    common = ["fit", "--config", str(QUICKSTART), "--trainer.enable_checkpointing", "true",
              "--trainer.check_val_every_n_epoch", "1", "--model.init_args.target_epsilon", "null",
              "--model.init_args.noise_multiplier", "1.0", "--trainer.enable_progress_bar", "false",
              "--test_after_fit", "false"]
    first = build_cli([*common, "--trainer.max_steps", "40"])
    checkpoint = tmp_path / "checkpoints" / "epoch=1-step=40.ckpt"
    assert checkpoint.is_file()
    resumed = build_cli([*common, "--trainer.max_steps", "60", "--ckpt_path", str(checkpoint)])
    assert resumed.model.privacy.ledger.total_count == 60
    assert resumed.model.privacy.epsilon() > first.model.privacy.epsilon()


@pytest.mark.parametrize("arguments, message", [
    (["--trainer.max_step", "10"], "unrecognized arguments: --trainer.max_step 10 (did you mean `--trainer.max_steps`?)"),
    (["--model.init_args.lam", "-1e-3"], "argument --model: expected one argument (a value starting with '-' is "
                                         "written with '=': `--model.init_args.lam=-1e-3`)"),
])
def test_an_abbreviated_option_is_refused_and_a_negative_value_is_told_its_spelling(arguments, message, tmp_path,
                                                                                     monkeypatch, capsys):
    """Acceptance test (2026-11-28): argparse's prefix matching took `--trainer.max_step 10` as max_steps without a
    word (the same typo in a YAML file is refused), and `--lam -1e-3` said only 'expected one argument'."""
    monkeypatch.chdir(tmp_path)
    lines = _stderr_of_a_refused_run(["fit", "--config", str(write_config(tmp_path)), *arguments], capsys)
    assert lines == [f"lit-zodp: error: {message}"]


def test_a_private_fit_under_a_strategy_that_returns_only_the_weights_ends_in_one_line(tmp_path, monkeypatch, capsys):
    """Red-team review 18: under ddp_spawn the CLI printed "epsilon = 3" in the child and then a result line with
    epsilon 0.000 and 0 steps for the weights it brought back. Refused before the children start."""
    from lit_zodp.cli import cli_main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(write_config(tmp_path)), "--trainer.strategy", "ddp_spawn"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lit-zodp: error:")]
    assert len(errors) == 1 and "strategy='ddp_spawn' trains in child processes" in errors[0]


@pytest.mark.parametrize("arguments, message", [
    (["--model.init_args.backbone.init_args.num_classes", "0"], "`num_classes` to be a positive int, but got 0"),
    (["--model.init_args.backbone.init_args.activation", "relu2"], "`activation` in ['gelu', 'relu', 'silu', 'tanh']"),
    (["--model.class_path", "lit_zodp.algorithms.DPGD0th", "--model.init_args.num_directions", "2"],
     "expected `num_directions` 1, but got 2"),
    (["--trainer.num_sanity_val_steps", "0", "--model.init_args.backbone.init_args.in_features", "32"],
     "Model/data mismatch: the backbone TinyMLP has `in_features` 32, but the data's examples have shape (1, 8, 8): "
     "64 features; set `in_features: 64`"),
    (["--model.init_args.backbone", '{"class_path": "lit_zodp.backbones.TinyCNN", "init_args": {"in_channels": 3}}'],
     "Model/data mismatch: the backbone TinyCNN has `in_channels` 3, but the data's images have shape (1, 8, 8)"),
])
def test_a_backbone_option_or_a_backbone_the_data_does_not_fit_is_one_line_before_any_step(
        arguments, message, tmp_path, monkeypatch, capsys):
    """Review 28. Before: a backbone's own check (``num_classes: 0``, an unknown ``activation``) and DPGD-0th's
    ``num_directions`` raised a plain ValueError, a 72-90 line traceback; TinyMLP's ``in_features`` or TinyCNN's
    ``in_channels`` other than the images' failed only in the first forward, a ~100-line traceback from a training
    step (without the sanity check) whose message named the realized Poisson batch size."""
    from lit_zodp.algorithms.base import AlgorithmModule

    def no_step(*args, **kwargs):
        raise AssertionError("a training step ran")

    monkeypatch.setattr(AlgorithmModule, "on_train_batch_start", no_step, raising=False)
    monkeypatch.chdir(tmp_path)
    lines = _stderr_of_a_refused_run(["fit", "--config", str(QUICKSTART), "--trainer.max_steps", "3",
                                      "--test_after_fit", "false", *arguments], capsys)
    errors = [line for line in lines if line.startswith("lit-zodp: error:")]
    assert len(errors) == 1 and message in errors[0], lines
    assert not any("Traceback" in line for line in lines), lines
