"""The fused 8-bit Adam kernel (toolkit/optim/fused_8bit.py, csrc/adam_8bit.cpp) against the eager codec.

Reference: the eager path of ``quantized_states.ReducedMoments`` (``moments.fused = None``),
the same DeepSpeed update on fp32 copies of the decoded moments. The kernel must give the
same bits: parameters, codes and scales compared with ``torch.equal`` after several steps, on
gradients with zeros, denormals and values near fp32's square-root limit, with fp32 and bf16
gradients, a folded gradient scale, and slice sizes that give DeepSpeed's op a scalar tail.
The eager codec's own changes (tables instead of torch's log2/exp2, a correctly rounded sqrt)
are checked against the formulas they replace, with the tolerances its docstrings state.
"""

import logging
import math

import pytest
import torch

from tests.helpers.optim import new_params
from toolkit.optim import build_optimizer, fused_8bit
from toolkit.optim import quantized_states as qs
from toolkit.optim.deepspeed_op import cxx_compiler

ADAM = dict(
    optimizer="cpu_adam",
    lr=1e-2,
    adam_betas="(0.9, 0.98)",
    adam_eps=1e-6,
    weight_decay=0.1,
    adam_state_precision="8bit",
)
# whole blocks; padded blocks; rows of 4099 (one-row slices of 4099 values: a 3-value scalar tail);
# 3 values per row (blocks shorter than a SIMD span); 1-D (fp32 moments)
SHAPES = [(64, 300), (8, 5000), (13, 4099), (4096, 3), (40, 2048), (300,)]

needs_compiler = pytest.mark.skipif(cxx_compiler() is None, reason="no C++ compiler: the kernel cannot be built")


