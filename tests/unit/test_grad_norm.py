"""toolkit.optim.grad_norm: the BLAS sum-of-squares path for host-memory gradients against torch's norm."""

import math

import torch

from toolkit.optim.grad_norm import (
    clip_coefficient,
    foreach_sum_of_squares,
    normalize_and_clip,
    sum_of_squares,
    total_norm,
)


def reference(tensors):
    return float(torch.linalg.vector_norm(torch.cat([t.detach().double().reshape(-1) for t in tensors])))


def test_matches_torch_for_mixed_shapes_dtypes_and_strides():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(300, 70, generator=g),
        torch.randn(513, generator=g) * 1e3,
        torch.randn(40, 30, generator=g).t(),  # not contiguous
        torch.randn(64, 8, generator=g).half(),
        torch.randn(33, generator=g).bfloat16(),
        torch.zeros(0),
    ]
    got = float(total_norm(tensors))
    assert math.isclose(got, reference(tensors), rel_tol=1e-5)
    assert float(sum_of_squares(tensors[:1])) == float(torch.dot(tensors[0].reshape(-1), tensors[0].reshape(-1)))


def test_empty_and_non_finite():
    assert float(total_norm([])) == 0.0
    assert math.isinf(float(total_norm([torch.ones(5), torch.tensor([1.0, float("inf")])])))
    assert math.isnan(float(total_norm([torch.tensor([float("nan"), 1.0])])))


def test_fp32_squares_beyond_range_are_not_finite_so_the_trainer_looks_again():
    # 1e20 squared overflows fp32 in torch.dot: the trainer then normalizes first and measures again
    assert not math.isfinite(float(total_norm([torch.full((4,), 1e20)])))


def test_normalizes_and_clips_in_one_pass_and_survives_huge_raw_gradients():
    lin = torch.nn.Linear(4, 3)  # 15 parameters
    grads = [torch.full_like(p, 2.0) for p in lin.parameters()]
    norm, factor = normalize_and_clip(grads, 0.5, 1.0)  # normalized gradients are 1.0: norm sqrt(15), clipped to 1
    assert math.isclose(norm, math.sqrt(15), rel_tol=1e-6) and factor == 1.0
    assert math.isclose(float(total_norm(grads)), 1.0, rel_tol=1e-5)
    grads = [torch.full_like(p, 1e20) for p in lin.parameters()]  # squares overflow fp32; normalized ones are fine
    norm, factor = normalize_and_clip(grads, 1e-20, 0.0)
    assert math.isclose(norm, math.sqrt(15), rel_tol=1e-5) and factor == 1.0
    assert all(torch.allclose(g, torch.ones_like(g)) for g in grads)


def test_the_step_may_apply_the_factor_and_fp16_overflow_is_not_looked_at_again():
    grads = [torch.full((15,), 2.0)]
    norm, factor = normalize_and_clip(grads, 0.5, 1.0, in_place=False)  # for cpu_adam's grad_scale
    assert math.isclose(norm, math.sqrt(15), rel_tol=1e-6)
    assert factor == 0.5 * clip_coefficient(norm, 1.0) and math.isclose(factor * 2 * math.sqrt(15), 1.0, rel_tol=1e-5)
    assert torch.equal(grads[0], torch.full((15,), 2.0))  # untouched
    norm, factor = normalize_and_clip(grads, 0.5, 0.0, in_place=False)  # no --clip-norm: just the normalization
    assert factor == 0.5
    inf = [torch.tensor([1.0, float("inf")])]
    norm, factor = normalize_and_clip(inf, 0.5, 1.0, raw_norm=float("inf"), in_place=False, look_again=False)
    assert math.isinf(norm) and factor == 0.5 and inf[0][0] == 1.0  # the scaler sees the overflow; nothing rescaled


def test_the_second_look_measures_where_the_caller_says():
    """A pipeline stage's own gradients are finite while another stage's overflowed: its second look is the norm over
    every stage (``measure``), so it skips the update with them; huge finite gradients everywhere still train."""
    grads = [torch.full((15,), 2.0)]
    norm, _ = normalize_and_clip(grads, 0.5, 1.0, measure=lambda: float("inf"))
    assert math.isinf(norm)
    grads = [torch.full((15,), 1e20)]  # squares beyond fp32 on this stage, the other stage's norm squared is 1

    def both_stages() -> float:
        return math.sqrt(float(total_norm(grads)) ** 2 + 1.0)

    norm, factor = normalize_and_clip(grads, 1e-20, 0.0, measure=both_stages)
    assert math.isclose(norm, 4.0, rel_tol=1e-5) and factor == 1.0  # sqrt(15 + 1), after the second look


def test_clip_coefficient():
    assert clip_coefficient(4.0, 0.0) == 1.0 and clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(float("inf"), 1.0) == 1.0 and clip_coefficient(float("nan"), 1.0) == 1.0
    assert clip_coefficient(4.0, 1.0) == 1.0 / (4.0 + 1e-6)


def test_large_fp32_tensor_is_accurate():
    g = torch.randn(20_000_000, generator=torch.Generator().manual_seed(1)) * 3 + 0.5
    want = float(g.double().pow(2).sum().sqrt())
    assert abs(float(total_norm([g])) - want) <= 3e-5 * want  # torch.linalg.vector_norm: 1.4e-3 on CPU


def test_foreach_sum_of_squares_for_device_gradients():
    """The path for DTensor gradients on a GPU (no host sync per tensor), checked on CPU tensors."""
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(50, 7, generator=g), torch.randn(9, generator=g).half(), torch.zeros(0)]
    assert math.isclose(float(foreach_sum_of_squares(tensors)) ** 0.5, reference(tensors), rel_tol=1e-5)
    assert float(foreach_sum_of_squares([torch.zeros(0)])) == 0.0
