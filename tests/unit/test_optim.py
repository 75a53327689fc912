"""Optimizers: adam / sgd / cpu_adam (DeepSpeed, plain tensors and DTensors), state_dict interop, bad flags.

Tolerance for cpu_adam vs torch AdamW: both do fp32 math (DeepSpeed with AVX, a slightly
different but equivalent formula: it multiplies by 1/sqrt(bias_correction2) where torch
divides by sqrt(bias_correction2)), so after 10 steps they agree to a few fp32 ulps;
the tests use rtol=atol=1e-5 (observed max abs difference ~1e-6 on values of size ~4).
"""

import argparse
import logging

import pytest
import torch
import torch.distributed as dist

from tests.helpers.optim import new_params, run_steps
from toolkit.core.errors import UserError
from toolkit.optim import build_optimizer
from toolkit.optim.adam import parse_adam_betas
from toolkit.core.registry import UnknownComponentError

SHAPES = [(12, 5), (5,), (16, 3)]
TOL = dict(rtol=1e-5, atol=1e-5)
ADAM_ARGS = dict(lr=1e-2, adam_betas="(0.9, 0.98)", adam_eps=1e-6, weight_decay=0.1)


def make_data(steps=15, seed=0):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]
    return init, grads


def torch_adamw(params, **kw):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1, **kw)


def test_adam_is_adamw_fused_on_cpu():
    init, grads = make_data(10)
    ps = new_params(init)
    opt = build_optimizer(dict(optimizer="adam", **ADAM_ARGS), ps)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["fused"] is True
    assert opt.param_groups[0]["betas"] == (0.9, 0.98)
    ref = new_params(init)
    ref_opt = torch_adamw(ref, foreach=False)
    run_steps(opt, ps, grads)
    run_steps(ref_opt, ref, grads)
    for a, b in zip(ps, ref):
        torch.testing.assert_close(a, b, **TOL)


def test_adam_keeps_fused_after_loading_a_foreach_state():
    init, grads = make_data(4)
    src = new_params(init)
    src_opt = torch_adamw(src, foreach=True)
    run_steps(src_opt, src, grads)
    ps = new_params(init)
    opt = build_optimizer(dict(optimizer="adam", **ADAM_ARGS), ps)
    opt.load_state_dict(src_opt.state_dict())
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is None
    assert opt.state[ps[0]]["step"].dtype == torch.float32
    run_steps(opt, ps, grads[:1])  # and it steps


def test_sgd_momentum_weight_decay():
    init, grads = make_data(5)
    ps = new_params(init)
    opt = build_optimizer(dict(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.01), ps)
    assert isinstance(opt, torch.optim.SGD)
    ref = new_params(init)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)
    run_steps(opt, ps, grads)
    run_steps(ref_opt, ref, grads)
    for a, b in zip(ps, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_param_groups_and_namespace_args():
    init, _ = make_data(1)
    ps = new_params(init)
    groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]
    ns = argparse.Namespace(optimizer="adam", **ADAM_ARGS)
    opt = build_optimizer(ns, groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize(
    "text,expected", [("(0.9, 0.98)", (0.9, 0.98)), ("0.9,0.999", (0.9, 0.999)), ("[0.8, 0.9]", (0.8, 0.9))]
)
def test_parse_adam_betas(text, expected):
    assert parse_adam_betas(text) == expected


@pytest.mark.parametrize(
    "args,flag",
    [
        (dict(adam_betas="0.9"), "--adam-betas"),
        (dict(adam_betas="(0.9, 1.5)"), "--adam-betas"),
        (dict(adam_betas="nonsense("), "--adam-betas"),
        (dict(adam_eps=0.0), "--adam-eps"),
        (dict(weight_decay=-1.0), "--weight-decay"),
    ],
)
@pytest.mark.parametrize("optimizer", ["adam", "cpu_adam"])
def test_bad_adam_flags(optimizer, args, flag):
    with pytest.raises(UserError, match=flag):
        build_optimizer(dict(optimizer=optimizer, lr=1e-3, **args), new_params(make_data(1)[0]))


def test_unknown_optimizer():
    with pytest.raises(UnknownComponentError, match="--optimizer: unknown name 'adamm'. Did you mean 'adam'"):
        build_optimizer(dict(optimizer="adamm", lr=1e-3), new_params(make_data(1)[0]))


def test_flags_are_generated_and_shared():
    from toolkit.config import OptimizationConfig
    from toolkit.optim.cpu_adam import CPUAdamConfig
    from toolkit.options import add_dataclass_options

    parser = argparse.ArgumentParser()
    add_dataclass_options(parser, OptimizationConfig)
    add_dataclass_options(parser, CPUAdamConfig)
    args = parser.parse_args(
        ["--adam-betas", "(0.9, 0.98)", "--fp16-adam-stats", "--weight-decay", "0.01", "--lr", "0.0005"]
    )
    assert (args.adam_betas, args.fp16_adam_stats, args.weight_decay, args.lr) == ("(0.9, 0.98)", True, 0.01, 5e-4)


def cpu_adam(params, **kw):
    return build_optimizer(dict(optimizer="cpu_adam", **ADAM_ARGS, **kw), params)


def test_cpu_adam_matches_torch_adamw():
    from toolkit.optim.cpu_adam import CPUAdam

    init, grads = make_data(10)
    ps, ref = new_params(init), new_params(init)
    opt = cpu_adam(ps)
    assert isinstance(opt, CPUAdam) and isinstance(opt, torch.optim.Optimizer)
    ref_opt = torch_adamw(ref, foreach=False)
    run_steps(opt, ps, grads)
    run_steps(ref_opt, ref, grads)
    for a, b in zip(ps, ref):
        torch.testing.assert_close(a, b, **TOL)
        sa, sb = opt.state[a], ref_opt.state[b]
        assert set(sa) == {"step", "exp_avg", "exp_avg_sq"}
        assert torch.is_tensor(sa["step"]) and sa["step"].dtype == sb["step"].dtype and float(sa["step"]) == 10
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], **TOL)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], **TOL)


