"""GPU checks (marked `gpu`, skipped without CUDA): every module runs a step on CUDA, the secret
noise lands on the device (small draws and releases: the host law; vectors: the device kernel's law), and the
benchmark's CUDA path runs.

Run them on a GPU machine with `python -m pytest -m gpu tests/test_gpu.py`.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_zodp.algorithms import ALGORITHMS
from lit_zodp.errors import PrivacyConfigError
from lit_zodp.privacy import NoiseSource, SecretGaussianVector
from tests.conftest import (ALGORITHM_KWARGS, TokenBag, blobs, mlp, poisson_loader, quiet_trainer, token_loader,
                            with_public_data)

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:`(noise|sampling)_seed` is set")]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_module_takes_steps_on_cuda(name, precision):
    cls = ALGORITHMS[name]
    kwargs = dict(lr=0.05, seed=3) | (dict(clip=1.0, noise_multiplier=1.0, delta=1e-5) if cls.private else {})
    module = with_public_data(cls(mlp(seed=1), **kwargs, **ALGORITHM_KWARGS.get(name, {})))
    before = torch.cat([p.detach().flatten() for p in module.backbone.parameters()]).clone()
    trainer = quiet_trainer(max_steps=3, accelerator="gpu", devices=1, precision=precision)
    trainer.fit(module, poisson_loader(blobs(), 0.25))
    after = torch.cat([p.detach().flatten().cpu() for p in module.backbone.parameters()])
    assert trainer.global_step == module.privacy.steps == 3
    assert torch.isfinite(after).all() and not torch.equal(after, before)


def test_16_mixed_is_refused_on_cuda_before_a_step():
    """Its GradScaler failed every module with "Attempted unscale_ but _scale is None"."""
    from lit_zodp.errors import ConfigError

    module = ALGORITHMS["DPSGD"](mlp(seed=1), lr=0.05, clip=1.0, noise_multiplier=1.0, delta=1e-5)
    with pytest.raises(ConfigError, match="bf16-mixed"):
        quiet_trainer(max_steps=1, accelerator="gpu", devices=1, precision="16-mixed").fit(
            module, poisson_loader(blobs(), 0.25))


def test_noise_and_secret_vectors_on_cuda_follow_the_cpu_law():
    on_gpu = NoiseSource(3).gaussian((4,), 2.0, device="cuda")
    assert on_gpu.device.type == "cuda"
    torch.testing.assert_close(on_gpu.cpu(), NoiseSource(3).gaussian((4,), 2.0))
    # a d-dimensional secret vector is drawn on the device by the 128-bit-keyed Philox kernel
    # (lit_zodp.privacy.device_noise); on CPU by NumPy's Philox-4x64: same key, different laws
    from lit_zodp.privacy.device_noise import SecretKey, reference_normals

    vector = SecretGaussianVector((5, 6))
    gpu_chunk = vector.add_scaled_(torch.zeros(1000, device="cuda", dtype=torch.float64), -1.5, 2)
    expected = -1.5 * reference_normals(1000, SecretKey.from_words64((5, 6)), pair_base=2 << 40)
    assert gpu_chunk.dtype == torch.float64
    torch.testing.assert_close(gpu_chunk.cpu(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("numel", [1, 3, 16])
def test_a_small_release_on_cuda_has_the_bits_of_the_host_release_and_never_waits(numel, dtype):
    """DPZero's k-vector of clipped sums (float64) on the device: the host pool's normals, added there in float64,
    divided by B held on the device (CUDA multiplies by the reciprocal of a host scalar: other bits in a third of
    float64 quotients) and rounded once: the host release's bits, with no synchronisation (one value is a kernel
    argument, several a copy from pinned memory)."""
    x = torch.linspace(-1, 1, numel, dtype=torch.float64) + 1e-9
    host = NoiseSource(4).noised(x, 0.7, divisor=3.0, dtype=dtype)
    source, on_device = NoiseSource(4), x.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        there = source.noised(on_device, 0.7, divisor=3.0, dtype=dtype)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert there.device.type == "cuda" and torch.equal(there.cpu().view(torch.uint8), host.view(torch.uint8))


@pytest.mark.slow
def test_the_benchmark_cuda_path_runs(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dpzero.py"
    result = subprocess.run([sys.executable, str(script), "--quick", "--device", "cuda", "--models", "vit_tiny",
                             "--no-opacus", "--out", str(tmp_path / "bench")],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "vit_tiny" in (tmp_path / "bench.md").read_text()


def never_waiting(base, steps):
    """``base`` whose training steps numbered in ``steps`` run under CUDA's sync debug mode ``error``."""

    class NeverWaiting(base):
        abstract = True

        def training_step(self, batch, batch_idx):
            if self.global_step not in steps:
                return super().training_step(batch, batch_idx)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return super().training_step(batch, batch_idx)
            finally:
                torch.cuda.set_sync_debug_mode("default")

    return NeverWaiting


