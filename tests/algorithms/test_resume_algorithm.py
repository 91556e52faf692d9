"""A Trainer resume continues the checkpoint's run: resumed by another algorithm it is refused in one line.

Before, first-order <-> zeroth-order failed inside Lightning ("loaded state dict has a different number of parameter
groups"), DPAdam -> DPSGD raised ``KeyError: 'momentum'`` at the first step, after a counted release, and
DPZero -> DPGD0th ran on DPZero's learning rate, silently replacing the configured one.
"""

import pytest
import torch

from lit_zodp.algorithms import DPGD0th, DPMeZOBCD, DPSGD, DPAdam, DPZero
from lit_zodp.errors import ConfigError
from tests.conftest import blobs, mlp, poisson_loader, quiet_trainer

PRIVATE = dict(noise_multiplier=1.0, clip=1.0, noise_seed=3)


def checkpoint_of(tmp_path, module):
    trainer = quiet_trainer(max_steps=3)
    trainer.fit(module, poisson_loader(blobs(), 0.1, seed=1))
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize("first,then", [(DPAdam, DPSGD), (DPSGD, DPZero), (DPZero, DPSGD), (DPZero, DPGD0th),
                                        (DPZero, DPMeZOBCD)])
def test_a_resume_by_another_algorithm_is_refused_in_one_line_before_any_step(tmp_path, first, then,
                                                                              spend_log_per_test):
    path = checkpoint_of(tmp_path, first(mlp(), lr=0.01, **PRIVATE))
    resumed = then(mlp(), lr=0.02, **PRIVATE)
    before = [p.detach().clone() for p in resumed.parameters()]
    trainer = quiet_trainer(max_steps=6)
    with pytest.raises(ConfigError) as refused:
        trainer.fit(resumed, poisson_loader(blobs(), 0.1, seed=1), ckpt_path=str(path))
    message = str(refused.value)
    assert "\n" not in message
    assert f"trained by lit_zodp.algorithms.{first.__module__.rpartition('.')[2]}.{first.__name__}" in message
    assert message.endswith(f"resume with {first.__name__}")
    assert trainer.global_step == 0 and resumed.privacy.ledger.total_count == 0
    assert all(torch.equal(a, b) for a, b in zip(before, resumed.parameters()))


def test_the_same_algorithm_and_a_users_subclass_of_it_resume(tmp_path, spend_log_per_test):
    class MyDPZero(DPZero):
        pass

    for cls in (DPZero, MyDPZero):  # (one run each: two resumes of one checkpoint are siblings, each counting both)
        path = checkpoint_of(tmp_path / cls.__name__, DPZero(mlp(), lr=0.01, **PRIVATE))
        trainer = quiet_trainer(max_steps=5)
        module = cls(mlp(), lr=0.01, **PRIVATE)
        trainer.fit(module, poisson_loader(blobs(), 0.1, seed=1), ckpt_path=str(path))
        assert trainer.global_step == 5 and module.privacy.ledger.total_count == 5


def test_a_checkpoint_records_its_algorithm_and_load_from_checkpoint_still_reads_another_ones(tmp_path,
                                                                                               spend_log_per_test):
    """Only a resume (which restores the optimizer state) is refused; loading weights and ledger for evaluation is
    not a training run of another algorithm."""
    path = checkpoint_of(tmp_path, DPZero(mlp(), lr=0.01, **PRIVATE))
    saved = torch.load(path, weights_only=False)
    assert saved["public_state"]["algorithm"] == "lit_zodp.algorithms.dpzero.DPZero"
    module = DPGD0th(mlp(), lr=0.01, **PRIVATE)
    module.on_load_checkpoint(saved)
    assert module.privacy.ledger.total_count == 3


def test_a_users_subclass_of_another_algorithm_that_subclasses_the_saved_one_is_refused(tmp_path,
                                                                                        spend_log_per_test):
    """Review 39: DPMeZOBCD subclasses DPZero, so a user's subclass of DPMeZOBCD passed ``isinstance(self, DPZero)``
    and resumed a DPZero checkpoint (6 steps, ledger 6) as the MeZO-BCD algorithm the refusal exists to stop. A
    user's subclass resumes only its own library algorithm's checkpoints."""
    class MyDPMeZOBCD(DPMeZOBCD):
        pass

    path = checkpoint_of(tmp_path, DPZero(mlp(), lr=0.01, **PRIVATE))
    resumed = MyDPMeZOBCD(mlp(), lr=0.02, **PRIVATE)
    trainer = quiet_trainer(max_steps=6)
    with pytest.raises(ConfigError, match=r"trained by lit_zodp\.algorithms\.dpzero\.DPZero.*resume with DPZero$"):
        trainer.fit(resumed, poisson_loader(blobs(), 0.1, seed=1), ckpt_path=str(path))
    assert trainer.global_step == 0 and resumed.privacy.ledger.total_count == 0