def hard_gradients(steps, seed=0):
    """Gradients with exact zeros, denormals, values of 1e15 (squares near 1e30) and a wide spread of scales."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = []
    for _ in range(steps):
        step = []
        for s in SHAPES:
            x = torch.randn(s, generator=g) * torch.rand(s, generator=g).pow(4)
            flat = x.view(-1)
            flat[::17] = 0.0
            flat[5::97] *= 1e15
            flat[7::101] = 1e-40
            flat[11::89] = -1e-45
            step.append(x)
        if len(grads) == 2:
            step[0][3].zero_()  # a whole block without gradient: codes 0, scales 0
        grads.append(step)
    return init, grads


def run(fused: bool, grads, init, grad_dtype=torch.float32, grad_scale=1.0, chunk=None):
    """The parameters and every state tensor after stepping through ``grads``."""
    ps = new_params(init)
    opt = build_optimizer(ADAM, ps)
    if not fused:
        opt.moments.fused = None
    if chunk:
        opt.moments.chunk_elements = chunk
    for step_grads in grads:
        for p, gr in zip(ps, step_grads):
            p.grad_dtype = None  # a bf16 gradient on an fp32 parameter, as --bf16-host-grads
            p.grad = gr.clone().to(grad_dtype)
        opt.step(grad_scale=grad_scale)
        opt.zero_grad(set_to_none=True)
    return [(i, k, t) for i, p in enumerate(ps) for k, t in [("param", p.detach())] + list(opt.state[p].items())]


@needs_compiler
@pytest.mark.parametrize(
    "grad_dtype,grad_scale,chunk",
    [
        (torch.float32, 1.0, None),
        (torch.float32, 0.37125, 700),
        (torch.bfloat16, 0.37125, None),
        (torch.bfloat16, 1.0, 3 * 4099),
    ],
)
def test_fused_step_is_the_eager_step_bit_for_bit(grad_dtype, grad_scale, chunk):
    assert fused_8bit.fused_op() is not None
    init, grads = hard_gradients(5)
    eager = run(False, grads, init, grad_dtype, grad_scale, chunk)
    fused = run(True, grads, init, grad_dtype, grad_scale, chunk)
    differ = [(i, k) for (i, k, a), (_, _, b) in zip(eager, fused) if a.dtype != b.dtype or not torch.equal(a, b)]
    assert differ == []
    codes = [t for i, k, t in fused if k == "exp_avg_sq"]
    assert all(bool((c == 0).any()) and bool((c == 255).any()) for c in codes[:2])  # zeros and block maxima seen


@needs_compiler
def test_fused_step_with_fused_disabled_never_calls_the_kernel(monkeypatch):
    """The reference above really is the eager path: with ``fused = None`` the kernel is never reached."""
    monkeypatch.setattr(fused_8bit, "update", lambda *a: (_ for _ in ()).throw(AssertionError("kernel called")))
    init, grads = hard_gradients(1)
    run(False, grads, init)


@needs_compiler
def test_fused_encoder_matches_the_eager_one_around_every_threshold():
    op = fused_8bit.fused_op()
    bits = qs.SQ_THRESHOLD[2:].view(torch.int32).unsqueeze(1) + torch.arange(-64, 65, dtype=torch.int32)
    ratios = torch.cat([bits.reshape(-1).view(torch.float32), torch.tensor([1e-45, 1e-38, 1e-30, 0.5, 1.0])])
    random = torch.rand(100_000, generator=torch.Generator().manual_seed(0)).pow(12)
    ratios = torch.cat([ratios, random[random > 0]])  # sq_codes gives 0 at 0 (v == 0), sq_code is for v > 0
    assert torch.equal(op.sq_codes(ratios, qs.SQ_RATIO, qs.SQ_THRESHOLD).int(), qs.sq_code(ratios))
    assert op.sq_codes(torch.zeros(3), qs.SQ_RATIO, qs.SQ_THRESHOLD).tolist() == [0, 0, 0]


def test_fallback_without_the_kernel_warns_once_and_steps_as_the_eager_path(monkeypatch, caplog):
    def no_compiler():
        raise RuntimeError("command 'c++' failed: No such file or directory")

    monkeypatch.setattr(fused_8bit, "_state", {})
    monkeypatch.setattr(fused_8bit, "_build", no_compiler)
    init, grads = hard_gradients(2)
    with caplog.at_level(logging.WARNING, logger=fused_8bit.__name__):
        fallback = run(True, grads, init)
        run(True, grads, init)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "fused 8-bit Adam kernel could not be built" in warnings[0]
    assert "No such file or directory" in warnings[0] and "\n" not in warnings[0]
    eager = run(False, grads, init)
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(eager, fallback))


# --------------------------------------------------------------------------- the eager codec's tables


def test_tables_are_the_log_code_of_the_docstring_within_rounding():
    """Against the formulas they replace: codes differ only next to a boundary (by one), ratios by < 2e-6."""
    k = torch.arange(1, 256, dtype=torch.float64)
    exact = torch.exp2((k - 255) * qs.SQ_OCTAVES / 127)
    assert ((qs.SQ_RATIO[1:].double() - exact).abs() <= exact * 2**-24).all()  # correctly rounded
    old = torch.arange(1, 256, dtype=torch.float32).sub(255).mul_(qs.SQ_OCTAVES / 127.0).exp2_()
    assert ((old - qs.SQ_RATIO[1:]).abs() <= 2e-6 * qs.SQ_RATIO[1:]).all()
    g = torch.Generator().manual_seed(0)
    ratio = torch.rand(2_000_000, generator=g).pow(torch.rand(2_000_000, generator=g) * 30)
    formula = ratio.log2().mul_(127.0 / qs.SQ_OCTAVES).round_().add_(255).clamp_(1, 255).int()
    new = qs.sq_code(ratio)
    assert (new - formula).abs().max() <= 1 and (new != formula).sum() <= 20
    boundary = torch.exp2((new.double() - 255.5) * qs.SQ_OCTAVES / 127)  # code k starts here (k >= 2)
    assert (ratio.double()[new >= 2] >= boundary[new >= 2]).all()
    assert (ratio.double()[new < 255] < torch.exp2((new.double() - 254.5) * qs.SQ_OCTAVES / 127)[new < 255]).all()


def test_exact_sqrt_is_correctly_rounded_where_torch_sqrt_is_not():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1_000_000, generator=g) * torch.exp2(torch.randint(-149, 128, (1_000_000,), generator=g).float())
    x = torch.cat([x, torch.tensor([0.0, 1e-45, 1.0, 4.0, 3.4e38, math.inf])])
    reference = x.double().sqrt().float()  # double's root rounds to the correctly rounded float root
    assert torch.equal(qs.exact_sqrt(x), reference)