@pytest.mark.parametrize("name", ["DPZero", "MeZO", "MeZOBCD", "DPMeZOBCD"])
def test_a_zeroth_order_step_on_cuda_never_waits_for_the_device(name):
    """Issue 8: no host synchronisation inside a step (coefficients stay on the device, the engine's
    tables are copied from pinned memory, the scalar noise is a kernel argument): CUDA's sync debug mode
    raises on any synchronising call. The first step compiles the kernels and is not checked; no
    step writes logs (log_every_n_steps 1000). The independence re-checks are off: a step the OS draws for one
    (probability 1%) compares losses on the host by design (an H200 run drew one for DPMeZOBCD)."""
    base = ALGORITHMS[name]
    private = dict(clip=1.0, noise_multiplier=1.0, delta=1e-5, recheck_probability=0.0)
    kwargs = dict(lr=0.05, seed=3) | (private if base.private else {})
    module = never_waiting(base, steps=range(1, 4))(mlp(seed=1), **kwargs)
    trainer = quiet_trainer(max_steps=4, accelerator="gpu", devices=1, log_every_n_steps=1000)
    trainer.fit(module, poisson_loader(blobs(), 0.25))
    assert trainer.global_step == 4
    engine = getattr(module.engine, "engine", module.engine)  # MeZO-BCD: the active block's engine
    assert type(engine).__name__ == "FusedPerturbation"




@pytest.mark.parametrize("name", ["DPZero", "DPMeZOBCD"])
def test_while_the_padding_check_waits_a_zeroth_order_step_on_text_never_waits_for_the_device(name):
    """Batches of full-length rows cannot resolve the padding check, which waits for one with a shorter row:
    whether a batch has one is read on the host before the transfer (before 2026-11-28 the step asked the device,
    twice per DPZero step, on every step of full-length text). The first padded batch is checked on the device,
    and a model reading padding is refused there, after the full-length steps."""
    full, kwargs = 4, dict(lr=0.05, seed=3, clip=1.0, noise_multiplier=1.0, delta=1e-5, recheck_probability=0.0)
    module = never_waiting(ALGORITHMS[name], steps=range(1, full))(TokenBag(masked=True), num_classes=2, **kwargs)
    trainer = quiet_trainer(max_steps=full + 2, accelerator="gpu", devices=1, log_every_n_steps=1000)
    trainer.fit(module, token_loader(full_length_batches=full))
    assert trainer.global_step == full + 2 and "padding" not in module._pending_checks
    leaky = ALGORITHMS[name](TokenBag(masked=False), num_classes=2, **kwargs)
    with pytest.raises(PrivacyConfigError, match="change with the padding of their batch"):
        trainer = quiet_trainer(max_steps=full + 2, accelerator="gpu", devices=1)
        trainer.fit(leaky, token_loader(full_length_batches=full))
    assert leaky.privacy.ledger.total_count == full

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fixed_forward_rows_make_an_examples_loss_independent_of_its_batch_mates_on_cuda(dtype):
    """On CUDA the kernels pick their reduction order by shape (lit_zodp.privacy.fixed_shape): with
    rows of one length in chunks of 8, example 0's loss is bitwise the same in batches of 1..40 random
    mates at random positions. Without chunks it may move; the spread is printed."""
    from tests.privacy.test_fixed_shape import example_zero_in_random_batches

    hidden = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
    spread = {rows: example_zero_in_random_batches(rows, dtype, "cuda", hidden) for rows in (None, 8)}
    print(f"{dtype}: (distinct values, spread) of example 0's loss by fixed_forward_rows: {spread}")
    assert spread[8][0] == 1


