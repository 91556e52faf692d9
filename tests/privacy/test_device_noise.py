"""The GPU noise law (lit_zodp.privacy.device_noise): 128-bit key, Gaussian moments and tail, kernel = reference.

The Triton kernel runs on CPU only under ``TRITON_INTERPRET=1`` (read when Triton is imported), so it
runs in a subprocess executing this file as a script; the tests compare its output with the torch
reference computed here. ``gpu``-marked tests run the compiled kernel.
"""

from __future__ import annotations

import itertools
import math
import sys

import pytest
import torch

from lit_zodp.privacy import NoiseSource
from lit_zodp.privacy.device_noise import SecretKey, kernel_std, reference_noised, reference_normals
from tests._triton import compile_for_sm90, run_interpreted

pytestmark = pytest.mark.filterwarnings("ignore:`noise_seed` is set")

KEY = SecretKey(0x01234567, 0x89ABCDEF, 0xDEADBEEF, 0x0BADF00D)
INTERPRETED_SIZES = [1, 2, 7, 2048, 2049, 5000]
FAR_BASE = (1 << 40) * 3 + (1 << 32) - 5  # a chunk far out, across the counter's 32-bit boundary


def interpreted_runs() -> dict:
    """What the interpreted kernel computes (in the TRITON_INTERPRET=1 subprocess)."""
    from lit_zodp.privacy.device_noise import add_gaussian

    out = {}
    for n in INTERPRETED_SIZES:
        x = torch.linspace(-3, 3, n)
        out[n] = add_gaussian(x, 0.7, KEY)
    x = torch.zeros(3001)
    out["far"] = add_gaussian(x, 1.0, KEY, pair_base=FAR_BASE)
    inplace = torch.ones(10)
    add_gaussian(inplace, 2.0, KEY, out=inplace)
    out["inplace"] = inplace
    wide = torch.linspace(-3, 3, 3001, dtype=torch.float64)  # DPGD-0th's float64 sums: no rounding
    out["float64"] = add_gaussian(wide, 0.7, KEY, pair_base=FAR_BASE, out=wide)
    sums = torch.linspace(-3, 3, 3001, dtype=torch.float64) + 1e-9  # clipped sums: float64 in, float32 out
    out["narrowed"] = add_gaussian(sums, 0.7, KEY, out=torch.empty(3001))
    return out


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(__file__, tmp_path_factory, "noise")


def float32_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    spacing = (torch.nextafter(b.abs(), torch.full_like(b, math.inf)) - b.abs()).double()
    return (a.double() - b.double()).abs() / spacing


# ------------------------------------------------------------------------------ the law
def test_moments_and_quantiles_of_two_million_draws():
    z = reference_normals(2_000_000, KEY)
    n = z.numel()
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / n)
    assert abs((z ** 4).mean().item() - 3) < 5 * math.sqrt(96 / n)  # Var(z^4) = 96
    normal = torch.distributions.Normal(0.0, 1.0)
    for q in (0.001, 0.02, 0.16, 0.5, 0.84, 0.98, 0.999):
        empirical = (z <= normal.icdf(torch.tensor(q)).item()).double().mean().item()
        assert abs(empirical - q) < 5 * math.sqrt(q * (1 - q) / n)
    # consecutive values (the cos and sin of one pair, and neighbouring pairs) are uncorrelated
    assert abs((z[0::2] * z[1::2]).mean().item()) < 5 / math.sqrt(n / 2)
    assert abs((z[1:-1:2] * z[2::2]).mean().item()) < 5 / math.sqrt(n / 2)


def test_the_tail_reaches_beyond_six_sigma_and_stops_at_8_66():
    """53-bit uniforms: |z| <= sqrt(-2 ln 2^-54) = 8.66; the smallest u1 gives it exactly."""
    bound = math.sqrt(-2 * math.log(0.5 * 2.0 ** -53))
    assert bound == pytest.approx(8.66, abs=0.01)
    z = reference_normals(4_000_000, KEY)
    assert z.abs().max().item() <= bound
    assert z.abs().max().item() > 4.5  # 4M draws: P(max |z| < 4.5) ~ e^-27
    # float32 Box-Muller with tl.randn's 1e-7 floor could never exceed 5.68
    assert math.sqrt(-2 * math.log(1e-7)) < 5.7


