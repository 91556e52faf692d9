"""``checks.Replay``: runs that replay a step's draws, and whether they drew alike (stop 60)."""

import secrets
import warnings

import torch
import torch.nn.functional as F

from lit_zodp.errors import LitZodpWarning
from lit_zodp.per_example.checks import Replay
from lit_zodp.privacy.training_randomness import random_state


def _masks(replay: Replay, state, x: torch.Tensor) -> torch.Tensor:
    with replay.run(state):
        return F.dropout(x, 0.5) != 0  # (the content is never 0)


def test_runs_of_one_shape_draw_the_same_masks_whatever_the_content_and_leave_the_generator_alone():
    torch.manual_seed(0)
    state = random_state()
    step = F.dropout(torch.ones(8, 4), 0.5) != 0
    contents = torch.randn(8, 4), torch.randn(8, 4) * 100
    after = torch.random.get_rng_state()
    replay = Replay()
    first, second = (_masks(replay, state, x) for x in contents)
    assert torch.equal(first, step) and torch.equal(second, step)
    assert replay.alike()
    assert torch.equal(torch.random.get_rng_state(), after)


def test_runs_that_draw_more_or_fewer_numbers_are_not_alike():
    """A forward trimming its batch (fewer positions, fewer draws), and RReLU on CPU, which draws a slope only for
    each negative input."""
    state = random_state()
    trimmed = Replay()
    _masks(trimmed, state, torch.ones(8, 4))
    _masks(trimmed, state, torch.ones(8, 3))
    assert not trimmed.alike()

    rrelu = Replay()
    for x in (torch.randn(8, 4), torch.randn(8, 4).abs()):
        with rrelu.run(state):
            F.rrelu(x, training=True)
    assert not rrelu.alike()


def test_an_explicit_generator_draws_alike_in_every_run_and_is_put_back():
    """Stop 61: each run sets a model's own generator to where it stood at its first draw in the first run (mixup
    from one released 3.77 C unreplayed, review 73), and puts it back after."""
    state = random_state()
    generator = torch.Generator().manual_seed(0)
    torch.rand(4, generator=generator)  # (the step's own draw: the runs start where it left the generator)
    before = generator.get_state()
    expected = torch.rand(3, generator=torch.Generator().set_state(before))
    replay = Replay()
    for content in (torch.zeros(6), torch.ones(6)):
        with replay.run(state):
            drawn = torch.rand(3, generator=generator)
            content[torch.randperm(6, generator=generator)]  # (a second draw in the run continues the stream)
        assert torch.equal(drawn, expected)
        assert torch.equal(generator.get_state(), before)
    assert replay.alike()


def test_runs_drawing_differently_from_an_explicit_generator_are_not_alike():
    state = random_state()
    generator, other = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    fewer = Replay()
    for count in (3, 2):
        with fewer.run(state):
            torch.rand(count, generator=generator)
    assert not fewer.alike()

    another = Replay()  # (one run draws from a generator the other does not)
    for generators in ((generator,), (generator, other)):
        with another.run(state):
            for g in generators:
                torch.rand(3, generator=g)
    assert not another.alike()


def test_an_explicit_generator_is_put_back_when_the_run_fails():
    state = random_state()
    generator = torch.Generator().manual_seed(0)
    before = generator.get_state()
    replay = Replay()
    try:
        with replay.run(state):
            torch.rand(3, generator=generator)
            raise ValueError
    except ValueError:
        pass
    assert torch.equal(generator.get_state(), before)


def test_runs_from_two_states_are_compared_each_with_its_own():
    """The gradient halves replay each call of the module from its own state: two states, each run twice alike."""
    first = random_state()
    torch.rand(5)
    second = random_state()
    replay = Replay()
    for state, count in ((first, 3), (second, 7), (first, 3), (second, 7)):
        with replay.run(state):
            torch.rand(count)
    assert replay.alike()
    with replay.run(second):
        torch.rand(8)
    assert not replay.alike()


def test_a_generator_made_in_the_forward_is_compared_by_the_order_of_its_first_draw():
    """A new generator per run (seeded in the forward) draws alike where each run seeds it alike, not where the seed
    follows the content."""
    state = random_state()
    fixed, from_content = Replay(), Replay()
    for content in (torch.zeros(3), torch.ones(3)):
        with fixed.run(state):
            torch.rand(3, generator=torch.Generator().manual_seed(7))
        with from_content.run(state):
            torch.rand(3, generator=torch.Generator().manual_seed(int(content.sum())))
    assert fixed.alike()
    assert not from_content.alike()


class _OwnNoise(torch.nn.Module):
    """Input noise in training from a generator of the model's own (``fresh``: a new one made in every forward,
    seeded by the OS, drawing one scale for the batch)."""

    def __init__(self, fresh: bool = False):
        super().__init__()
        self.fc, self.fresh = torch.nn.Linear(4, 2), fresh
        self.generator = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.fresh:
            fresh = torch.Generator().manual_seed(secrets.randbits(63))
            x = x * (1 + 0.1 * torch.rand((), generator=fresh, dtype=x.dtype))
        elif self.training:
            x = x + 0.1 * torch.randn(x.shape, generator=self.generator, dtype=x.dtype)
        return self.fc(x)


def _checked_steps(model, steps: int):
    from lit_zodp.per_example import PerExampleGradientEngine

    engine = PerExampleGradientEngine(model)
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 2
    for _ in range(steps):
        engine.recheck_next = True
        engine.clipped_sum(lambda: F.cross_entropy(model(x), y, reduction="none"), 1.0)
    return engine


def test_the_engine_keeps_a_models_own_generator_and_its_checks_leave_its_stream_alone():
    """Stop 61: found by the first check's replays, the generator's state is kept at each later step, so a re-check's
    recomputations take its draws at their mean and its replays put it back: after a re-checked step it stands where
    the step's own draw left it. Neither a copy nor a pickle of the engine holds it."""
    import copy
    import pickle

    model = _OwnNoise()
    engine = _checked_steps(model, 1)
    assert engine._own_generators and torch.equal(engine._own_generators[0].get_state(), model.generator.get_state())
    twin = torch.Generator().set_state(model.generator.get_state())
    torch.randn(8, 4, generator=twin)  # (the step's own draw)
    engine.recheck_next = True
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 2
    engine.clipped_sum(lambda: F.cross_entropy(model(x), y, reduction="none"), 1.0)
    assert torch.equal(model.generator.get_state(), twin.get_state())
    assert "_own_generators" not in engine.__getstate__()
    assert copy.deepcopy(engine)._own_generators == pickle.loads(pickle.dumps(engine))._own_generators == []


def test_a_generator_made_in_every_forward_is_not_kept():
    """Each replayed run makes a new one: none is drawn from in two runs, so none piles up in the engine. Its runs
    cannot draw alike (warned); the halves compare in training mode, its draw at its mean (in eval mode until stop 62,
    warned)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _checked_steps(_OwnNoise(fresh=True), 3)._own_generators == []
    messages = [str(w.message) for w in caught if issubclass(w.category, LitZodpWarning)]
    assert messages and all("could not replay alike" in m for m in messages), messages