@pytest.fixture
def tf32_matmuls():
    """TF32 float32 matmuls through the legacy flag (the new API would leave the process in the mixed
    state that makes ``torch.get_float32_matmul_precision()`` raise for later tests)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("mode,positions", [("hooks", 1), ("hooks", 3), ("bookkeeping", 1), ("bookkeeping", 2),
                                            ("ghost", 1), ("ghost", 2)])
def test_with_tf32_matmuls_a_share_stays_within_the_clip_on_cuda(tf32_matmuls, mode, positions):
    """The real TF32 conversion of tests/per_example/test_pe_rounding.py's record (entries just above
    half a TF32 step): within C, where an unguarded hooks sum gave ~(1 + 2^-11) C under emulation."""
    from lit_zodp.per_example import PerExampleGradientEngine
    from tests.per_example.test_pe_rounding import ROUNDS_UP

    model = torch.nn.Linear(64, 1, bias=False).float().cuda()
    x = torch.full((1, positions, 64), ROUNDS_UP, dtype=torch.float32, device="cuda")
    engine = PerExampleGradientEngine(model, mode=mode)
    loss = lambda: model(x).sum((1, 2))  # noqa: E731
    clip = float(engine.clipped_sum(loss, float("inf")).norms[0]) / 16
    released = torch.cat([g.double().flatten() for g in engine.clipped_sum(loss, clip).grads]).norm()
    assert float(released) / clip <= 1 + 1e-6


@pytest.mark.parametrize("mode,calls,positions", [("ghost", 2, 2), ("bookkeeping", 2, 2), ("ghost", 8, 2),
                                                  ("bookkeeping", 8, 2), ("bookkeeping", 1, 32)])
def test_with_tf32_matmuls_a_subnormal_operand_record_stays_within_the_clip_on_cuda(tf32_matmuls, mode, calls,
                                                                                     positions):
    """Red-team review 63's record (``v = -2^127`` on ``x = 2^-127``, cancelling another position) on the
    card's TF32 matmuls: within C whether or not the tensor cores flush the subnormal operand (on the CPU's
    bf16 AMX path it released 30.9 C before the float64 fallback)."""
    from tests.per_example.test_pe_multi_call_crafted import _share

    assert _share(mode, calls, positions=positions, device="cuda") <= 1.0


@pytest.mark.parametrize("mode", ["hooks", "bookkeeping", "ghost"])
def test_with_tf32_matmuls_the_engine_keeps_its_fast_path_and_its_sums_on_cuda(tf32_matmuls, mode):
    """The coverage and alignment checks' tolerances include TF32's product error (2^-9): a
    transformer layer at T = 64 takes the same paths as with IEEE float32 (no layer sent to the
    slow path), and its sums stay near IEEE float32's."""
    from lit_zodp.per_example import PerExampleGradientEngine

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).float().cuda()
    x = torch.randn(16, 64, 64, device="cuda", dtype=torch.float32)
    target = torch.randn(16, 64, 64, device="cuda", dtype=torch.float32)
    loss = lambda: (layer(x) - target).pow(2).mean((1, 2))  # noqa: E731
    torch.backends.cuda.matmul.allow_tf32 = False
    exact_engine = PerExampleGradientEngine(layer, mode=mode)
    exact = exact_engine.clipped_sum(loss, 0.1)
    torch.backends.cuda.matmul.allow_tf32 = True
    engine = PerExampleGradientEngine(layer, mode=mode)
    fast = engine.clipped_sum(loss, 0.1)
    assert engine.last_recomputed == exact_engine.last_recomputed
    for a, b in zip(fast.grads, exact.grads):
        assert float((a - b).norm()) <= 0.05 * float(b.norm()) + 1e-6


