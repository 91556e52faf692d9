"""The secret noise: its law, its entropy (every bit of a >= 128-bit secret matters), no checkpoint state."""

import math
import warnings

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_zodp.privacy import NoiseSource, SecretGaussianVector
from lit_zodp.privacy.noise import SECRET_BITS, secret_seed

pytestmark = pytest.mark.filterwarnings("ignore:`noise_seed` is set")


def test_empirical_std_of_the_noise_is_the_requested_std():
    """Tolerance from the chi-square law: the sample std has relative standard error 1/sqrt(2N)."""
    source = NoiseSource(seed=0)
    values = torch.cat([source.gaussian((1,), 2.5) for _ in range(2000)] + [source.gaussian((40_000,), 2.5)]).double()
    assert values.std().item() == pytest.approx(2.5, rel=5 / math.sqrt(2 * values.numel()))
    assert abs(values.mean().item()) < 5 * 2.5 / math.sqrt(values.numel())


@pytest.mark.parametrize("bit", [32, 40, 64, 100, SECRET_BITS - 1])
def test_seeds_differing_only_above_bit_32_and_64_draw_different_noise(bit):
    """torch's CPU generator ignores seed bits above 32: a searchable 2**32 space. Ours keeps them all."""
    seed = 0x1234_5678
    low = NoiseSource(seed).gaussian((8,), 1.0)
    high = NoiseSource(seed + (1 << bit)).gaussian((8,), 1.0)
    assert not torch.equal(low, high)
    assert torch.equal(low, NoiseSource(seed).gaussian((8,), 1.0))  # a test seed is reproducible


def test_the_default_source_draws_a_fresh_secret_of_at_least_128_bits():
    assert SECRET_BITS >= 128
    secrets = {secret_seed() for _ in range(4)}
    assert len(secrets) == 4 and max(secrets).bit_length() > 128
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no test-seed warning without a seed
        a, b = NoiseSource(), NoiseSource()
    assert not torch.equal(a.gaussian((4,), 1.0), b.gaussian((4,), 1.0))


def test_a_test_seed_warns_loudly():
    with pytest.warns(UserWarning, match="NOT differentially private"):
        NoiseSource(seed=1)


def test_the_noise_source_has_no_checkpointable_state():
    source = NoiseSource()
    assert not hasattr(source, "state_dict") and not hasattr(source, "seed")


def test_noise_lands_on_the_requested_device_and_dtype():
    draw = NoiseSource(0).gaussian((3,), 1.0, device="cpu", dtype=torch.float64)
    assert draw.dtype == torch.float64 and draw.device.type == "cpu"


def test_secret_vector_chunks_are_float64_standard_normal_independent_and_keyed_by_128_bits():
    def chunk(key, index, alpha=1.0, n=50_000):
        return SecretGaussianVector(key).add_scaled_(torch.zeros(n, dtype=torch.float64), alpha, index)

    a = chunk((7, 11), 0)
    other_chunk, high_word = chunk((7, 11), 1), chunk((7, 12), 0)
    assert torch.equal(a, chunk((7, 11), 0))
    assert not torch.equal(a, other_chunk) and not torch.equal(a, high_word)
    assert torch.equal(chunk((7, 11), 1, alpha=-2.0), -2.0 * other_chunk)
    assert (a != a.float().double()).double().mean() > 0.99  # float64 draws, not promoted float32 ones
    tolerance = 5 / math.sqrt(2 * a.numel())
    assert a.std().item() == pytest.approx(1.0, rel=tolerance)
    assert abs(np.corrcoef(a.numpy(), other_chunk.numpy())[0, 1]) < 5 / math.sqrt(a.numel())
    with pytest.raises(ValueError, match="float64"):
        SecretGaussianVector((7, 11)).add_scaled_(torch.zeros(4), 1.0, 0)


def test_vector_keys_are_fresh_per_release():
    source = NoiseSource(seed=5)
    assert not np.array_equal(source.vector_key().key, source.vector_key().key)


