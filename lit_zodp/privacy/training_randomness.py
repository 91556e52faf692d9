"""Secret training-mode randomness for private forwards (dropout, drop-path, any draw from torch's generators).

A private first-order step runs its forward and backward in training mode, where dropout and drop-path draw
from torch's default generators. Those streams are public: ``seed_everything`` (every shipped config) fixes
them, and the attacker knows the run seed. Row ``p`` of a batch gets the ``p``-th block of the stream, so
adding one example shifts the masks of every row after it, and the released sum moves by far more than the
clip ``C`` (a privacy audit measured 31 C with full-batch sampling, 1.6-1.9 C on random batches).

The coupling argument behind sensitivity ``C`` holds when each example's randomness is independent of the
others' and of everything the attacker knows: then the examples common to two neighbouring batches can be
given the same masks, and only the added example's clipped term differs. :func:`secret_training_randomness`
provides it: inside, torch's CPU generator and the step's CUDA generator hold fresh states from the OS, and
outside, their public streams continue exactly where they were (a private step draws nothing from them,
whatever the private batch size).

State sizes: the CPU generator (MT19937) holds 624 32-bit words, all filled from ``os.urandom``
(``manual_seed`` keeps 32 bits of a seed: a searchable space). A CUDA generator holds a 64-bit Philox key
and a 64-bit counter offset that torch requires to be a multiple of 4: 126 bits from the OS, the most its
state can hold.
"""

from __future__ import annotations

import contextlib
import os
import struct
from typing import Iterable, Iterator, NamedTuple, Optional, Union

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from lit_zodp.errors import PrivacyConfigError

#: MT19937 state words, and the byte layout of torch's CPU generator state (``CPUGeneratorImplState``):
#: ``(initial seed u64, left i32, seeded i32, next u64)``, then the words as ``u64``, then the normal caches.
MT_WORDS = 624
_HEADER = struct.Struct("<QiiQ")
_WORDS_AT = _HEADER.size
_CPU_STATE_BYTES = 5056
#: Secret bits a CUDA generator state takes: a 64-bit key and an offset that is a multiple of 4.
CUDA_SECRET_BITS = 126

_template: Optional[torch.Tensor] = None


class GeneratorLayoutError(RuntimeError):
    """torch's CPU generator state is not laid out as this module writes it (a torch change)."""


def _clean_template() -> torch.Tensor:
    """A fresh CPU generator's state (its normal caches empty), checked once to have the layout written here."""
    global _template
    if _template is None:
        state = torch.Generator().get_state()
        seed, left, seeded, _ = _HEADER.unpack_from(state.numpy().tobytes(), 0)
        if state.numel() != _CPU_STATE_BYTES or seeded != 1 or not 1 <= left <= MT_WORDS:
            raise GeneratorLayoutError(
                f"torch {torch.__version__}'s CPU generator state ({state.numel()} bytes) is not the layout "
                "lit_zodp fills with secret words; private training-mode randomness cannot be keyed")
        _template = state
    return _template


def secret_cpu_state() -> torch.Tensor:
    """A CPU generator state whose 624 MT19937 words all come from ``os.urandom`` (19968 bits), positioned to
    regenerate its block before the first draw, with no cached normal value."""
    state = _clean_template().clone()
    raw = state.numpy()
    words = np.frombuffer(os.urandom(4 * MT_WORDS), dtype="<u4").astype("<u8")
    raw[_WORDS_AT:_WORDS_AT + 8 * MT_WORDS] = words.view(np.uint8)
    _HEADER.pack_into(raw, 0, 0, 1, 1, 0)  # left = 1, next = 0: the first draw twists the secret words
    return state


def secret_cpu_generator() -> torch.Generator:
    """A CPU ``torch.Generator`` in a :func:`secret_cpu_state`: draws that neither depend on nor advance the
    user's seeded streams, and that no seed search predicts."""
    generator = torch.Generator()
    generator.set_state(secret_cpu_state())
    return generator


@contextlib.contextmanager
def checks_own_draws() -> Iterator[None]:
    """The independence checks' own draws (their splits, rows, weights and projections), made where no dispatch mode
    sees them: a check's recomputation takes every draw it sees at its mean, a model's own generators' too
    (:class:`~lit_zodp.per_example.checks.MeanOfRandomDraws`), and a split taken at its stand-in would be fixed. The
    checks ran inside that mode (the module checks, and the backward hooks of a recomputation), so until stop 62 it
    left every generator it did not know alone, a model's own among them: their draws moved the model's stream and
    sent an honest check to eval mode (red-team review 75, findings 5 and 6)."""
    with _disable_current_modes():
        yield


def secret_cuda_state() -> torch.Tensor:
    """A CUDA generator state ``(Philox key, offset)`` of :data:`CUDA_SECRET_BITS` bits from ``os.urandom``."""
    key, offset = struct.unpack("<QQ", os.urandom(16))
    return torch.tensor(np.array([key, offset & ~3], dtype="<u8").view("<i8")).view(torch.uint8)