@pytest.mark.parametrize(
    "param, words",
    [
        (torch.zeros(4, device="meta"), "must live in host memory"),
        (torch.zeros(4, dtype=torch.float64), "unsupported parameter dtype"),
    ],
)
def test_cpu_adam_rejects_params_it_cannot_update(param, words):
    with pytest.raises(UserError, match=words):
        cpu_adam([torch.nn.Parameter(param)])


def test_cpu_adam_param_groups_and_lr_changes():
    init, grads = make_data(6)
    ps, ref = new_params(init), new_params(init)
    opt = build_optimizer(
        dict(optimizer="cpu_adam", **ADAM_ARGS), [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]
    )
    ref_opt = torch.optim.AdamW(
        [{"params": ref[:2]}, {"params": ref[2:], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.98),
        eps=1e-6,
        weight_decay=0.1,
        foreach=False,
    )
    for i, step_grads in enumerate(grads):
        for o in (opt, ref_opt):  # what a scheduler does
            for g in o.param_groups:
                g["lr"] = 1e-2 / (i + 1)
        for p, q, g in zip(ps, ref, step_grads):
            if i == 2 and p is ps[1]:
                continue  # a parameter without a gradient is skipped, as torch does
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for a, b in zip(ps, ref):
        torch.testing.assert_close(a, b, **TOL)
    assert float(opt.state[ps[1]]["step"]) == 5


def test_state_dict_interop_cpu_adam_adamw_cpu_adam():
    init, grads = make_data(15)
    ref = new_params(init)
    run_steps(torch_adamw(ref, foreach=False), ref, grads)

    ps = new_params(init)
    opt = cpu_adam(ps)
    run_steps(opt, ps, grads[:5])
    sd = opt.state_dict()

    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = torch_adamw(ps2, foreach=False)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["decoupled_weight_decay"] is True
    run_steps(opt2, ps2, grads[5:10])

    ps3 = [torch.nn.Parameter(p.detach().clone()) for p in ps2]
    opt3 = cpu_adam(ps3)
    opt3.load_state_dict(opt2.state_dict())
    run_steps(opt3, ps3, grads[10:])
    assert float(opt3.state[ps3[0]]["step"]) == 15
    for a, b in zip(ps3, ref):
        torch.testing.assert_close(a, b, **TOL)


def test_cpu_adam_fp16_stats():
    init, grads = make_data(10)
    ps, ref = new_params(init), new_params(init)
    opt = cpu_adam(ps, fp16_adam_stats=True)
    run_steps(opt, ps, grads)
    run_steps(torch_adamw(ref, foreach=False), ref, grads)
    st = opt.state[ps[0]]
    assert st["exp_avg"].dtype == torch.float16 and st["exp_avg_sq"].dtype == torch.float16
    assert set(st) == {"step", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"}
    for a, b in zip(ps, ref):  # fp16 moments: close, not exact
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    # its state_dict survives a save/load round trip (torch casts fp16 state to the param dtype on load)
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = cpu_adam(ps2, fp16_adam_stats=True)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[ps2[0]]["exp_avg"].dtype == torch.float16
    torch.testing.assert_close(opt2.state[ps2[0]]["exp_avg"], st["exp_avg"], rtol=0, atol=0)
    # and converts to the plain fp32 layout that torch AdamW reads
    ps3 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt3 = cpu_adam(ps3)
    opt3.load_state_dict(opt.state_dict())
    assert set(opt3.state[ps3[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    torch.testing.assert_close(opt3.state[ps3[0]]["exp_avg"], st["exp_avg"].float() * st["exp_avg_scale"])


def test_cpu_adam_build_log_and_missing_compiler(monkeypatch, caplog, tmp_path):
    from toolkit.optim import deepspeed_op as mod

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert mod.cpu_adam_build_dir() == str(tmp_path / "cpu_adam")
    monkeypatch.setattr(mod, "cpu_adam_op_cached", lambda: False)
    cpu_adam(new_params(make_data(1)[0]))  # ensures the op is loaded in this process already
    with caplog.at_level(logging.INFO, logger=mod.__name__):
        mod.load_deepspeed_cpu_adam()
    assert (
        "Building DeepSpeed's CPU Adam C++ op (first use on this machine, about a minute; cached "
        f"afterwards in {tmp_path / 'cpu_adam'})" in caplog.text
    )
    monkeypatch.setattr(mod, "cxx_compiler", lambda: None)
    with pytest.raises(UserError) as e:
        cpu_adam(new_params(make_data(1)[0]))
    assert str(e.value) == (
        "--optimizer cpu_adam: DeepSpeed needs a C++ compiler (g++) to build its CPU Adam op; "
        "install one (apt-get install g++) or use --optimizer adam"
    )


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from torch.distributed.device_mesh import init_device_mesh

    created = False
    if not dist.is_initialized():
        path = tmp_path_factory.mktemp("rdzv") / "store"
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{path}")
        created = True
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def dtensor_params(init, mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    return [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]


def dtensor_grads(grads, mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    return [[distribute_tensor(g, mesh, [Shard(0)]) for g in step] for step in grads]


@pytest.mark.parametrize("fp16_adam_stats", [False, True])
def test_cpu_adam_dtensor_params(mesh, fp16_adam_stats):
    from torch.distributed.tensor import DTensor

    init, grads = make_data(10)
    ps = dtensor_params(init, mesh)
    opt = cpu_adam(ps, fp16_adam_stats=fp16_adam_stats)
    local_ptrs = [opt._locals[p].data_ptr() for p in ps]
    assert local_ptrs == [p.to_local().data_ptr() for p in ps]  # views sharing the DTensors' storage
    run_steps(opt, ps, dtensor_grads(grads, mesh))
    ref = new_params(init)
    run_steps(torch_adamw(ref, foreach=False), ref, grads)
    tol = dict(rtol=1e-3, atol=1e-3) if fp16_adam_stats else TOL
    for p, r in zip(ps, ref):
        assert isinstance(p, DTensor)
        torch.testing.assert_close(p.full_tensor(), r.detach(), **tol)
        st = opt.state[p]
        assert isinstance(st["exp_avg"], DTensor) and isinstance(st["exp_avg_sq"], DTensor)
        assert not isinstance(st["step"], DTensor) and float(st["step"]) == 10
        assert opt._locals[p].grad is None  # gradients are not kept past the step


def test_cpu_adam_dtensor_interop_and_dcp_state_dict(mesh):
    """cpu_adam <-> AdamW through torch.distributed.checkpoint's optimizer state_dict helpers."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    init, grads = make_data(15)
    ref = new_params(init)
    run_steps(torch_adamw(ref, foreach=False), ref, grads)

    model_with = torch.nn.ParameterList  # names its params "0", "1", ...; enough for the helpers

    dgrads = dtensor_grads(grads, mesh)
    ps = dtensor_params(init, mesh)
    m1, opt1 = model_with(ps), cpu_adam(ps)
    run_steps(opt1, ps, dgrads[:5])
    sd = get_optimizer_state_dict(m1, opt1)
    assert isinstance(sd["state"]["0"]["exp_avg"], DTensor)

    ps2 = dtensor_params([p.detach().full_tensor() for p in ps], mesh)
    m2, opt2 = model_with(ps2), torch_adamw(ps2, foreach=False)
    set_optimizer_state_dict(m2, opt2, sd)
    run_steps(opt2, ps2, dgrads[5:10])

    ps3 = dtensor_params([p.detach().full_tensor() for p in ps2], mesh)
    m3, opt3 = model_with(ps3), cpu_adam(ps3)
    set_optimizer_state_dict(m3, opt3, get_optimizer_state_dict(m2, opt2))
    run_steps(opt3, ps3, dgrads[10:])
    for p, r in zip(ps3, ref):
        torch.testing.assert_close(p.full_tensor(), r.detach(), **TOL)


def test_cpu_adam_with_fsdp2_fully_shard(mesh):
    """The trainer's case: FSDP2 (fully_shard) parameters and gradients are DTensors."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    ref.load_state_dict(model.state_dict())
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = build_optimizer(dict(optimizer="cpu_adam", **ADAM_ARGS), list(model.parameters()))
    ref_opt = torch_adamw(list(ref.parameters()), foreach=False)
    for _ in range(5):
        x = torch.randn(3, 8)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().full_tensor(), r.detach(), **TOL)
