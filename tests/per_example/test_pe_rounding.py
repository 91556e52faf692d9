"""The engine's own rounding: reduced-precision float32 matmuls (TF32) and autocast. (This
directory's tests default to float64; these build float32 models on purpose.)

TF32 cannot run on this CPU, so a matmul that converts its operands as CUDA does (to a 10-bit
mantissa, round to nearest) is emulated; ``test_gpu.py`` runs the real one.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lit_zodp.per_example import PerExampleGradientEngine
from lit_zodp.per_example import ghost, rounding
from lit_zodp.per_example.rounding import IEEE_FLOAT32, TF32, MatmulRounding
from tests.per_example.test_pe_precision import _sensitivity, _similar_examples

ROUNDING_PY = Path(rounding.__file__)


# ------------------------------------------------------------------------------- the settings

_READ_SETTINGS = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("rounding", sys.argv[1])
rounding = importlib.util.module_from_spec(spec); spec.loader.exec_module(rounding)
b = torch.backends
exec(sys.argv[2])
read = getattr(rounding, sys.argv[3])
print(read("cuda"), read("cpu"))
"""


def assert_read_in_fresh_interpreters(reader: str, settings: dict) -> None:
    """Each setting in a fresh interpreter (run side by side): mixing the legacy and new APIs is sticky."""
    runs = {setting: subprocess.Popen([sys.executable, "-c", _READ_SETTINGS, str(ROUNDING_PY), setting, reader],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for setting in settings}
    for setting, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-2000:]
        assert out.split() == settings[setting].split(), setting


SETTINGS = {
    "pass": "ieee ieee",
    "b.cuda.matmul.allow_tf32 = True": "tf32 ieee",                               # the legacy flag
    "torch.set_float32_matmul_precision('high')": "tf32 tf32",
    "torch.set_float32_matmul_precision('medium')": "tf32 bf16",                 # oneDNN: bfloat16 operands
    "b.cuda.matmul.fp32_precision = 'tf32'": "tf32 ieee",                       # get_float32_matmul_precision raises
    "b.fp32_precision = 'tf32'": "tf32 tf32",                                   # inherited by each backend
    "b.cuda.matmul.allow_tf32 = True; b.cuda.matmul.fp32_precision = 'ieee'": "ieee ieee",  # mixed APIs
}


def test_the_float32_matmul_setting_is_read_from_either_api():
    """Mixing the legacy and new APIs makes ``torch.get_float32_matmul_precision()`` raise (the engine read it
    before, and would have raised)."""
    assert_read_in_fresh_interpreters("float32_matmul_setting", SETTINGS)


CONV_SETTINGS = {
    "pass": "tf32 ieee",                                                       # torch's default: cuDNN TF32
    "b.cudnn.allow_tf32 = False": "ieee ieee",                                 # the legacy flag
    "b.cudnn.conv.fp32_precision = 'ieee'": "ieee ieee",
    "b.cudnn.allow_tf32 = False; b.cudnn.conv.fp32_precision = 'tf32'": "tf32 ieee",  # mixed APIs
    "b.cudnn.fp32_precision = 'ieee'": "ieee ieee",                            # inherited by conv
}


def test_the_cudnn_convolution_setting_is_read_from_either_api():
    """cuDNN's float32 convolutions (TF32 by default): the CPU has none, so its setting is always "ieee"."""
    assert_read_in_fresh_interpreters("float32_conv_setting", CONV_SETTINGS)


