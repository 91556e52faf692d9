import math

import pytest
import torch
from torch import nn

from lit_zodp.zo import GaussianDirections, PerturbationEngine, SphereDirections, central_differences


class Quadratic(nn.Module):
    """f(x; b_i) = 1/2 (x - b_i)^T A (x - b_i), one loss per row of b."""

    def __init__(self, dim: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.x = nn.Parameter(torch.randn(dim, generator=g, dtype=torch.float64))
        self.A = torch.diag(1.0 / torch.arange(1, dim + 1, dtype=torch.float64))
        self.b = torch.randn(8, dim, generator=g, dtype=torch.float64)

    def losses(self):
        r = self.x - self.b
        return 0.5 * ((r @ self.A) * r).sum(1)

    def gradient(self):
        return ((self.x - self.b) @ self.A).mean(0).detach()


@pytest.mark.parametrize("lam", [1e-3, 0.1, 10.0])
def test_central_difference_is_exact_on_a_quadratic(lam):
    """(f(x+lam u) - f(x-lam u)) / (2 lam) = u^T A (x - b) for any lam on a quadratic."""
    q = Quadratic(12)
    engine = PerturbationEngine([q.x])
    u = engine.direction(3)[0].double()
    differences = central_differences(engine, 3, lam, q.losses)
    engine.restore_()
    expected = ((q.x.detach() - q.b) @ q.A) @ u
    torch.testing.assert_close(differences, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("failing_call", [1, 2])
@pytest.mark.parametrize("engine_kind", ["chunked", "fused"])
def test_a_forward_that_raises_leaves_no_perturbation_behind(failing_call, engine_kind):
    """A refused configuration or an out-of-memory error in the forward at x + lam u (call 1) or
    x - lam u (call 2) must not leave the model perturbed (a checkpoint or a retry would see it)."""
    from lit_zodp.zo.fused import FusedPerturbation

    q = Quadratic(12)
    if engine_kind == "fused":  # float32, bf16 and fp16 parameters only
        q.x.data = q.x.data.float()
    start = q.x.detach().clone()
    engine = PerturbationEngine([q.x]) if engine_kind == "chunked" else FusedPerturbation([q.x], backend="reference")
    calls = []

    def losses():
        calls.append(q.x.detach().clone())
        if len(calls) == failing_call:
            raise MemoryError("out of memory")
        return q.losses()

    with pytest.raises(MemoryError):
        central_differences(engine, 3, 0.1, losses)
    assert not torch.equal(calls[-1], start) and not engine.pending  # it was perturbed, and is no more
    torch.testing.assert_close(q.x.detach(), start, rtol=0, atol=1e-6 if engine_kind == "fused" else 1e-12)


@pytest.mark.parametrize("law", [GaussianDirections(), SphereDirections()])
def test_monte_carlo_mean_of_the_estimate_is_the_gradient(law):
    """E[s u] = grad F for E[u u^T] = I (both laws), with s the mean central difference."""
    dim, draws = 6, 20_000
    q = Quadratic(dim, seed=1)
    engine = PerturbationEngine([q.x], law)
    estimates = torch.empty(draws, dim, dtype=torch.float64)
    for t in range(draws):
        s = central_differences(engine, t, 1e-2, q.losses).mean()
        engine.restore_()
        estimates[t] = s * engine.direction(t)[0].double()
    mean = estimates.mean(0)
    standard_error = estimates.std(0) / math.sqrt(draws)
    grad = q.gradient()
    assert ((mean - grad).abs() <= 5 * standard_error).all(), (mean, grad, standard_error)