def test_every_one_of_the_128_key_bits_changes_the_draw():
    base = reference_normals(8, KEY)
    words = ("k0", "k1", "s0", "s1")
    for w in words:
        for bit in range(32):
            fields = {name: getattr(KEY, name) for name in words}
            fields[w] ^= 1 << bit
            other = reference_normals(8, SecretKey(**fields))
            assert not torch.equal(base, other), f"{w} bit {bit} does not change the noise"


def test_a_chunk_is_the_same_stretch_of_the_long_vector():
    whole = reference_normals(1000, KEY)
    assert torch.equal(reference_normals(600, KEY, pair_base=200), whole[400:])
    assert torch.equal(reference_normals(5, KEY, pair_base=3), whole[6:11])


def test_the_key_never_shows_in_a_repr_and_words_are_checked():
    assert "0x" not in repr(KEY) and str(KEY.k0) not in repr(KEY)
    with pytest.raises(ValueError, match="32-bit"):
        SecretKey(1 << 32, 0, 0, 0)
    key = SecretKey.from_words64((0x89ABCDEF01234567, 0x0BADF00DDEADBEEF))
    assert key == KEY


def test_std_is_rounded_up_to_float32_never_down():
    for std in (0.1, 1 / 3, 2.7e-5, 27.0, 1e-30, 0.0):
        value = kernel_std(std)
        assert value >= std and torch.tensor(value, dtype=torch.float32).item() == value
        assert value - std <= 2.0 ** -23 * max(std, 1e-45)
    with pytest.raises(ValueError, match="noise std"):
        kernel_std(-1.0)


def test_noise_source_draws_a_fresh_key_per_release():
    source = NoiseSource(7)
    a, b = source.device_key(), source.device_key()
    assert a != b
    again = NoiseSource(7)
    assert again.device_key() == a  # a test seed makes it reproducible (and warns)


# ------------------------------------------------------------------------------ the kernel
def test_interpreted_kernel_equals_the_reference(interpreted):
    """Philox words are bitwise; float64 log/sin/cos may differ by an ulp of float64: within 1 float32 ulp."""
    for n in INTERPRETED_SIZES:
        x = torch.linspace(-3, 3, n)
        expected = reference_noised(x, 0.7, KEY)
        got = interpreted[n]
        assert got.shape == x.shape and got.dtype == torch.float32
        assert float32_ulps(got, expected).max().item() <= 1
        assert (got == expected).double().mean().item() > 0.99
    far = reference_noised(torch.zeros(3001), 1.0, KEY, pair_base=FAR_BASE)
    assert float32_ulps(interpreted["far"], far).max().item() <= 1
    assert float32_ulps(interpreted["inplace"], reference_noised(torch.ones(10), 2.0, KEY)).max().item() <= 1
    wide = reference_noised(torch.linspace(-3, 3, 3001, dtype=torch.float64), 0.7, KEY, pair_base=FAR_BASE)
    assert interpreted["float64"].dtype == torch.float64
    torch.testing.assert_close(interpreted["float64"], wide, rtol=0, atol=1e-14)
    assert (interpreted["float64"] != interpreted["float64"].float().double()).double().mean() > 0.99
    sums = torch.linspace(-3, 3, 3001, dtype=torch.float64) + 1e-9
    narrowed = reference_noised(sums, 0.7, KEY, dtype=torch.float32)
    assert interpreted["narrowed"].dtype == torch.float32
    assert float32_ulps(interpreted["narrowed"], narrowed).max().item() <= 1
    assert (interpreted["narrowed"] == narrowed).double().mean().item() > 0.99


