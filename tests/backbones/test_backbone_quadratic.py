"""QuadraticLoss (DPZero Sec. 5.1 / App. B.1): losses, gradients, the per-example rule, the evaluation metrics
and the one-line errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.func import grad, vmap

from datamodules import QuadraticDataModule
from lit_zodp.algorithms import DPGD0th, DPSGD, DPZero, MeZO
from lit_zodp.backbones import QuadraticLoss
from lit_zodp.backbones.quadratic import CHUNK_ELEMENTS, hessian_diagonal
from lit_zodp.errors import ConfigError
from lit_zodp.per_example import PerExampleGradientEngine
from tests.conftest import quiet_trainer


def rows(n, d, seed=0):
    return 1 + torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def moved(model, seed=1):
    with torch.no_grad():
        model.x.copy_(torch.randn(model.dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return model


@pytest.mark.parametrize("hessian,expected", [("identity", lambda i: 1.0), ("sqrt", lambda i: i ** -0.5),
                                              ("log", lambda i: 1.0 / i)])
def test_hessian_patterns_of_appendix_b1(hessian, expected):
    d = 50
    diagonal = hessian_diagonal(hessian, d)
    torch.testing.assert_close(diagonal, torch.tensor([expected(i) for i in range(1, d + 1)], dtype=torch.float64))
    model = QuadraticLoss(d, hessian)
    assert diagonal.max() == 1  # ||A||_2 = 1, so the effective rank is Tr(A)
    assert model.effective_rank == pytest.approx(float(diagonal.sum()))
    assert model.x.dtype == torch.float64 and not model.x.any()  # x_0 = 0


def test_effective_ranks_grow_as_d_sqrt_d_and_log_d():
    ranks = {h: [QuadraticLoss(d, h).effective_rank for d in (20, 2000)] for h in ("identity", "sqrt", "log")}
    assert ranks["identity"] == [20, 2000]
    # sum_i i^(-1/2) = 2 sqrt(d) + zeta(1/2) + O(d^(-1/2)); sum_i 1/i = log d + 0.5772 + O(1/d)
    assert ranks["sqrt"] == pytest.approx([2 * math.sqrt(d) - 1.4603545 for d in (20, 2000)], rel=2e-2)
    assert ranks["log"] == pytest.approx([math.log(d) + 0.5772157 for d in (20, 2000)], rel=1e-2)


@pytest.mark.parametrize("n", [0, 3, CHUNK_ELEMENTS // 7 + 5])  # (several chunks)
def test_losses_are_the_quadratic_form_per_row(n):
    model = moved(QuadraticLoss(7, "sqrt"))
    x_i = rows(n, 7)
    a = model.hessian_diagonal
    expected = 0.5 * ((model.x.detach() - x_i) ** 2 * a).sum(1)
    for grad_enabled in (False, True):
        with torch.set_grad_enabled(grad_enabled):
            losses = model.per_example_loss(x_i, torch.zeros(n, dtype=torch.long))
        assert losses.shape == (n,) and losses.dtype == torch.float64
        torch.testing.assert_close(losses.detach(), expected, rtol=1e-13, atol=1e-13)
    assert model.predict(x_i).shape == (n, 1)


def test_autograd_gives_the_exact_gradient_and_torch_func_the_same():
    model = moved(QuadraticLoss(9, "log"))
    x_i = rows(40, 9)
    exact = model.hessian_diagonal * (model.x.detach() - x_i.mean(0))
    model(x_i).mean().backward()
    torch.testing.assert_close(model.x.grad, exact, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(model.gradient(x_i), exact, rtol=1e-12, atol=1e-14)
    params = {"x": model.x.detach()}

    def loss_of_row(p, row):
        return torch.func.functional_call(model, p, (row[None],))[0]

    per_example = vmap(grad(loss_of_row), in_dims=(None, 0))(params, x_i)["x"]  # the plain formula under torch.func
    torch.testing.assert_close(per_example.mean(0), exact, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping", "vmap"])
def test_per_example_rule_gives_the_clipped_sum_of_the_exact_per_example_gradients(mode):
    model = moved(QuadraticLoss(6, "identity"))
    x_i = rows(30, 6)
    clip = 2.0
    per_example = model.hessian_diagonal * (model.x.detach() - x_i)
    factors = (clip / per_example.norm(dim=1)).clamp(max=1)
    engine = PerExampleGradientEngine(model, mode=mode)
    result = engine.clipped_sum(lambda: model(x_i), clip)
    # (the engine rounds each norm up to a bound: factors a few ulps of float32 below C / ||g_i||)
    torch.testing.assert_close(result.grads[0], (factors[:, None] * per_example).sum(0), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(result.norms.double(), per_example.norm(dim=1), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("cls,kwargs", [(MeZO, {}), (DPZero, dict(clip=1e3, noise_multiplier=1.0)),
                                        (DPGD0th, dict(clip=1e3, noise_multiplier=1.0))])
def test_central_differences_are_the_directional_derivatives(cls, kwargs):
    """At the paper's lam = 1e-4 the float64 central difference is ``u^T A (x - x_i)`` to rounding (App. B.1)."""
    from lit_zodp.zo import PerturbationEngine, make_direction_law

    model = moved(QuadraticLoss(300, "sqrt"))
    x_i = rows(16, 300)
    module = cls(model, lr=1e-3, lam=1e-4, directions="sphere", perturbation="chunked", **kwargs)
    module.engine = PerturbationEngine([model.x], make_direction_law("sphere"))
    differences = module.directional_differences(3, x_i, torch.zeros(16, dtype=torch.long))
    module.restore()
    u = module.engine.direction(3)[0].double()  # (drawn in float32, applied to the float64 x)
    assert u.norm() == pytest.approx(math.sqrt(300), rel=1e-6)
    torch.testing.assert_close(differences, (model.hessian_diagonal * (model.x.detach() - x_i)) @ u,
                               rtol=1e-7, atol=1e-7)


