import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lit_zodp.algorithms import DPZero
from lit_zodp.callbacks import PrivacySpendCallback
from lit_zodp.callbacks.privacy import float32_at_least
from lit_zodp.privacy import PrivacyConfigError, PrivacyLedger, SubsampledGaussian, steps_within_budget
from tests.conftest import blobs, mlp, poisson_loader, quiet_trainer


def test_module_brings_its_own_privacy_callback():
    module = DPZero(mlp(), target_epsilon=1.0)
    assert any(isinstance(c, PrivacySpendCallback) for c in module.configure_callbacks())


def test_epsilon_is_logged_every_step_and_matches_the_ledger():
    data = blobs()
    module = DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    logged = []

    from lightning.pytorch.callbacks import Callback

    class Spy(Callback):  # runs before the module's own callbacks: reads the previous step's value
        def on_train_batch_start(self, trainer, m, batch, batch_idx):
            if batch_idx:
                logged.append(float(trainer.callback_metrics["epsilon"]))

        def on_train_end(self, trainer, m):
            logged.append(float(trainer.callback_metrics["epsilon"]))

    trainer = quiet_trainer(max_steps=6, callbacks=[Spy(), PrivacySpendCallback(log_every_n_steps=1)])
    trainer.fit(module, poisson_loader(data, 0.1, steps_per_epoch=10))
    assert len(logged) == 6
    assert all(a < b for a, b in zip(logged, logged[1:])) and logged[0] > 0
    reference = PrivacyLedger()
    reference.record(SubsampledGaussian(1.0, 0.1), 6)
    assert logged[-1] == pytest.approx(reference.epsilon(1e-5).upper)


def test_budget_stops_training_before_epsilon_is_exceeded():
    data = blobs()
    module = DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=3.0, delta=1e-5, max_epsilon=1.0)
    trainer = quiet_trainer(max_steps=500)
    trainer.fit(module, poisson_loader(data, 0.1))
    steps = trainer.global_step
    assert 0 < steps < 500
    assert module.privacy.ledger.total_count == steps
    assert module.privacy.ledger.epsilon(1e-5).upper <= 1.0
    one_more = module.privacy.ledger.epsilon(1e-5, extra=[(SubsampledGaussian(3.0, 0.1), 1)]).upper
    assert one_more > 1.0


def test_steps_within_budget_is_the_largest_feasible_count():
    ledger = PrivacyLedger()
    per_step = [(SubsampledGaussian(1.0, 0.05), 1)]
    k = steps_within_budget(ledger, per_step, max_epsilon=1.0, delta=1e-5, limit=2_000)
    assert ledger.epsilon(1e-5, extra=[(per_step[0][0], k)]).upper <= 1.0
    assert ledger.epsilon(1e-5, extra=[(per_step[0][0], k + 1)]).upper > 1.0


def test_epsilon_after_resume_continues_from_the_checkpoint(tmp_path):
    data = blobs()
    kwargs = dict(lr=0.01, clip=1.0, noise_multiplier=1.1, delta=1e-5, seed=1)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=5)
    first = DPZero(mlp(), **kwargs)
    quiet_trainer(max_steps=5, enable_checkpointing=True, callbacks=[checkpoint]).fit(
        first, poisson_loader(data, 0.1, seed=3))
    spent_at_5 = first.privacy.ledger.epsilon(1e-5).upper
    sigma = first.privacy.noise_multiplier

    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["privacy"]["ledger"]["entries"][0]["count"] == 5

    resumed = DPZero(mlp(), **kwargs)
    trainer = quiet_trainer(max_steps=10)
    trainer.fit(resumed, poisson_loader(data, 0.1, seed=3), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.privacy.noise_multiplier == sigma
    assert resumed.privacy.ledger.total_count == 10
    spent_at_10 = resumed.privacy.ledger.epsilon(1e-5).upper
    assert spent_at_10 > spent_at_5
    uninterrupted = PrivacyLedger()
    uninterrupted.record(SubsampledGaussian(sigma, 0.1), 10)
    assert spent_at_10 == pytest.approx(uninterrupted.epsilon(1e-5).upper, rel=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(log_every_n_steps=0), "log_every_n_steps"),
    (dict(log_every_n_steps=-3), "log_every_n_steps"),
])
def test_bad_callback_arguments(kwargs, match):
    with pytest.raises(PrivacyConfigError, match=match):
        PrivacySpendCallback(**kwargs)