def test_checks_allow_tf32_convolutions_only_in_a_model_with_convolutions(monkeypatch):
    """``working_eps`` (the checks' tolerances, not the bounds): TF32's product error where cuDNN convolutions run in
    TF32 and the compared results went through a model with convolutions; float32's elsewhere; float64 untouched."""
    monkeypatch.setattr(rounding, "float32_conv_setting", lambda device_type: "tf32")
    ieee = torch.finfo(torch.float32).eps
    assert rounding.working_eps("cuda", torch.float32) == ieee
    with rounding.model_convolutions(True):
        assert rounding.working_eps("cuda", torch.float32) == TF32.product
        assert rounding.working_eps("cuda", torch.float64) == torch.finfo(torch.float64).eps
        assert rounding.sum_rounding(torch.float32, "cuda") == rounding.IEEE_FLOAT32  # (the engine's own sums)
        with rounding.model_convolutions(False):
            assert rounding.working_eps("cuda", torch.float32) == ieee
    assert rounding.has_convolutions(nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Conv1d(1, 1, 1))))
    assert not rounding.has_convolutions(nn.Sequential(nn.Linear(2, 2)))


def test_sum_rounding_of_float64_rows_ignores_the_float32_setting(monkeypatch):
    monkeypatch.setattr(rounding, "float32_matmul_setting", lambda device_type: "tf32")
    assert rounding.sum_rounding(torch.float64, "cpu") == rounding.FLOAT64
    assert rounding.sum_rounding(torch.bfloat16, "cpu") == rounding.sum_rounding(torch.float32, "cpu") == TF32
    assert rounding.working_eps("cpu", torch.float32) == TF32.product  # 2^-9: TF32 products, not 2^-23


# --------------------------------------------------------------------- an emulated TF32 matmul

def _tf32(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to a 10-bit mantissa, to nearest (ties to even), as CUDA converts TF32 operands."""
    if x.dtype != torch.float32:
        return x
    bits = x.contiguous().view(torch.int32)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32)


@pytest.fixture
def emulated_tf32(monkeypatch):
    """float32 matmuls (``@``, ``tensordot``) with TF32 operands, and the setting saying so."""
    matmul, tensordot = torch.Tensor.__matmul__, torch.tensordot
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: matmul(_tf32(a), _tf32(b)))
    monkeypatch.setattr(torch, "tensordot", lambda a, b, **kw: tensordot(_tf32(a), _tf32(b), **kw))
    monkeypatch.setattr(rounding, "float32_matmul_setting", lambda device_type: "tf32")


#: ``1 + 2^-11 + 2^-20``: just above half a TF32 step over 1, so it rounds UP to ``1 + 2^-10``.
ROUNDS_UP = 1.0 + 2.0 ** -11 + 2.0 ** -20


def _released_over_clip(mode: str, positions: int) -> float:
    """One record of ``positions`` rows whose entries all round up in TF32 (a share grows by
    ~2^-11); the clip set so its factor is exactly 1/16 (no rounding of the factor to help)."""
    model = nn.Linear(64, 1, bias=False).float()
    x = torch.full((1, positions, 64), ROUNDS_UP, dtype=torch.float32)
    engine = PerExampleGradientEngine(model, mode=mode)

    def loss():
        return model(x).sum((1, 2))  # g = 1 at every position: G = sum_t x_t

    norm = float(engine.clipped_sum(loss, float("inf")).norms[0])
    clip = norm / 16
    released = engine.clipped_sum(loss, clip)
    return float(torch.cat([g.double().flatten() for g in released.grads]).norm()) / clip


def test_tf32_operands_would_grow_a_share_past_the_clip_without_the_bound(emulated_tf32, monkeypatch):
    """The emulation bites: with the bound told the matmul is IEEE, the share is ~(1 + 2^-11) C. ("hooks" sums its
    materialised rows in float64 since review 55, converting no operand to TF32: within the clip either way.)"""
    monkeypatch.setattr(rounding, "float32_matmul_setting", lambda device_type: "ieee")
    for mode, positions in [("bookkeeping", 1), ("bookkeeping", 2)]:
        assert _released_over_clip(mode, positions) > 1 + 4e-4
    assert _released_over_clip("hooks", 1) <= 1 + 1e-6


@pytest.mark.parametrize("mode,positions", [("hooks", 1), ("hooks", 3), ("bookkeeping", 1), ("bookkeeping", 2),
                                            ("ghost", 1), ("ghost", 2)])
def test_a_share_with_tf32_operands_stays_within_the_clip(emulated_tf32, mode, positions):
    """"hooks": its sums are accumulated in float64, no operand converted (review 55; before, its factors were
    divided by ``1 + 2^-9``); "bookkeeping"/"ghost": the guarded norm adds ``2^-9 S_i``
    (:func:`.ghost.guarded_norm_sq`), or is multiplied by ``1 + 2^-9`` at one position (``||a|| ||g||``, no Gram
    matrix)."""
    assert _released_over_clip(mode, positions) <= 1 + 1e-6


def test_the_tf32_guard_costs_ordinary_rows_about_2_to_the_minus_9_sqrt_t():
    """Was (T + 2) 2^-11 S_i, 0.7 of the norm at T = 128; now 2^-9 S_i + (T + 2) 2^-23 S_i: 0.02."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 128, 32, generator=g, dtype=torch.float64)
    grad = torch.randn(8, 128, 48, generator=g, dtype=torch.float64)
    exact = torch.einsum("bto,bti->boi", grad, a).flatten(1).norm(dim=1)
    gram = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(grad, grad.transpose(1, 2))).sum((1, 2))
    scale = (a.norm(dim=-1) * grad.norm(dim=-1)).sum(1)
    for matmul, (low, high) in [(IEEE_FLOAT32, (1.0, 1 + 1e-4)), (TF32, (1.005, 1.03))]:
        ratio = ghost.guarded_norm_sq(gram, scale, 80, 128, matmul).sqrt() / exact
        assert low <= float(ratio.min()) and float(ratio.max()) < high