def _cuda_indices(device: torch.device) -> list[int]:
    """Every visible CUDA device for a module on CUDA (a model split across cards draws dropout on each)."""
    if device.type == "cpu":
        return []
    if device.type != "cuda":  # (its own generator would keep following the public seed)
        raise PrivacyConfigError(
            f"A private first-order step keys its training-mode randomness (dropout) secretly on CPU and CUDA only; "
            f"on {device.type!r} it would follow the public run seed: train on the cpu or a CUDA device")
    return list(range(torch.cuda.device_count()))


def _index(device: Union[int, torch.device]) -> int:
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


@contextlib.contextmanager
def secret_training_randomness(device: torch.device) -> Iterator[None]:
    """Run the enclosed private forward and backward with secret training-mode randomness (module docstring):
    torch's CPU generator (and every visible CUDA device's, for a module on CUDA) keyed from the OS inside,
    their public streams restored after. Activation checkpointing stashes and restores the state it sees, so a
    recomputation inside draws the same secret masks as its forward."""
    with secret_streams(_cuda_indices(torch.device(device))):
        yield


@contextlib.contextmanager
def secret_streams(cuda_devices: Iterable[Union[int, torch.device]] = ()) -> Iterator[None]:
    """Inside: torch's CPU generator and those CUDA devices' (indices or devices; an index-less device is the
    current one) in fresh secret states from the OS; after, each back where it was, on error too."""
    cuda = [torch.cuda.default_generators[_index(device)] for device in cuda_devices]
    cpu_before = torch.random.default_generator.get_state()
    cuda_before = [generator.get_state() for generator in cuda]
    try:
        torch.random.default_generator.set_state(secret_cpu_state())
        for generator in cuda:
            generator.set_state(secret_cuda_state())
        yield
    finally:
        torch.random.default_generator.set_state(cpu_before)
        for generator, state in zip(cuda, cuda_before):
            generator.set_state(state)


class RandomState(NamedTuple):
    """torch's CPU generator state and the initialised CUDA devices' (``(index, state)``), taken at a private forward
    (:func:`random_state`): the checks replay a step's own dropout masks with it (:func:`replayed_streams`). Held in
    memory for the step only (the engine's tape), never saved: inside a private step it is a secret state.
    ``explicit``: ``(generator, state)`` of a model's own ``torch.Generator`` s that the checks have seen its
    forward draw from (:class:`~lit_zodp.per_example.checks.Replay` sets them there)."""

    cpu: torch.Tensor
    cuda: tuple
    explicit: tuple = ()


def random_state(cuda_devices: Iterable[int] = (), generators: Iterable[torch.Generator] = ()) -> RandomState:
    """The generators' states now: the CPU's, and those of ``cuda_devices`` (indices) and of the current CUDA device
    where CUDA is initialised (no other device's: reading one would create its context), and ``generators``'."""
    devices = set(cuda_devices) | ({torch.cuda.current_device()} if torch.cuda.is_initialized() else set())
    cuda = tuple((i, torch.cuda.default_generators[i].get_state()) for i in sorted(devices))
    explicit = tuple((generator, generator.get_state()) for generator in list(generators))
    return RandomState(torch.random.default_generator.get_state(), cuda, explicit)


@contextlib.contextmanager
def replayed_streams(state: RandomState) -> Iterator[None]:
    """Inside: torch's CPU generator and the recorded CUDA devices' at ``state``, so a forward run as the step ran it
    (same inputs, same shapes) draws the step's masks again; after, each back where it was, on error too."""
    cuda = [(torch.cuda.default_generators[i], saved) for i, saved in state.cuda]
    cpu_before = torch.random.default_generator.get_state()
    cuda_before = [generator.get_state() for generator, _ in cuda]
    try:
        torch.random.default_generator.set_state(state.cpu)
        for generator, saved in cuda:
            generator.set_state(saved)
        yield
    finally:
        torch.random.default_generator.set_state(cpu_before)
        for (generator, _), before in zip(cuda, cuda_before):
            generator.set_state(before)


@contextlib.contextmanager
def keyed_training_randomness(device: torch.device, seed: int) -> Iterator[None]:
    """Run the enclosed forward and backward of a PUBLIC computation that every DDP rank must repeat alike (GEP's
    anchor gradients) with training-mode randomness keyed by the public ``seed``: torch's CPU generator and every
    visible CUDA device's (each rank's model sits on its own device) seeded with it inside, their streams restored
    after, on error too. Secret states (:func:`secret_training_randomness`) gave each rank its own dropout masks."""
    cuda = list(torch.cuda.default_generators) if torch.device(device).type == "cuda" else []
    cpu_before = torch.random.default_generator.get_state()
    cuda_before = [generator.get_state() for generator in cuda]
    try:
        torch.random.default_generator.manual_seed(seed)
        for generator in cuda:
            generator.manual_seed(seed)
        yield
    finally:
        torch.random.default_generator.set_state(cpu_before)
        for generator, state in zip(cuda, cuda_before):
            generator.set_state(state)


__all__ = ["CUDA_SECRET_BITS", "GeneratorLayoutError", "MT_WORDS", "checks_own_draws", "keyed_training_randomness",
           "secret_cpu_generator", "secret_cpu_state", "secret_cuda_state", "secret_streams", "secret_training_randomness",
           "RandomState", "random_state", "replayed_streams"]