def test_the_cadence_counts_an_epsilons_query_not_the_accountants_build(monkeypatch):
    """The accountant built at fit start for the planned horizon serves every later step's epsilon, so the
    cadence's cost is one query. Counting the build too (2-3x a query) put the quickstart's first epsilon after
    its last step: its progress bar showed none until the end (acceptance test, 2026-11-28)."""
    import time

    from lit_zodp.privacy import ledger as ledger_module

    original = ledger_module._build_accountant

    def slow_build(*args):
        time.sleep(1.0)
        return original(*args)

    monkeypatch.setattr(ledger_module, "_build_accountant", slow_build)
    module = DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    quiet_trainer(max_steps=2).fit(module, poisson_loader(blobs(), 0.1, steps_per_epoch=2))
    assert 0 < module.privacy.accounting_seconds < 0.9 and module.privacy.ledger.query_seconds > 0


def test_default_cadence_spends_nothing_on_the_first_step_nor_at_the_last(monkeypatch):
    """Epsilon is composed when its cost fits 0.5% of the training time: not after the first step (whose
    time is not known yet; the accountant's cost comes from fit start) and not at the last step: the
    plan's check at fit start composed the full run, and the ledger memoises it. The last step still
    logs epsilon, equal to a fresh accountant's."""
    from lit_zodp.privacy import ledger as ledger_module

    composed = []  # (steps recorded, steps composed) of each accountant evaluation
    original = ledger_module.compose

    def compose(counts, delta, accountant, ledger):
        composed.append((ledger.total_count, sum(counts.values())))
        return original(counts, delta, accountant, ledger)

    monkeypatch.setattr(ledger_module, "compose", compose)
    module = DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    callback = PrivacySpendCallback()
    trainer = quiet_trainer(max_steps=30, callbacks=[callback])
    trainer.fit(module, poisson_loader(blobs(), 0.1, steps_per_epoch=30))
    assert module.privacy.accounting_seconds > 0
    assert (0, 30) in composed  # the plan's check of the whole run
    during = [recorded for recorded, _ in composed if recorded > 0]
    assert all(recorded > 1 for recorded in during)  # nothing after step 1
    assert 30 not in during  # the last step reuses the plan's bounds
    assert callback._last_logged_step == 30  # ... and logs them
    assert callback._accounting_seconds > 1e-3  # the cadence still knows a real evaluation's cost, not the memo's
    fresh = ledger_module.PrivacyLedger()
    fresh.counts = dict(module.privacy.ledger.counts)
    assert callback.epsilon == fresh.epsilon(1e-5).upper > 0


def test_a_fit_bounded_by_epochs_alone_logs_the_epsilon_of_its_last_step():
    """With ``max_steps`` unset the batch hook cannot tell the last step, and the default cadence (the
    accountant under 0.5% of the time) fell after it: such a fit logged no epsilon at all (an independent
    review). The end of its last epoch logs it."""
    module = DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    callback = PrivacySpendCallback()
    trainer = quiet_trainer(max_epochs=2, max_steps=-1, callbacks=[callback])
    trainer.fit(module, poisson_loader(blobs(), 0.1, steps_per_epoch=4))
    assert trainer.global_step == 8 and callback._last_logged_step == 8
    logged, epsilon = float(trainer.callback_metrics["epsilon"]), module.privacy.epsilon()
    assert epsilon > 0 and logged == float32_at_least(epsilon).item()


@pytest.mark.parametrize("value", [2.722630015425927, 2.722630023956299, 1.0, 1e-30, 0.0, float("inf"), 7.3e5 + 0.01])
def test_a_logged_epsilon_is_the_float32_at_or_just_above_the_bound(value):
    """Lightning logs a float as float32 to nearest: 2.7226300154 (an epsilon measured here) was logged as
    2.7226300240, above it by luck; half of all values round down, below the bound."""
    import numpy as np

    logged = float32_at_least(value)
    assert logged.dtype == torch.float32 and float(logged) >= value
    if 0 < value < float("inf"):
        assert float(np.nextafter(np.float32(float(logged)), np.float32(0))) < value  # the next float32 below is below


