"""Per-step statistics reach the loggers on the steps they write, and ``self.log`` is not paid on the others."""

import pytest
from lightning.pytorch.loggers.logger import Logger

from lit_zodp.algorithms import DPSGD, DPZero, MeZOBCD
from tests.conftest import blobs, mlp, poisson_loader, quiet_trainer

pytestmark = pytest.mark.filterwarnings("ignore:`(noise|sampling)_seed` is set", "ignore:.*val_dataloader.*",
                                      "ignore:.*log_private_stats=True.*")


class Recorder(Logger):
    """Keeps every ``log_metrics`` call: ``{step: {name: value}}``."""

    def __init__(self):
        super().__init__()
        self.steps = {}

    @property
    def name(self):
        return "recorder"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.steps.setdefault(step, {}).update(metrics)


@pytest.mark.parametrize("make, extra", [
    (lambda: DPZero(mlp(), lr=0.05, seed=0, clip=1.0, noise_multiplier=1.0, delta=1e-5, noise_seed=1,
                    log_private_stats=True), {"sigma"}),
    (lambda: MeZOBCD(mlp(), lr=0.05, seed=0), {"active_block"}),
    (lambda: DPSGD(mlp(), lr=0.05, clip=1.0, noise_multiplier=1.0, delta=1e-5, noise_seed=1,
                   log_private_stats=True), {"sigma"}),
])
def test_step_statistics_are_logged_every_n_steps_and_only_then(make, extra, monkeypatch):
    module = make()
    calls = []
    log = type(module).log
    monkeypatch.setattr(type(module), "log", lambda self, name, *a, **k: calls.append(
        (self.global_step, name)) or log(self, name, *a, **k))
    recorder = Recorder()
    trainer = quiet_trainer(max_steps=7, logger=recorder, log_every_n_steps=3)
    trainer.fit(module, poisson_loader(blobs(), 0.25, steps_per_epoch=7))
    written = {step: set(metrics) for step, metrics in recorder.steps.items() if "step_time" in metrics}
    assert sorted(written) == [2, 5]  # steps 3 and 6 (0-based 2 and 5), as Lightning writes them
    for step, names in written.items():
        assert {"step_time", "clip_fraction"} <= names
        assert recorder.steps[step]["step_time"] > 0
        assert 0 <= recorder.steps[step]["clip_fraction"] <= 1
    assert extra <= set().union(*written.values())  # sigma (once, at the first written step), active_block
    step_calls = [step for step, name in calls if name == "step_time"]
    assert len(step_calls) == 2  # self.log only on the 2 written steps of 7, not on every step


@pytest.mark.parametrize("clip, expected", [(1e-12, 1.0), (1e12, 0.0)])
@pytest.mark.parametrize("make", [
    lambda clip: DPZero(mlp(), lr=0.05, seed=0, clip=clip, noise_multiplier=1.0, delta=1e-5, noise_seed=1,
                        num_directions=2, log_private_stats=True),
    lambda clip: MeZOBCD(mlp(), lr=0.05, seed=0, clip=clip),
])
def test_logged_clip_fraction_is_the_fraction_of_clipped_scalars(make, clip, expected):
    """Every directional difference exceeds a clip of 1e-12 and none exceeds 1e12 (over all directions)."""
    recorder = Recorder()
    trainer = quiet_trainer(max_steps=2, logger=recorder, log_every_n_steps=1)
    trainer.fit(make(clip), poisson_loader(blobs(), 0.25, steps_per_epoch=2))
    fractions = [m["clip_fraction"] for m in recorder.steps.values() if "clip_fraction" in m]
    assert fractions == [expected, expected]