def test_leading_padding_is_rotated_on_cuda_as_on_the_cpu():
    """On CUDA the rotation always runs (no host synchronisation); it equals the CPU's."""
    from lit_zodp.backbones.huggingface import right_padded

    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 0, 1, 0]])
    batch = {"input_ids": torch.arange(12).view(3, 4), "attention_mask": mask}
    on_cuda = right_padded({k: v.cuda() for k, v in batch.items()})
    for key, value in right_padded(batch).items():
        assert torch.equal(on_cuda[key].cpu(), value)
    right = {k: v[1:] for k, v in batch.items()}
    assert all(torch.equal(v.cpu(), right[k]) for k, v in right_padded({k: v.cuda() for k, v in right.items()}).items())


@pytest.mark.parametrize("name", sorted(name for name, cls in ALGORITHMS.items() if cls.private))
def test_the_weights_show_one_row_on_cuda_exactly_as_much_as_accounted(name):
    """The contract's empirical audit on the GPU: the fused engine and the release summed on the device (the host's
    keystream noise added there) must show the canary exactly as the ledger accounts, mu and spread."""
    from tests.test_privacy_contract import AUDIT_KWARGS, AUDITED_ELSEWHERE, audit_agrees

    if name in AUDITED_ELSEWHERE:
        pytest.skip(f"{name}'s weights show only which candidate won: its release is audited in tests/algorithms")
    agrees, numbers = audit_agrees(name, dict(accelerator="gpu", devices=1), **AUDIT_KWARGS.get(name, {}))
    assert agrees, numbers



def test_o2nc_alg3_steps_on_cuda_and_the_tree_redraws_each_node_on_the_device():
    """DPO2NC's single-pass oracle (Alg. 3) on CUDA, the tree's node noise drawn there: three steps move the point, and
    two trees keyed by one secret (DDP ranks) release the same noise with popcount(p) node variances."""
    import math

    from datamodules import QuadraticDataModule
    from lit_zodp.algorithms import DPO2NC
    from lit_zodp.backbones.quadratic import QuadraticLoss
    from lit_zodp.privacy import TreeAggregator

    module = DPO2NC(QuadraticLoss(6, hessian="identity"), lr=0.1, lam=0.05, radius=0.01, window=2, period=4,
                    num_directions=2, seed=0, clip=1.0, noise_multiplier=1.0)
    data = QuadraticDataModule(dim=6, n_train=80, n_test=8, sampling="single_pass", batch_size=5)
    trainer = quiet_trainer(max_steps=3, accelerator="gpu", devices=1, limit_val_batches=0)
    trainer.fit(module, data)
    assert trainer.global_step == module.privacy.steps == 3 and module.tree.position == 3
    assert torch.isfinite(module._state["delta"]).all() and float(module._state["delta"].norm()) > 0
    secret, releases = 12345, []
    for _ in range(2):
        tree, source = TreeAggregator(8), NoiseSource.from_secret(secret)
        releases.append([tree.push(torch.zeros(200_000, device="cuda"), 1.0, source) for _ in range(8)])
    for p, (a, b) in enumerate(zip(*releases), start=1):
        assert a.is_cuda and torch.equal(a, b)
        assert float(a.std()) == pytest.approx(math.sqrt(bin(p).count("1")), rel=0.02)


@pytest.mark.parametrize("mode", ["hooks", "ghost", "bookkeeping"])
def test_a_models_own_cuda_generator_is_checked_in_training_and_its_stream_is_left_alone(mode):
    """Stop 62: every explicit generator's draws at their mean in a recomputation, from a fresh secret CUDA state
    (``secret_cuda_state``) on CUDA, as the CPU test ``test_pe_checks_own_draws`` checks on the CPU."""
    from tests.per_example.test_pe_checks_own_draws import own_generator_checks

    own_generator_checks(mode, "cuda")