def test_a_noiseless_ablation_reports_the_steps_it_took(caplog):
    """Before: "Privacy spent: epsilon = inf ... after 0 steps" after 5 steps at sigma = 0."""
    import logging

    module = DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=0.0)
    trainer = quiet_trainer(max_steps=5, callbacks=[PrivacySpendCallback(log_every_n_steps=1)])
    with caplog.at_level(logging.INFO):
        trainer.fit(module, poisson_loader(blobs(), 0.1))
    assert trainer.global_step == module.privacy.steps == 5 and module.privacy.ledger.counts == {}
    assert float(trainer.callback_metrics["epsilon"]) == float("inf")
    spent = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Privacy spent")]
    assert spent == ["Privacy spent: not private: epsilon = inf after 5 steps (sigma = 0, a noiseless ablation: "
                     "nothing accounted; poisson, q = 0.1)."]


def test_a_shuffled_runs_epsilon_is_logged_under_a_name_that_says_poisson_assumed():
    """Before: logged (and shown in the progress bar) as `epsilon`, like a guarantee."""
    from torch.utils.data import DataLoader

    from lit_zodp.privacy import ShuffleBatchSampler
    from tests.conftest import collate_tensors

    data = blobs()
    with pytest.warns(UserWarning, match="sampling='shuffle'"):
        sampler = ShuffleBatchSampler(len(data), 25)
    module = DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    trainer = quiet_trainer(max_steps=3, callbacks=[PrivacySpendCallback(log_every_n_steps=1)])
    trainer.fit(module, DataLoader(data, batch_sampler=sampler, collate_fn=collate_tensors))
    assert "epsilon" not in trainer.callback_metrics
    assert float(trainer.callback_metrics["epsilon_poisson_assumed"]) == pytest.approx(module.privacy.epsilon())
    # the bar: a name that fits 80 columns and is still not `epsilon` (the long one showed "epsilon_poisson_…")
    assert set(trainer.progress_bar_metrics) & {"epsilon", "epsilon_poisson_assumed", "epsilon*"} == {"epsilon*"}


class StepRecorder(PrivacySpendCallback):
    """Records the global step of every epsilon it logs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.logged_at = []

    def _log_epsilon(self, pl_module, privacy, started):
        super()._log_epsilon(pl_module, privacy, started)
        self.logged_at.append(pl_module.trainer.global_step)


def test_a_fixed_cadence_logs_every_nth_step_from_the_fits_start_and_the_last_step(tmp_path):
    data = blobs()
    kwargs = dict(lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5, seed=1)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=5)
    first = StepRecorder(log_every_n_steps=4)
    quiet_trainer(max_steps=10, enable_checkpointing=True, callbacks=[checkpoint, first]).fit(
        DPZero(mlp(), **kwargs), poisson_loader(data, 0.1, seed=3))
    assert first.logged_at == [4, 8, 10]

    resumed = StepRecorder(log_every_n_steps=4)
    quiet_trainer(max_steps=15, callbacks=[resumed]).fit(
        DPZero(mlp(), **kwargs), poisson_loader(data, 0.1, seed=3), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.logged_at == [14, 15]  # resumed at step 10


class HookRecorder(StepRecorder):
    """Records, for every epsilon it logs, the global step and whether a batch-end hook logged it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.in_batch_end, self.hooks = False, []

    def on_train_batch_end(self, *args):
        self.in_batch_end = True
        super().on_train_batch_end(*args)
        self.in_batch_end = False

    def _log_epsilon(self, pl_module, privacy, started):
        super()._log_epsilon(pl_module, privacy, started)
        self.hooks.append((pl_module.trainer.global_step, self.in_batch_end))


