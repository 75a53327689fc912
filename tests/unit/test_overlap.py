"""``--overlap-offload-step`` checked in one process: cpu_adam's gradient scale is the separate multiply
bit for bit in any order, bad flag combinations are user errors, and the flag is off by default.

The bit-identity runs (one process and two ranks) are in tests/integration/test_overlap.py.
"""

from __future__ import annotations

from typing import List

import pytest
import torch

from tests.helpers.dist_helpers import model_args


def _config(argv: List[str]):
    from toolkit.train.resolve import parse_train_config

    return parse_train_config(argv)


def test_cpu_adam_grad_scale_is_the_separate_multiply_bit_for_bit_in_any_order():
    """``step(grad_scale=f)`` (chunked, multiply folded in) equals ``grads *= f`` then one DeepSpeed call per
    tensor, and stepping the parameters one at a time in reverse order changes nothing."""
    from toolkit.optim.cpu_adam import CPUAdam

    g = torch.Generator().manual_seed(0)
    shapes = [(1_100_003,), (300, 70), (7,)]  # the first spans 2 chunks, the last a partial SIMD span
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    factor = 0.37125

    def run(how: str) -> List[torch.Tensor]:
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        opt = CPUAdam(ps, lr=1e-2, weight_decay=0.1)
        for step_grads in grads:
            for p, gr in zip(ps, step_grads):
                p.grad = gr.clone()
            if how == "folded":
                opt.step(grad_scale=factor)
            elif how == "reversed":
                for entry in reversed(opt.plan_step()):
                    opt.run_step([entry], factor)
            else:  # the separate pass, then DeepSpeed's op on whole tensors
                torch._foreach_mul_([p.grad for p in ps], factor)
                for p, hyper in opt.plan_step():
                    state = opt.state[p]
                    step = int(state["step"]) + 1
                    opt._prime_bias_correction(step, hyper)
                    opt._ds.ds_opt_adam.adam_update(
                        opt._ds.opt_id,
                        step,
                        hyper["lr"],
                        *hyper["betas"],
                        hyper["eps"],
                        hyper["weight_decay"],
                        hyper["bias_correction"],
                        p.data,
                        p.grad,
                        state["exp_avg"],
                        state["exp_avg_sq"],
                    )
                    state["step"] += 1
            opt.zero_grad()
        return [t for p in ps for t in (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]

    reference = run("separate")
    for how in ("folded", "reversed"):
        assert all(torch.equal(a, b) for a, b in zip(run(how), reference)), how


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ddp-backend", "c10d", "--optimizer", "cpu_adam"], "needs --ddp-backend fully_sharded"),
        (["--ddp-backend", "fully_sharded", "--optimizer", "adam"], "needs --optimizer cpu_adam"),
        (
            ["--ddp-backend", "fully_sharded", "--cpu-offload", "--optimizer", "cpu_adam", "--fp16-adam-stats"],
            "--fp16-adam-stats all-reduces",
        ),
    ],
)
def test_bad_combinations_are_user_errors(tmp_path, flags, message):
    from toolkit.distributed.offload_overlap import build_offload_overlap
    from toolkit.core.errors import UserError

    cfg = _config([str(tmp_path), *model_args(str(tmp_path)), *flags, "--overlap-offload-step"])
    with pytest.raises(UserError, match="^--overlap-offload-step: ") as e:
        build_offload_overlap(cfg, torch.nn.Linear(1, 1), None)
    assert message in str(e.value)


def test_flag_is_off_by_default():
    from toolkit.config import DistributedConfig

    assert DistributedConfig().overlap_offload_step is False  # until GPU figures justify turning it on
