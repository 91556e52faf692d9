"""Secret training-mode randomness (lit_zodp.privacy.training_randomness): every MT19937 word from the OS, no
public value carried in, the public streams untouched; the CUDA state's key and offset from the OS."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import lit_zodp.privacy.training_randomness as tr
from lit_zodp.privacy.training_randomness import (MT_WORDS, secret_cpu_generator, secret_cpu_state,
                                                  secret_cuda_state, secret_training_randomness)

CPU = torch.device("cpu")


def words_of(state: torch.Tensor) -> np.ndarray:
    return np.frombuffer(state.numpy().tobytes(), dtype="<u8", count=MT_WORDS, offset=24)


def test_every_state_word_comes_from_the_os_and_the_first_draw_twists_them(monkeypatch):
    pattern = np.arange(1, MT_WORDS + 1, dtype="<u4") * np.uint32(2654435761)
    monkeypatch.setattr(tr.os, "urandom", lambda n: pattern.tobytes()[:n])
    state = secret_cpu_state()
    assert np.array_equal(words_of(state), pattern.astype("<u8"))
    _, left, seeded, following = struct.unpack_from("<QiiQ", state.numpy().tobytes(), 0)
    assert (left, seeded, following) == (1, 1, 0)
    first = torch.Generator()
    first.set_state(state)
    assert torch.equal(first.get_state(), state)  # torch took every word as written
    last_word_changed = pattern.copy()
    last_word_changed[-1] ^= 1
    monkeypatch.setattr(tr.os, "urandom", lambda n: last_word_changed.tobytes()[:n])
    second = torch.Generator()
    second.set_state(secret_cpu_state())
    block = 2 * MT_WORDS  # (a word first shows in the outputs of the block it is twisted into)
    assert not torch.equal(torch.rand(block, generator=first), torch.rand(block, generator=second))


def test_inside_the_draws_are_fresh_and_outside_the_public_stream_continues_where_it_was():
    torch.manual_seed(0)
    expected = torch.rand(4), torch.randn(4)
    torch.manual_seed(0)
    before = torch.rand(4)
    inside = []
    for _ in range(2):
        torch.manual_seed(0)
        torch.rand(4)
        with secret_training_randomness(CPU):
            inside.append(torch.bernoulli(torch.full((64,), 0.5)))
    after = torch.randn(4)
    assert torch.equal(before, expected[0]) and torch.equal(after, expected[1])
    assert not torch.equal(inside[0], inside[1])  # the same public state before, different secret draws


def test_a_normal_value_cached_by_the_public_stream_is_not_drawn_inside():
    torch.manual_seed(0)
    torch.randn(1)  # scalar normals come in pairs: the second waits in the generator's cache
    public_next = torch.get_rng_state()
    cached = torch.randn(1)
    torch.set_rng_state(public_next)
    with secret_training_randomness(CPU):
        secret = torch.randn(1)
    assert not torch.equal(secret, cached)
    assert torch.equal(torch.randn(1), cached)  # and the public cache is back after


def test_an_error_inside_restores_the_public_stream():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with pytest.raises(ValueError):
        with secret_training_randomness(CPU):
            torch.rand(100)
            raise ValueError("inside")
    assert torch.equal(torch.rand(3), expected)


def test_secret_generators_differ_and_leave_the_default_stream_alone():
    torch.manual_seed(2)
    expected = torch.rand(2)
    torch.manual_seed(2)
    draws = [torch.randperm(50, generator=secret_cpu_generator()) for _ in range(2)]
    assert not torch.equal(*draws)
    assert torch.equal(torch.rand(2), expected)


def test_the_cuda_state_is_a_key_and_an_offset_multiple_of_four_from_the_os(monkeypatch):
    monkeypatch.setattr(tr.os, "urandom", lambda n: bytes(range(255, 255 - n, -1)))
    key, offset = np.frombuffer(secret_cuda_state().numpy().tobytes(), dtype="<u8")
    raw_key, raw_offset = struct.unpack("<QQ", bytes(range(255, 239, -1)))
    assert (int(key), int(offset)) == (raw_key, raw_offset & ~3) and offset % 4 == 0


def test_a_device_whose_generator_it_cannot_key_is_refused_in_one_line():
    from lit_zodp.errors import PrivacyConfigError

    with pytest.raises(PrivacyConfigError, match="on 'meta' it would follow the public run seed") as info:
        with secret_training_randomness(torch.device("meta")):
            pass
    assert "\n" not in str(info.value)


@pytest.mark.gpu
def test_on_cuda_the_devices_stream_is_secret_inside_and_restored_after():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    torch.cuda.manual_seed(7)
    expected = torch.rand(4, device=device)
    torch.cuda.manual_seed(7)
    inside = []
    for _ in range(2):
        with secret_training_randomness(device):
            inside.append(torch.rand(64, device=device))
    assert not torch.equal(inside[0], inside[1])
    assert torch.equal(torch.rand(4, device=device), expected)


def test_a_replayed_state_draws_the_steps_masks_again_and_leaves_the_stream_where_it_was():
    """``random_state`` then ``replayed_streams``: a dropout inside draws the masks drawn after the state was taken,
    and the stream outside continues as if the block had not run (stop 59: the set-apart row's check replays a
    step's dropout masks)."""
    from lit_zodp.privacy.training_randomness import random_state, replayed_streams

    dropout, x = torch.nn.Dropout(0.5).train(), torch.ones(4, 64)
    state = random_state()
    first = dropout(x)
    after = torch.random.get_rng_state()
    with replayed_streams(state):
        assert torch.equal(dropout(x), first)
    assert torch.equal(torch.random.get_rng_state(), after)
    assert not torch.equal(dropout(x), first)


def test_the_steps_generator_states_are_dropped_with_its_tape():
    """The engine keeps the generators' states of each call of its module in training (a secret state inside a
    private step) for that step only: after it, no call holds one and no pending check holds the calls."""
    from lit_zodp.per_example import PerExampleGradientEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 2)).train()
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    engine = PerExampleGradientEngine(model)
    seen, held = [], []
    original = engine._per_example

    def per_example(loss_fn, tape, **kwargs):
        result = original(loss_fn, tape, **kwargs)
        seen.extend(call for call in tape.module_calls if call.module is model)
        held.extend(call.random_state is not None for call in seen)
        return result

    engine._per_example = per_example
    engine.clipped_sum(lambda: torch.nn.functional.cross_entropy(model(x), y, reduction="none"), 1.0)
    assert held and all(held)  # (during the step)
    assert all(call.random_state is None for call in seen)
    assert engine._gradient_check is None