@pytest.mark.parametrize("stop_at", [6, 8])
def test_a_stop_between_due_steps_logs_the_epsilon_at_that_steps_end_and_a_budget_stop_at_its_last(stop_at):
    """Between two due steps the callback compares the component's committed-step count only, but reads
    ``should_stop`` and the budget at every step: a stop requested at step 6 logs step 6's epsilon in that step's
    batch-end hook (where the epoch-end hook would be the fallback), and a budget that allows 9 steps logs step 9's."""
    class StopAt(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == stop_at:
                trainer.should_stop = True

    recorder = HookRecorder(log_every_n_steps=4)
    quiet_trainer(max_steps=20, callbacks=[StopAt(), recorder]).fit(
        DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5, seed=1), poisson_loader(blobs(), 0.1, seed=3))
    assert recorder.hooks == [(4, True), (stop_at, True)]

    ledger, step = PrivacyLedger(), SubsampledGaussian(1.0, 0.1)
    nine, ten = (ledger.epsilon(1e-5, extra=[(step, k)]).upper for k in (9, 10))
    budget = DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5, seed=1, max_epsilon=(nine + ten) / 2)
    recorder = HookRecorder(log_every_n_steps=4)
    quiet_trainer(max_steps=20, callbacks=[recorder]).fit(budget, poisson_loader(blobs(), 0.1, seed=3))
    assert budget.privacy.steps == 9 and recorder.hooks == [(4, True), (8, True), (9, True)]


def test_a_test_after_fit_keeps_the_modules_callbacks_without_announcing_an_override(caplog):
    """configure_callbacks adds its callbacks only where the Trainer has none of their type: after a fit the
    Trainer holds them, and Lightning announced "will override existing callbacks" at every test."""
    from lit_zodp.algorithms import MeZO
    from lit_zodp.callbacks import StopRanksOnError

    data = blobs()
    assert [type(c) for c in MeZO(mlp()).configure_callbacks()] == [StopRanksOnError]
    assert [type(c) for c in DPZero(mlp(), target_epsilon=1.0).configure_callbacks()] == [PrivacySpendCallback]
    mine = PrivacySpendCallback(log_every_n_steps=2)
    module = DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    trainer = quiet_trainer(max_steps=3, callbacks=[mine])
    with caplog.at_level("INFO"):
        trainer.fit(module, poisson_loader(data, 0.1, steps_per_epoch=3))
        trainer.test(module, torch.utils.data.DataLoader(blobs(seed=5), batch_size=64), verbose=False)
    assert "override" not in caplog.text
    assert [c for c in trainer.callbacks if isinstance(c, PrivacySpendCallback)] == [mine]
    assert not any(isinstance(c, StopRanksOnError) for c in trainer.callbacks)  # the privacy callback stops ranks
    assert module.configure_callbacks() == []