def test_guard_terms_add_up_as_documented():
    rows = MatmulRounding(inputs=0.25, accumulation=0.125)
    bound = ghost.guarded_norm_sq(torch.tensor([0.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64),
                                  1, 2, rows).sqrt()
    assert float(bound) == pytest.approx(2 * 0.25 + 0.25 ** 2 + 4 * 0.125 + (2 * 5 * 2.0 ** -53) ** 0.5)


# ------------------------------------------------------------------------------------ autocast

class _WithRecomputed(nn.Module):
    """Two Linear layers (rules) and an elementwise scale no rule covers (the vmap fallback)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 4)
        self.scale = _Scale(32)

    def forward(self, x):
        return self.second(self.scale(torch.tanh(self.first(x))))


class _Scale(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.weight


def _autocast_sensitivity(mode: str, batch: int) -> float:
    """``max_j ||S - S_{-j}|| / C`` of float32 weights under a bfloat16 autocast, with nearly equal,
    all clipped examples (``||S|| ~ B C``: the worst case for rounding the sum)."""
    torch.manual_seed(0)
    model = _WithRecomputed().float()
    x, y = _similar_examples(batch, torch.float32)
    engine = PerExampleGradientEngine(model, mode=mode)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        worst = _sensitivity(engine, model, x, y, removed=range(0, batch, batch // 4))
    assert engine.last_recomputed == {"scale.weight": "scale"}
    return worst


@pytest.mark.parametrize("mode", ["hooks", "bookkeeping", "ghost"])
def test_sums_under_a_bfloat16_autocast_stay_at_the_clip(mode):
    """Lightning's ``precision="bf16-mixed"`` runs the step under autocast, which ran the engine's
    float32 sums in bfloat16: 1.08-1.10 C at B = 128 and 1.95-2.05 C at B = 1024 in every mode
    ("ghost": 1.0022 C at B = 256 from its bfloat16 second backward until its rows were held to
    their first-pass norms)."""
    assert _autocast_sensitivity(mode, 256) <= 1 + 1e-4


def test_the_autocast_is_back_after_the_engine_and_the_forward_ran_under_it():
    model = nn.Linear(4, 2).float()
    engine = PerExampleGradientEngine(model)
    seen = []

    def loss():
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return model(torch.randn(3, 4, dtype=torch.float32)).float().sum(1)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.clipped_sum(loss, 1.0)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    engine.clipped_sum(loss, 1.0)
    assert seen == [torch.bfloat16, None]