def test_the_kernel_refuses_other_dtypes_and_a_mismatched_out():
    from lit_zodp.privacy.device_noise import add_gaussian

    with pytest.raises(ValueError, match="float32 or float64"):
        add_gaussian(torch.zeros(4, dtype=torch.float16), 1.0, KEY)
    with pytest.raises(ValueError, match="x's shape and dtype"):
        add_gaussian(torch.zeros(4), 1.0, KEY, out=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="x's shape and dtype"):
        add_gaussian(torch.zeros(4, dtype=torch.float64), 1.0, KEY, out=torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x's shape and dtype"):
        add_gaussian(torch.zeros(4), 1.0, KEY, out=torch.zeros(5))


def test_the_kernel_is_compiled_once_whatever_the_key():
    """Triton types an int argument by its value and specialises it (== 1, divisible by 16): a key word
    passed as is would select one of 32 compiled variants per release, a compilation the first time each
    appears, with a few secret bits showing in the step time and Triton's cache folder."""
    pytest.importorskip("triton")
    from triton.runtime import jit

    from lit_zodp.privacy import device_noise

    unspecialised = {p.name for p in device_noise._noise_kernel.params if p.do_not_specialize}
    assert {"numel", "pair_base", "k0", "k1", "s0", "s1"} <= unspecialised
    edges = [0, 1, 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32 - 1]
    keys = [SecretKey(*words) for words in itertools.product(edges, repeat=4)]
    mangle = getattr(jit, "mangle_type", None)
    types = set()
    for key in keys:
        words = device_noise.scalar_arguments(10, 0, key, 1.0)[2:6]
        assert [w & 0xFFFFFFFF for w in words] == [key.k0, key.k1, key.s0, key.s1]  # the bits, unchanged
        assert all(-2**31 <= w < 2**31 for w in words)
        if mangle is not None:
            types.add(tuple(mangle(w) for w in words))
    assert mangle is None or types == {("i32",) * 4}


@pytest.mark.parametrize("pointer,out_pointer", [("*fp32", "*fp32"), ("*fp64", "*fp64"), ("*fp64", "*fp32")])
def test_kernel_compiles_for_sm90_without_a_gpu(pointer, out_pointer, tmp_path, monkeypatch):
    """Triton's CUDA frontend and ptxas accept the float64 maths (what the interpreter cannot check), also with
    a float64 clipped sum written to a float32 release."""
    from lit_zodp.privacy import device_noise

    signature = {"x_ptr": pointer, "out_ptr": out_pointer, "numel": "i64", "pair_base": "i64", "k0": "i32",
                 "k1": "i32", "s0": "i32", "s1": "i32", "std": "fp32", "PAIRS": "constexpr"}
    kernel = compile_for_sm90(getattr(device_noise, "_noise_kernel", None), signature,
                              {"PAIRS": device_noise.PAIRS_PER_BLOCK}, monkeypatch, tmp_path)
    assert "lg2.approx" not in kernel.asm["ptx"]  # float64 log from libdevice, not the float32 approximation


@pytest.mark.gpu
def test_cuda_noise_equals_the_reference_and_the_release_draws_on_the_device():
    pytest.importorskip("triton")
    from lit_zodp.privacy.device_noise import add_gaussian

    x = torch.linspace(-3, 3, 1_000_003)
    got = add_gaussian(x.cuda(), 0.7, KEY).cpu()
    assert float32_ulps(got, reference_noised(x, 0.7, KEY)).max().item() <= 2
    source = NoiseSource(5)
    noised = source.noised(torch.zeros(4_000_000, device="cuda"), 3.0)
    assert noised.is_cuda and abs(noised.std().item() / 3.0 - 1) < 5e-3
    sums = torch.linspace(-3, 3, 1_000_003, dtype=torch.float64) + 1e-9  # a float64 clipped sum, released float32
    narrowed = add_gaussian(sums.cuda(), 0.7, KEY, out=torch.empty(len(sums), device="cuda")).cpu()
    assert float32_ulps(narrowed, reference_noised(sums, 0.7, KEY, dtype=torch.float32)).max().item() <= 2
    released = source.noised(sums[:2].cuda(), 3.0, divisor=4.0, dtype=torch.float32)
    assert released.is_cuda and released.dtype == torch.float32


@pytest.mark.gpu
def test_fresh_keys_reuse_the_one_compiled_cuda_kernel():
    pytest.importorskip("triton")
    from lit_zodp.privacy import device_noise

    caches = getattr(device_noise._noise_kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this triton keeps its compiled kernels elsewhere")
    x = torch.zeros(5, device="cuda")
    source = NoiseSource()
    device_noise.add_gaussian(x, 1.0, source.device_key())
    compiled = sum(len(entry[0]) for entry in caches.values())
    for _ in range(64):
        device_noise.add_gaussian(x, 1.0, source.device_key())
    assert sum(len(entry[0]) for entry in caches.values()) == compiled


if __name__ == "__main__":  # the TRITON_INTERPRET=1 subprocess of the `interpreted` fixture
    torch.save(interpreted_runs(), sys.argv[1])