@pytest.mark.parametrize("callback", ["privacy", "ranks"])
def test_either_lit_zodp_callback_stops_the_ranks_its_process_started_when_it_fails(callback, capsys):
    """A private fit runs one lit_zodp callback, the privacy callback, so it must stop the ranks rank 0 started
    as StopRanksOnError does (the DDP test runs it end to end): here on Lightning's own launcher class."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from lit_zodp.callbacks import StopRanksOnError

    launcher = _SubprocessScriptLauncher(None, num_processes=2, num_nodes=1)
    launcher.procs = [SimpleNamespace(poll=lambda: None)]
    launcher.kill = lambda signal: killed.append(signal)
    killed, trainer = [], SimpleNamespace(strategy=SimpleNamespace(launcher=launcher), global_rank=0)
    instance = PrivacySpendCallback() if callback == "privacy" else StopRanksOnError()
    instance.on_exception(trainer, None, ValueError("refused"))
    assert len(killed) == 1 and "stopping the 1 rank(s) it started" in capsys.readouterr().err
    launcher.procs = [SimpleNamespace(poll=lambda: 0)]  # the started ranks already ended: nothing to stop
    instance.on_exception(trainer, None, ValueError("refused"))
    assert len(killed) == 1


def test_a_trainers_own_rank_stopper_is_kept_beside_the_privacy_callback(caplog):
    """A private fit on a Trainer holding a StopRanksOnError (a user's, or a MeZO fit's before): Lightning
    replaces the Trainer's callbacks of a class a module's callback subclasses, announcing it; the privacy
    callback is no subclass of it, so both stay and nothing is announced (an independent review)."""
    from lit_zodp.callbacks import StopRanksOnError

    mine = StopRanksOnError()
    trainer = quiet_trainer(max_steps=2, callbacks=[mine])
    with caplog.at_level("INFO"):
        trainer.fit(DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5), poisson_loader(blobs(), 0.1))
    assert "override" not in caplog.text
    assert mine in trainer.callbacks and sum(isinstance(c, PrivacySpendCallback) for c in trainer.callbacks) == 1


def test_resuming_a_noiseless_ablation_with_a_budget_is_refused_before_a_step(tmp_path):
    """Audit 6: ``DPZero(target_epsilon=3, max_epsilon=3)`` resumed from a sigma = 0 checkpoint took sigma 0 and ran
    its 400 steps without noise (epsilon inf, no budget); now the fit stops at its start, in one line."""
    data = blobs()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    quiet_trainer(max_steps=5, enable_checkpointing=True, callbacks=[checkpoint]).fit(
        DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=0.0, seed=1), poisson_loader(data, 0.1, seed=3))
    private = DPZero(mlp(), lr=0.01, clip=1.0, target_epsilon=3.0, max_epsilon=3.0, delta=1e-5, seed=1)
    trainer = quiet_trainer(max_steps=400)
    with pytest.raises(PrivacyConfigError, match="would train without noise"):
        trainer.fit(private, poisson_loader(data, 0.1, seed=3), ckpt_path=tmp_path / "last.ckpt")
    assert trainer.global_step == 5 and private.privacy.noise is None


def test_a_failed_fit_is_closed_with_the_privacy_of_the_steps_it_took(caplog):
    """Review 20: a fit that raised ran no teardown, so it kept its secret noise source and open spend log, stayed
    "in a fit" (its settings fixed), and printed no "Privacy spent" line for the 3 steps it had released."""
    import logging

    class FailAtStep3(Callback):
        def on_train_batch_start(self, trainer, m, batch, batch_idx):
            if trainer.global_step == 3:
                raise RuntimeError("a failure unrelated to privacy")

    module = DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    spend = PrivacySpendCallback(log_every_n_steps=100)
    with caplog.at_level(logging.INFO), pytest.raises(RuntimeError, match="unrelated to privacy"):
        quiet_trainer(max_steps=10, callbacks=[FailAtStep3(), spend]).fit(module, poisson_loader(blobs(), 0.1))
    assert module.privacy.steps == 3 and module.privacy.noise is None and not module.privacy.in_fit
    reference = PrivacyLedger()
    reference.record(SubsampledGaussian(1.0, 0.1), 3)
    assert spend.epsilon == pytest.approx(reference.epsilon(1e-5).upper, rel=1e-4)
    spent = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Privacy spent")]
    assert len(spent) == 1 and spent[0].startswith("Privacy spent before the fit failed: epsilon = ")
    assert "after 3 steps" in spent[0]


def test_the_progress_bar_shows_epsilon_at_or_above_the_bound():
    """TQDM shows a metric to 3 significant digits rounded to nearest and pads it (``.3g``), Rich to 3 decimals
    (``.3f``): a bound of 3.3845 (sigma 1.2, q 0.1, 40 steps) was shown as ``epsilon=3.380`` (review 25). The bar's
    entry is rounded up to the digits shown; the logged ``epsilon`` keeps the bound's."""
    from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

    module = DPZero(mlp(), lr=0.01, clip=1.0, noise_multiplier=1.2, delta=1e-5)
    trainer = quiet_trainer(max_steps=40, callbacks=[PrivacySpendCallback(log_every_n_steps=1)])
    trainer.fit(module, poisson_loader(blobs(), 0.1))
    epsilon = module.privacy.epsilon()
    (shown,) = [float(v) for k, v in trainer.progress_bar_metrics.items() if k.startswith("eps")]
    assert float(Tqdm.format_num(shown)) >= epsilon and float(f"{shown:.3f}") >= epsilon
    assert float(trainer.callback_metrics["epsilon"]) == float32_at_least(epsilon).item()


@pytest.mark.parametrize("value", [3.3845332, 1.9349, 0.01234, 0.0004, 0.5, 99.95, 123.456, 2.0, 1.0, 1e-30])
def test_a_shown_epsilon_is_rounded_up_to_the_digits_the_bars_show(value):
    from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

    from lit_zodp.callbacks.privacy import shown_at_least

    shown = float(float32_at_least(shown_at_least(value)))
    assert float(Tqdm.format_num(shown)) >= value and float(f"{shown:.3f}") >= value
    assert shown <= value * 1.011 + 1.001e-3  # one unit of the shown digits at most
