"""ProjectedAdam (DP-GRAPE Alg. 2) across a checkpoint: its float32 state survives ``load_state_dict``."""

import pytest
import torch

from lit_zodp.per_example.transforms import Projection
from lit_zodp.projection import ProjectedAdam, gaussian_projection


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_resumed_projected_adam_keeps_float32_moments_and_steps_as_the_uninterrupted_one(dtype):
    """torch's ``Optimizer.load_state_dict`` casts every floating state tensor to its parameter's dtype; the moments
    (and DP-GaLore's projector) are float32 by design, so a resume on a bf16/fp16 model must not round them."""
    torch.manual_seed(0)
    weight, bias = (torch.nn.Parameter(torch.randn(*s).to(dtype)) for s in ((6, 10), (6,)))
    projection = Projection(gaussian_projection(7, 6, 2), "left")
    grads = [(torch.randn(6, 10), torch.randn(6)) for _ in range(4)]

    def run(optimizer, params, steps):
        for g_w, g_b in steps:
            optimizer.hand([projection.of_gradients(g_w), g_b], [projection, None])
            optimizer.step()

    straight = [torch.nn.Parameter(p.detach().clone()) for p in (weight, bias)]
    run(ProjectedAdam(straight, lr=1e-2), straight, grads)

    first = ProjectedAdam([weight, bias], lr=1e-2)
    run(first, [weight, bias], grads[:2])
    first.state[weight]["projector"] = projection.matrix.clone()  # as DPGaLore keeps it
    resumed = ProjectedAdam([weight, bias], lr=1e-2)
    resumed.load_state_dict(first.state_dict())
    for param in (weight, bias):
        assert resumed.state[param]["exp_avg"].dtype == resumed.state[param]["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(resumed.state[param]["exp_avg"], first.state[param]["exp_avg"])
    assert torch.equal(resumed.state[weight]["projector"], projection.matrix)
    run(resumed, [weight, bias], grads[2:])
    assert torch.equal(weight, straight[0]) and torch.equal(bias, straight[1])