def test_a_large_host_draw_is_keyed_by_part_and_does_not_depend_on_the_thread_count():
    """Beyond HOST_PART values the draw is filled part by part (128 fresh bits each) on several threads."""
    from lit_zodp.privacy.noise import HOST_PART

    n = 2 * HOST_PART + 12345
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = NoiseSource(3).gaussian((n,), 1.5)
        torch.set_num_threads(2)
        two = NoiseSource(3).gaussian((n,), 1.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    parts = one.split(HOST_PART)
    assert not torch.equal(parts[0][:1000], parts[1][:1000])  # each part its own stream
    for part in parts:
        assert part.double().std().item() == pytest.approx(1.5, rel=5 / math.sqrt(2 * part.numel()))
    assert abs(one.double().mean().item()) < 5 * 1.5 / math.sqrt(n)
    corr = (parts[0].double() * parts[1].double()).mean().item() / 1.5 ** 2
    assert abs(corr) < 5 / math.sqrt(HOST_PART)


@pytest.mark.parametrize("shape,dtype", [((5,), torch.float32), ((3_000_000,), torch.float32), ((2, 3), torch.float32),
                                         ((4,), torch.float64), ((3, 2), torch.bfloat16), ((), torch.float32),
                                         ((0,), torch.float32), ((64,), torch.float32), ((65,), torch.float64)])
@pytest.mark.parametrize("divisor", [1.0, 64.0, 3.7])
def test_noised_adds_exactly_the_draw_of_the_same_stream(shape, dtype, divisor):
    """``fl((x + std z) / B)`` computed in float64 and rounded once: a float32 normal scaled and added in
    float32 (three roundings) leaves holes whose place depends on ``x`` (audit 3: 13-17% of releases were
    impossible without the target example). The division by the expected batch size is post-processing,
    done before the one rounding."""
    x = torch.linspace(-1, 1, math.prod(shape)).view(shape).to(dtype)
    noised = NoiseSource(9).noised(x, 0.5, divisor=divisor)
    assert noised.dtype == dtype and noised.shape == x.shape
    draw = NoiseSource(9).gaussian(shape, 0.5, dtype=torch.float64)
    assert torch.equal(noised, ((x.double() + draw) / divisor).to(dtype))
    assert torch.equal(x, torch.linspace(-1, 1, math.prod(shape)).view(shape).to(dtype))  # the input is not modified


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_scalar_release_rounds_its_float64_value_once_to_nearest_and_overflows_to_inf(dtype):
    """The scalar path (at most SCALAR_DRAW values) rounds through C's conversion into an ``array.array``: the
    same bits as torch's rounding of the same float64 values, at the extremes of the dtype, signed zeros and the
    smallest normal, and overflow to +-inf (std 1e300 overflows every float32)."""
    from lit_zodp.privacy.noise import SCALAR_DRAW

    finfo = torch.finfo(dtype)
    x = torch.tensor([1.0, -1.0, finfo.max, -finfo.max, finfo.tiny, 0.0, -0.0, 1.0 + finfo.eps], dtype=dtype)
    assert x.numel() <= SCALAR_DRAW
    for std in (1e-3, 1.0, 1e300):
        noised = NoiseSource(5).noised(x, std, divisor=3.0)
        draw = NoiseSource(5).gaussian(x.shape, std, dtype=torch.float64)
        expected = ((x.double() + draw) / 3.0).to(dtype)
        assert noised.dtype == dtype and torch.equal(noised.view(torch.uint8), expected.view(torch.uint8))
    assert torch.isinf(noised).all() == (dtype == torch.float32)  # std 1e300: each float32 value overflows


@pytest.mark.parametrize("numel", [1, 4, 5000, 3_000_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float64_sum_is_released_in_the_asked_dtype_rounded_once_after_the_noise(numel, dtype):
    """A clipped sum formed in float64 (audit 12, F2) is released in the values' dtype: ``fl((x + std z) / B)``
    rounded once, not the sum rounded first (which would move it by more than C before the noise)."""
    x = torch.linspace(-1, 1, numel, dtype=torch.float64) + 1e-9  # values no float32 holds
    noised = NoiseSource(9).noised(x, 0.5, divisor=3.0, dtype=dtype)
    draw = NoiseSource(9).gaussian(x.shape, 0.5, dtype=torch.float64)
    assert noised.dtype == dtype and noised.shape == x.shape
    assert torch.equal(noised, ((x + draw) / 3.0).to(dtype))
    twice = ((x.to(dtype).double() + draw) / 3.0).to(dtype)
    assert numel < 5 or not torch.equal(noised, twice)  # the rounding of the sum first is a different law


@pytest.mark.parametrize("shape", [(1,), (3,), (2, 2), ()])
@pytest.mark.parametrize("x_dtype,dtype", [(torch.float64, torch.float32), (torch.float32, torch.float32),
                                           (torch.float64, torch.float64)])
def test_a_small_release_on_an_accelerator_has_the_bits_of_the_host_release(shape, x_dtype, dtype):
    """DPZero's scalars where the sum lives (a GPU): the host pool's normals, added and divided in float64 there and
    rounded once, as on the host; run here on CPU tensors, the two paths give the same bits."""
    x = (torch.linspace(-1, 1, math.prod(shape)).view(shape) + 1e-9).to(x_dtype)
    host = NoiseSource(4).noised(x, 0.7, divisor=3.0, dtype=dtype)
    there = NoiseSource(4)._scalars_noised_on_device(x, 0.7, 3.0, dtype)
    assert there.dtype == host.dtype == dtype and there.shape == host.shape == x.shape
    assert torch.equal(there.reshape(-1).view(torch.uint8), host.reshape(-1).view(torch.uint8))


class _Divisions(TorchDispatchMode):
    """The divisors of every ``aten.div`` dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.divisors = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.div:
            self.divisors.append(args[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("numel", [1, 3])
def test_a_small_release_off_the_host_divides_by_a_tensor_where_its_sum_lives(numel):
    """CUDA divides by a host scalar as a product with its reciprocal (``div_true_kernel_cuda``: "may lose one bit"),
    which differs from the host's quotient in a third of float64 values: the release divides by ``B`` held as a float64
    tensor on the sum's device (a meta device stands for the accelerator), copied there once per divisor."""
    source = NoiseSource(4)
    for divisor in (3.0, 3.0, 5.0):
        with _Divisions() as seen:
            source.noised(torch.zeros(numel, dtype=torch.float64, device="meta"), 1.0, divisor=divisor,
                          dtype=torch.float32)
        (by,) = seen.divisors
        assert isinstance(by, torch.Tensor) and by.device.type == "meta" and by.dtype == torch.float64
    assert source._device_divisor[0] == (torch.device("meta"), 5.0)


def test_a_small_release_off_the_host_draws_from_the_pool_where_its_sum_lives():
    """Off the CPU (a meta device stands for an accelerator: its values cannot be read, so nothing is copied to the
    host or drawn by a device kernel), a small release takes its values from the pool, in order."""
    source = NoiseSource(4)
    out = source.noised(torch.zeros(3, dtype=torch.float64, device="meta"), 1.0, divisor=2.0, dtype=torch.float32)
    assert out.device.type == "meta" and out.dtype == torch.float32 and out.shape == (3,)
    assert source._pool_next == 3
    source.noised(torch.zeros((), device="meta"), 1.0)
    assert source._pool_next == 4


@pytest.mark.parametrize("std", [-1.0, math.inf, math.nan, "1.0", None])
def test_noised_refuses_a_bad_std(std):
    with pytest.raises(ValueError, match="noise std"):
        NoiseSource(9).noised(torch.zeros(3), std)


@pytest.mark.parametrize("divisor", [0.0, -2.0, math.inf, math.nan, "64"])
def test_noised_refuses_a_bad_divisor(divisor):
    with pytest.raises(ValueError, match="divisor"):
        NoiseSource(9).noised(torch.zeros(3), 1.0, divisor=divisor)


def test_small_draws_come_in_order_from_a_pool_of_the_secret_stream():
    """DPZero's scalars: consecutive small draws are consecutive float64 values of a pool of
    SCALAR_POOL normals, scaled by std; a refill takes a fresh key (nothing repeats across it)."""
    from lit_zodp.privacy.noise import SCALAR_POOL, keystream_normals

    source = NoiseSource(11)
    draws = torch.cat([source.gaussian((3,), 2.0, dtype=torch.float64) for _ in range(SCALAR_POOL // 3 + 5)])
    keys = NoiseSource(11)
    expected = np.concatenate([keystream_normals(keys._fresh_secret(256), SCALAR_POOL) for _ in range(2)])
    # a refill starts a fresh block: the tail of the first block shorter than a draw is skipped
    first = SCALAR_POOL // 3 * 3
    want = np.concatenate([expected[:first], expected[SCALAR_POOL:SCALAR_POOL + 15]]) * 2.0
    assert torch.equal(draws, torch.from_numpy(want))
    assert not np.isin(expected[SCALAR_POOL:], expected[:SCALAR_POOL]).any()
    with pytest.raises(ValueError, match="noise std"):
        source.gaussian((1,), -1.0)


def test_keystream_normals_are_standard_normal_and_shake_256_of_every_key_bit():
    """The scalar pool's law (audit, 2026-11-28: a PCG stream is not cryptographic): moments, tails and a KS test
    against N(0, 1); the values are Box-Muller of SHAKE-256's output, and a key differing in its top bit draws
    unrelated values."""
    import hashlib

    from scipy import stats

    from lit_zodp.privacy.noise import keystream_normals

    z = keystream_normals(12345, 400_001)
    assert z.shape == (400_001,) and z.dtype == np.float64
    assert abs(z.mean()) < 5 / np.sqrt(len(z)) and abs(z.var() - 1) < 5 * np.sqrt(2 / len(z))
    assert abs(np.mean(np.abs(z) > 3) - 2 * stats.norm.sf(3)) < 5 * np.sqrt(2 * stats.norm.sf(3) / len(z))
    assert stats.kstest(z, "norm").pvalue > 1e-3
    words = np.frombuffer(hashlib.shake_256((12345).to_bytes(32, "little")).digest(16), dtype="<u8")
    u1, u2 = ((words >> np.uint64(11)).astype(np.float64) + 1) * 2.0 ** -53
    np.testing.assert_allclose(z[:2], np.sqrt(-2 * np.log(u1)) * np.array([np.cos(2 * np.pi * u2),
                                                                            np.sin(2 * np.pi * u2)]), rtol=1e-15)
    other = keystream_normals(12345 ^ (1 << 255), 1000)
    assert abs(np.corrcoef(z[:1000], other)[0, 1]) < 0.15 and not np.isin(other, z).any()


def test_keys_are_the_same_for_one_secret_and_unrelated_across_secrets_and_draws():
    """Under DDP every rank keys its draws from rank 0's broadcast secret: the same draws on every rank."""
    a, b, c = NoiseSource.from_secret(123), NoiseSource.from_secret(123), NoiseSource.from_secret(124)
    keys = [a._fresh_secret(128) for _ in range(4)]
    assert keys == [b._fresh_secret(128) for _ in range(4)] and len(set(keys)) == 4
    assert not set(keys) & {c._fresh_secret(128) for _ in range(4)}
    assert torch.equal(a.noised(torch.zeros(100), 1.0), b.noised(torch.zeros(100), 1.0))


def test_commit_step_records_the_planned_mechanism_once_per_step():
    from lit_zodp.algorithms import DPZero
    from lit_zodp.algorithms.dpzero import DERIVATIVES
    from lit_zodp.privacy.sampling import PoissonSampling

    module = DPZero(torch.nn.Linear(3, 2), lr=0.1, clip=1.0, noise_multiplier=1.2, delta=1e-5, noise_seed=0)
    privacy = module.privacy
    privacy.plan(step_plan=module.step_plan(), sampling=PoissonSampling(n=100, sample_rate=0.1), planned_steps=10)
    for _ in range(3):
        privacy.release(torch.tensor([1.0]), DERIVATIVES, batch_size=10)
        privacy.commit_step()
    (mechanism, count), = privacy.ledger.counts.items()
    assert count == 3 and mechanism == privacy._steps_cost(1, 1.2)[0][0]
    privacy.end_fit()
    privacy.configured_noise_multiplier = 2.0  # a re-planned sigma is not served from the cache
    privacy.plan(step_plan=module.step_plan(), sampling=PoissonSampling(n=100, sample_rate=0.1), planned_steps=10)
    for _ in range(2):
        privacy.release(torch.tensor([1.0]), DERIVATIVES, batch_size=10)
        privacy.commit_step()
    assert privacy.ledger.counts[privacy._steps_cost(1, 2.0)[0][0]] == 2 and privacy.fit_steps == 2


def test_a_source_keyed_before_a_fork_refuses_to_draw_in_the_child():
    """Audit 6: a forked child held its parent's key, counter, scalar pool and stream, so its draws repeated
    the parent's exactly (pool, stream and device keys). Every way to draw now refuses in the child."""
    import json
    import os

    source = NoiseSource()
    source.noised(torch.zeros(1), 1.0)  # the parent holds a partly used scalar pool
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        refused = []
        for draw in (lambda: source.noised(torch.zeros(1), 1.0), lambda: source.noised(torch.zeros(5000), 1.0),
                     source.device_key, source.vector_key, lambda: source.gaussian((3,), 1.0)):
            try:
                draw()
                refused.append(None)
            except Exception as error:  # noqa: BLE001 (reported to the parent)
                refused.append(type(error).__name__)
        child_source = NoiseSource()  # a source keyed in the child draws
        child_source.noised(torch.zeros(1), 1.0)
        os.write(write, json.dumps(refused).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    assert json.loads(os.read(read, 10_000).decode()) == ["ForkedNoiseError"] * 5
    assert source.noised(torch.zeros(1), 1.0).shape == (1,)  # the parent goes on
