"""Mixed precision: --fp16 dynamic loss scaling (fairseq's semantics and log lines), the minimum-scale
stop, --memory-efficient-fp16 (fp16 weights, fp32 optimizer state), --bf16, the CPU warning, the
--cpu-offload flag combinations, adam <-> cpu_adam checkpoints, and overflow agreement across 2 ranks.
The 2-rank tests run each rank as tests/helpers/fp16_worker.py (toolkit-train with a test-only fault).
"""

from __future__ import annotations

import math

import pytest
import torch

from toolkit.config import composition
from toolkit.optim import build_optimizer
from toolkit.optim.fp16 import MemoryEfficientFP16, grad_norm_fp32

SHAPES = [(7, 5), (5,), (13, 3), (4,), (6, 6)]
OPTIMIZERS = {
    "adam": dict(optimizer="adam", lr=0.01, weight_decay=0.1, adam_betas="(0.9, 0.98)", adam_eps=1e-8),
    "sgd": dict(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
    "cpu_adam": dict(optimizer="cpu_adam", lr=0.01, weight_decay=0.1, adam_betas="(0.9, 0.98)", adam_eps=1e-8),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_memory_efficient_step_is_fp32_math_on_fp16_weights(name):
    """Chunked fp32 steps over fp16 weights == the optimizer on fp32 copies, rounded to fp16 after each step."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    p16 = [torch.nn.Parameter(t.half()) for t in init]
    ref = [torch.nn.Parameter(t.half().float()) for t in init]
    opt = build_optimizer(OPTIMIZERS[name], p16)
    stepper = MemoryEfficientFP16(opt, chunk_numel=40)  # several chunks
    assert len(stepper._chunks(p16)) > 2
    ref_opt = build_optimizer(OPTIMIZERS[name], ref)
    factor = 1.0 / 4096  # e.g. world_size / (sample_size * loss_scale)
    for step in range(4):
        grads = [(torch.randn(s, generator=g) * 4096 * (10**-step)).half() for s in SHAPES]
        for p, gr in zip(p16, grads):
            p.grad = gr.clone()
        stepper.step(factor)
        for r, gr in zip(ref, grads):
            r.grad = gr.float() * factor
        ref_opt.step()
        with torch.no_grad():
            for r in ref:
                r.copy_(r.half().float())  # the weights live in fp16
        for p, r in zip(p16, ref):
            assert p.dtype == torch.float16 and p.grad is None
            assert torch.equal(p.float(), r), (name, step)
    for p, r in zip(p16, ref):
        for k, v in ref_opt.state[r].items():
            mine = opt.state[p][k]
            if torch.is_tensor(v) and k != "step":
                assert mine.dtype == torch.float32 and torch.equal(mine, v), k


def test_memory_efficient_step_keeps_the_parameters_autograd_identity():
    """Parameters are written in place: storage and gradient hooks (what DDP's all-reduce hangs on) survive."""
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    fired = []
    p.register_post_accumulate_grad_hook(lambda t: fired.append(t.grad.clone()))
    storage = p.untyped_storage().data_ptr()
    stepper = MemoryEfficientFP16(build_optimizer(OPTIMIZERS["adam"], [p]))
    for _ in range(2):
        (p.float() * 2).sum().backward()
        stepper.step(0.5)
    assert len(fired) == 2 and p.untyped_storage().data_ptr() == storage and p.dtype == torch.float16


def test_memory_efficient_small_gradients_do_not_underflow():
    """Unscaling happens in fp32: a gradient that is tiny after unscaling still moves the weight (SGD)."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    stepper = MemoryEfficientFP16(build_optimizer(dict(optimizer="sgd", lr=1.0), [p]))
    p.grad = torch.full((4,), 1024.0, dtype=torch.float16)
    stepper.step(2.0**-34)  # 6e-8 after unscaling: fp16 flushes it to 0, fp32 keeps it
    ref = torch.tensor(1.0) - 1024.0 * 2.0**-34
    assert torch.equal(p.float(), ref.half().float().expand(4))
    assert (torch.tensor(1024.0, dtype=torch.float16) * torch.tensor(2.0**-34, dtype=torch.float16)) == 0


def test_memory_efficient_state_stays_fp32_through_checkpoint_state_dicts():
    """torch casts loaded state to the parameter dtype; the fp32 moments must survive save/load (DCP helpers)."""
    from toolkit.checkpoint.consolidated import FULL_STATE, optimizer_state
    from toolkit.checkpoint.dcp_state import set_optimizer_state_dict  # torch's, imported at the call

    def model_and_opt(hooks: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)).half()
        opt = build_optimizer(OPTIMIZERS["adam"], list(model.parameters()))
        return model, opt, MemoryEfficientFP16(opt) if hooks else None

    model, opt, stepper = model_and_opt(True)
    for p in model.parameters():
        p.grad = torch.randn(p.shape).half()
    stepper.step(1e-3)
    saved = optimizer_state(model, opt)
    assert all(st["exp_avg"].dtype == torch.float32 for st in saved["state"].values())

    model2, opt2, _ = model_and_opt(True)
    set_optimizer_state_dict(model2, opt2, saved, options=FULL_STATE)
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt2.state[p2][k].dtype == torch.float32
            assert torch.equal(opt2.state[p2][k], opt.state[p][k]), (name, k)
    model3, opt3, _ = model_and_opt(False)  # without the hooks torch would round the moments to fp16
    set_optimizer_state_dict(model3, opt3, saved, options=FULL_STATE)
    assert next(iter(opt3.state.values()))["exp_avg"].dtype == torch.float16


def test_grad_norm_fp32_does_not_overflow_and_flags_inf():
    p = torch.nn.Parameter(torch.zeros(10000, dtype=torch.float16))
    p.grad = torch.full((10000,), 1000.0, dtype=torch.float16)  # norm 1e5 > fp16 max 65504
    assert torch.linalg.vector_norm(p.grad) == math.inf  # an fp16 result overflows: a false "overflow"
    assert float(grad_norm_fp32([p])) == pytest.approx(1e5, rel=1e-5)
    p.grad[3] = float("inf")
    assert not math.isfinite(float(grad_norm_fp32([p])))


def parse_train_args(*argv):
    """toolkit-train's resolved config for these flags (toolkit.train.resolve)."""
    from toolkit.train.resolve import parse_train_config

    return parse_train_config(["data", "--arch", "transformer_lm", "--batch-size", "2", "--max-update", "1", *argv])


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--ddp-backend", "fully_sharded", "--cpu-offload", "--optimizer", "adam", "--fp16"],
            "--cpu-offload requires --optimizer cpu_adam or muon (the offloaded shards are updated in host memory by "
            "DeepSpeed's CPU Adam or Muon's host-memory momentum), got --optimizer adam; drop --optimizer or use "
            "--optimizer cpu_adam",
        ),
        (["--cpu-offload", "--optimizer", "cpu_adam", "--fp16"], "--cpu-offload requires --ddp-backend fully_sharded"),
        (["--cpu-offload"], "--cpu-offload requires --ddp-backend fully_sharded"),
        (["--memory-efficient-fp16", "--bf16"], composition.MEFP16_BF16),  # the table's messages (docs/composition.md)
        (["--fp16", "--bf16"], composition.HALF_FORMATS),
    ],
)
def test_flag_combinations(argv, message):
    from toolkit.core.errors import UserError

    with pytest.raises(UserError) as e:
        parse_train_args(*argv)
    assert str(e.value) == message


def test_valid_flag_combinations():
    for argv in (
        ["--ddp-backend", "fully_sharded", "--cpu-offload", "--optimizer", "cpu_adam", "--fp16"],
        ["--ddp-backend", "fully_sharded", "--cpu-offload", "--optimizer", "cpu_adam", "--bf16"],
        [
            "--fp16",
            "--fp16-no-flatten-grads",
            "--fp16-scale-tolerance",
            "0.25",
            "--threshold-loss-scale",
            "1",
            "--min-loss-scale",
            "0.001",
            "--fp16-scale-window",
            "16",
        ],
    ):
        parse_train_args(*argv)
    cfg = parse_train_args("--memory-efficient-fp16")
    assert cfg.common.fp16  # --memory-efficient-fp16 is fp16 training
    assert cfg.common.fp16_init_scale == 128 and cfg.common.min_loss_scale == 1e-4