def test_validation_and_test_log_the_exact_gradient_norm_over_the_whole_set():
    """``val_grad_norm`` / ``test_grad_norm`` are ``||A (x - mean_i x_i)||`` over every test row, across several
    evaluation batches, and ``*_loss`` the mean loss; no accuracy is logged."""
    data = QuadraticDataModule(dim=5, n_train=64, n_test=50, eval_batch_size=16)
    model = moved(QuadraticLoss(5, "log"), seed=4)
    module = MeZO(model, lr=1e-3, lam=1e-4)
    trainer = quiet_trainer(max_steps=1)
    data.setup()
    test_rows = data.test_dataset.inputs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (metrics,) = trainer.test(module, datamodule=data, verbose=False)
    exact = model.hessian_diagonal * (model.x.detach() - test_rows.mean(0))
    assert set(metrics) == {"test_loss", "test_grad_norm"}
    assert metrics["test_grad_norm"] == pytest.approx(float(exact.norm()), rel=1e-6)
    with torch.no_grad():
        assert metrics["test_loss"] == pytest.approx(float(model(test_rows).mean()), rel=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (metrics,) = trainer.validate(module, datamodule=data, verbose=False)  # (the test set: no val_fraction)
    assert metrics["val_grad_norm"] == pytest.approx(float(exact.norm()), rel=1e-6)


def test_the_evaluated_loss_is_averaged_in_float64_after_the_trainer_moves_the_module():
    """``*_loss`` is the float64 mean of the losses: a MeanMetric's ``set_dtype(float64)`` was undone by the
    Trainer's ``module.to(device)`` (torchmetrics resets its cast dtype to float32), so each loss was rounded to
    float32 before averaging (review 40: test_loss 2.66073263 for the exact 2.66073254)."""
    data = QuadraticDataModule(dim=5, n_train=100, n_test=37, eval_batch_size=10)
    model = QuadraticLoss(5, "sqrt", init=0.3)
    module = MeZO(model, lr=1e-3, lam=1e-4)
    data.setup()
    test_rows = data.test_dataset.inputs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (metrics,) = quiet_trainer(max_steps=1).test(module, datamodule=data, verbose=False)
    with torch.no_grad():
        assert metrics["test_loss"] == pytest.approx(float(model(test_rows).mean()), rel=1e-13)


def test_a_private_fit_keeps_float64_and_logs_its_gradient_norm():
    data = QuadraticDataModule(dim=4, n_train=200, n_test=100, eval_batch_size=64)
    module = DPSGD(QuadraticLoss(4, "identity"), lr=0.5, clip=3.0, target_epsilon=2.0, delta=1e-6)
    trainer = quiet_trainer(max_steps=5, val_check_interval=5, check_val_every_n_epoch=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    assert module.backbone.x.dtype == torch.float64
    assert trainer.global_step == 5 and "val_grad_norm" in trainer.callback_metrics
    assert module.privacy.sampling.name == "full_batch"


def test_the_gradient_norm_of_the_private_rows_is_never_logged():
    """The exact gradient norm over the training rows is an un-noised statistic of the private set: a private module
    logs it only over held-out rows, and evaluating it on the private loader is refused like accuracy is."""
    from lit_zodp.cli import result_line
    from lit_zodp.errors import PrivacyConfigError

    data = QuadraticDataModule(dim=4, n_train=200, n_test=100)
    module = DPZero(QuadraticLoss(4, "log"), lr=0.1, clip=1.0, target_epsilon=2.0, delta=1e-6, lam=1e-4)
    trainer = quiet_trainer(max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
        with pytest.raises(PrivacyConfigError, match="reads the private training data"):
            trainer.validate(module, dataloaders=data.train_dataloader(), verbose=False)
    line = result_line(module, data, trainer, {"test_grad_norm": 0.012345, "test_loss": 1.0}, 1.0)
    assert " accuracy=- grad_norm=0.01235 steps=2 " in line


@pytest.mark.parametrize("kwargs,message", [
    (dict(dim=5, hessian="cubic"), r"Expected the backbone's `hessian` in \['identity', 'sqrt', 'log'\], but got "
                                   r"'cubic'"),
    (dict(dim=0), r"Expected the backbone's `dim` to be a positive int, but got 0"),
    (dict(dim=5, dtype="float16"), r"Expected the backbone's `dtype` in \['float64', 'float32'\], but got 'float16'"),
    (dict(dim=5, init=float("nan")), r"Expected the backbone's `init` to be a finite float, but got nan"),
])
def test_bad_options_are_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        QuadraticLoss(**kwargs)


def test_a_dimension_other_than_the_datas_is_refused_at_setup():
    data = QuadraticDataModule(dim=6, n_train=20, n_test=10)
    with pytest.raises(ConfigError, match=r"Model/data mismatch: the backbone QuadraticLoss has `dim` 5, but the "
                                          r"data's rows have shape \(6,\): set the same `dim` on both"):
        quiet_trainer(max_steps=1).fit(MeZO(QuadraticLoss(5), lr=1e-3), datamodule=data)
