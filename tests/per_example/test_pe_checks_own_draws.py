"""The independence checks' own secret draws are made outside every dispatch mode (``checks_own_draws``).

A check's recomputation takes every draw it sees at its mean or a fixed stand-in, from any generator (a model's own
too, :class:`~lit_zodp.per_example.checks.MeanOfRandomDraws`). The checks' splits, rows, weights and projections
drawn inside it would be fixed (``randperm`` the identity, ``randn`` zero): a model could aim at them. These tests
fail if one of them is drawn where the mode sees it.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lit_zodp.errors import LitZodpWarning, PrivacyConfigError
from lit_zodp.per_example import PerExampleGradientEngine, alignment, checks, gradient_halves
from lit_zodp.per_example.checks import MeanOfRandomDraws, step_mode_recompute
from lit_zodp.per_example.engine import _SecretProjections

PACKAGE = Path(checks.__file__).resolve().parents[1]
#: Where the checks draw: every call given an explicit ``generator=`` there must be inside ``checks_own_draws()``.
CHECK_SOURCES = sorted((PACKAGE / "per_example").glob("*.py")) + [PACKAGE / "algorithms" / "base.py",
                                                                 PACKAGE / "algorithms" / "first_order.py"]

DRAWS = {
    "random_halves": lambda: torch.cat(checks.random_halves(64)),
    "secret_row": lambda: checks.secret_row(2**40),
    "separating_splits": lambda: torch.stack([h for pair in gradient_halves.separating_splits(64) for h in pair]),
    "secret_row_weights": lambda: gradient_halves.secret_row_weights(64),
    "alignment_weights": lambda: alignment._random_weights(torch.zeros(64), checks.secret_cpu_generator()),
    "secret_projections": lambda: _SecretProjections(torch.device("cpu"))(torch.eye(3)),
}


def _draws_twice(draw) -> tuple:
    return draw(), draw()


@pytest.mark.parametrize("name", sorted(DRAWS))
@pytest.mark.parametrize("context", ["mean_of_random_draws", "step_mode_recompute"])
def test_the_checks_draws_stay_secret_and_random_inside_a_recomputation(name, context):
    """Inside the mode two draws differ (not the stand-in) and match what the same draw gives outside it in law
    (a permutation stays one; weights stay in ``[1, 2)``)."""
    mode = MeanOfRandomDraws() if context == "mean_of_random_draws" else step_mode_recompute()
    with mode as draws:
        first, second = _draws_twice(DRAWS[name])
    assert not torch.equal(first, second), f"{name} drew the same numbers twice inside a recomputation"
    assert not draws.replaced, f"{name}'s draw was seen (and replaced) by the recomputation's mode"
    if name == "random_halves":
        assert torch.equal(first.sort().values, torch.arange(64)) and not torch.equal(first, torch.arange(64))


def test_the_alignment_projections_are_drawn_inside_a_recomputation_and_are_not_its_stand_in():
    """The alignment check's Gaussian pairs (seeded per check and shape) drawn inside the mode: the same seed's pairs
    as outside (not zero, its mean)."""
    grad = torch.zeros(4, 5, 6)
    with MeanOfRandomDraws() as draws:
        inside = alignment._RowSummaries({}, 123)._pairs(grad)
    outside = alignment._RowSummaries({}, 123)._pairs(grad)
    assert not draws.replaced and inside[0].abs().sum() > 0
    assert torch.equal(inside[0], outside[0]) and torch.equal(inside[1], outside[1])


def _calls_with_a_generator_outside_the_context(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def inside_the_context(node: ast.AST) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.With) and any(
                    isinstance(item.context_expr, ast.Call) and getattr(item.context_expr.func, "id", None)
                    == "checks_own_draws" for item in node.items):
                return True
        return False

    return [f"{path.name}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and any(k.arg == "generator" for k in node.keywords)
            and not inside_the_context(node)]


def test_every_draw_the_checks_make_with_a_generator_is_inside_checks_own_draws():
    """A source scan: a new draw site in the checks that forgets the context fails here."""
    assert all(path.exists() for path in CHECK_SOURCES)
    outside = [site for path in CHECK_SOURCES for site in _calls_with_a_generator_outside_the_context(path)]
    assert outside == [], f"draws with an explicit generator outside checks_own_draws(): {outside}"


def test_the_scan_finds_a_draw_outside_the_context(tmp_path):
    """The scan's control: it sees a draw outside the context, and none inside it."""
    path = tmp_path / "sites.py"
    path.write_text("def a(g):\n    return torch.rand(3, generator=g)\n\n"
                    "def b(g):\n    with checks_own_draws():\n        return torch.rand(3, generator=g)\n")
    assert _calls_with_a_generator_outside_the_context(path) == ["sites.py:2"]


class _OwnGeneratorNet(torch.nn.Module):
    """Input noise and a dropout-like mask drawn from a generator of the model's own on its device; ``mix``: a
    train-only mixup of its rows drawn from it too."""

    def __init__(self, device: str, mix: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.mix = torch.nn.Linear(8, 16), torch.nn.Linear(16, 2), mix
        self.generator = torch.Generator(device=device).manual_seed(7)

    def forward(self, x):
        g = self.generator
        if self.training:
            x = x + 0.1 * torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)
            if self.mix:
                lam = torch.rand((), generator=g, device=x.device) * 0.5 + 0.25
                x = lam * x + (1 - lam) * x[torch.randperm(len(x), generator=g, device=x.device)]
        h = torch.tanh(self.fc1(x))
        if self.training:
            h = h * (torch.rand(h.shape, generator=g, device=h.device, dtype=h.dtype) > 0.1) / 0.9
        return self.fc2(h)


def own_generator_checks(mode: str, device: str) -> None:
    """Three checked steps of an honest model drawing from its own generator: no refusal, no warning, and after each
    the generator stands where the step's own draws left it (the checks draw from fresh secret states of it and set
    it back: :func:`~lit_zodp.per_example.checks._drawn_secretly`, a CUDA state on CUDA); the mixing twin refused."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1)).to(device)
    y = (torch.arange(16) % 2).to(device)
    model = _OwnGeneratorNet(device).to(device).train()
    engine = PerExampleGradientEngine(model, mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LitZodpWarning)
        for step in range(3):
            engine.recheck_next = True
            twin = torch.Generator(device=device)
            twin.set_state(model.generator.get_state())
            torch.randn(x.shape, generator=twin, device=device)  # (the step's own draws)
            torch.rand((16, 16), generator=twin, device=device)
            engine.clipped_sum(lambda: F.cross_entropy(model(x), y, reduction="none"), 1.0)
            assert torch.equal(model.generator.get_state(), twin.get_state()), f"the checks moved the stream ({step})"
    mixing = _OwnGeneratorNet(device, mix=True).to(device).train()
    with pytest.raises(PrivacyConfigError, match="batch-mates"):
        PerExampleGradientEngine(mixing, mode=mode).clipped_sum(
            lambda: F.cross_entropy(mixing(x), y, reduction="none"), 1.0)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping"])
def test_a_models_own_generator_is_checked_in_training_and_its_stream_is_left_alone(mode):
    """At 85bb34b the first check drew from the generator (the engine did not know it yet), moving its stream."""
    own_generator_checks(mode, "cpu")
