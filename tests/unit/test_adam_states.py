"""cpu_adam's reduced-precision moments (``--adam-state-precision bf16|8bit``, toolkit/optim/quantized_states.py).

References: the codes against their stated error bounds; the updates against cpu_adam with
fp32 moments (same DeepSpeed op, only the stored moments differ); checkpoints against the
uninterrupted run. Tolerances: after 20 AdamW steps at lr 1e-2, the parameters of the
bf16-moment run stay within 1% and those of the 8-bit run within 6% of the distance the
fp32-moment run moved them (observed about 0.4% and 3%).
"""

import io
import logging

import pytest
import torch
import torch.distributed as dist

from tests.helpers.optim import new_params, run_steps
from toolkit.core.errors import UserError
from toolkit.optim import build_optimizer
from toolkit.optim import quantized_states as qs

SHAPES = [(64, 300), (8, 5000), (300,), (4, 8)]  # 8-bit, 8-bit with padded blocks, 1-D and small: fp32
ADAM = dict(optimizer="cpu_adam", lr=1e-2, adam_betas="(0.9, 0.98)", adam_eps=1e-6, weight_decay=0.1)


def make_data(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) * torch.rand(s, generator=g).pow(4) for s in SHAPES] for _ in range(steps)]
    return init, grads


def cpu_adam(params, precision):
    return build_optimizer(dict(ADAM, adam_state_precision=precision), params)


def round_trip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("cols", [4096, 5000, 300])  # whole blocks, padded blocks, one short block
def test_signed_code_error_is_at_most_half_a_step(cols):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, cols, generator=g) * torch.logspace(-4, 2, cols)
    codes, absmax = qs.quantize_signed(x)
    n, b = qs.row_blocks(cols)
    assert codes.dtype == torch.int8 and codes.shape == x.shape and absmax.shape == (5, n)
    per_value_max = absmax.repeat_interleave(b, dim=1)[:, :cols]
    assert torch.equal(
        per_value_max,
        torch.stack([x[:, i * b : (i + 1) * b].abs().amax(1) for i in range(n)], 1).repeat_interleave(b, 1)[:, :cols],
    )
    err = (qs.dequantize_signed(codes, absmax) - x).abs()
    assert (err <= per_value_max / 254 * (1 + 1e-5)).all()


def test_sq_code_keeps_sqrt_within_3_percent_and_never_rounds_to_zero():
    g = torch.Generator().manual_seed(0)
    v = (torch.randn(6, 5000, generator=g) * torch.logspace(-8, 2, 5000)).pow(2)
    v[0, :10] = 0.0
    codes, vmax = qs.quantize_sq(v)
    assert codes.dtype == torch.uint8 and vmax.shape == (6, 3)
    w = qs.dequantize_sq(codes, vmax)
    assert torch.equal(w[0, :10], torch.zeros(10))
    floor = vmax.repeat_interleave(1667, dim=1)[:, :5000] * 2.0 ** (-2 * qs.SQ_OCTAVES)
    in_range, nonzero = v >= floor, v > 0
    half_step = 2.0 ** (qs.SQ_OCTAVES / 254)  # half a code in sqrt(v)
    ratio = (w / v.clamp_min(1e-45)).sqrt()
    assert (ratio[in_range] <= half_step * (1 + 1e-5)).all() and (ratio[in_range] >= 1 / half_step - 1e-5).all()
    below = nonzero & ~in_range
    assert below.any() and (w[below] >= v[below]).all()  # out of range: over-estimated (a smaller step), never 0


def test_moment_codes_bound_the_step_not_the_moment():
    """exp_avg is coded as m / sqrt(v): the step m / sqrt(v) keeps its accuracy however small the gradient."""
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-6, 0, 4096)  # gradients over six decades within one row
    v = (torch.randn(3, 4096, generator=g) * scale).pow(2) + (0.1 * scale).pow(2)
    m = torch.randn(3, 4096, generator=g) * v.sqrt() * 0.5
    r_codes, r_absmax, v_codes, vmax = qs.quantize_moments(m, v)
    m2, v2 = qs.dequantize_moments(r_codes, r_absmax, v_codes, vmax)
    assert torch.equal(v2, qs.dequantize_sq(v_codes, vmax))
    n, b = qs.row_blocks(4096)
    step_max = (m / v2.sqrt()).abs().reshape(3, n, b).amax(2).repeat_interleave(b, 1)
    step_err = (m2 / v2.sqrt() - m / v2.sqrt()).abs()
    assert (step_err <= step_max / 254 * (1 + 1e-4)).all()
    assert (m2 != 0).float().mean() > 0.95  # a linear code of m would zero most of these (|m| < max / 254)


@pytest.mark.parametrize("precision,tol", [("bf16", 0.01), ("8bit", 0.06)])
def test_updates_stay_close_to_fp32_moments(precision, tol):
    init, grads = make_data(20)
    ref, ps = new_params(init), new_params(init)
    run_steps(cpu_adam(ref, "fp32"), ref, grads)
    opt = cpu_adam(ps, precision)
    run_steps(opt, ps, grads)
    for p, r, p0 in zip(ps, ref, init):
        moved = (r.detach() - p0).abs().max()
        diff = (p.detach() - r.detach()).abs().max()
        layout = qs.param_layout(precision, p)
        assert diff <= tol * moved, (p.shape, float(diff), float(moved))
        if layout == "fp32":  # small and 1-D tensors keep fp32 moments: the same op, the same numbers
            assert torch.equal(p, r)
    st = opt.state[ps[1]]
    expected = {
        "bf16": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16},
        "8bit": {
            "exp_avg": torch.int8,
            "exp_avg_sq": torch.uint8,
            "exp_avg_absmax": torch.float32,
            "exp_avg_sq_absmax": torch.float32,
        },
    }[precision]
    assert {k: v.dtype for k, v in st.items() if k != "step"} == expected and float(st["step"]) == 20


def test_small_slices_give_the_same_update_as_one_slice():
    """Any slice size gives the same update (up to DeepSpeed's SIMD body vs scalar tail: float rounding)."""
    init, grads = make_data(4)
    ps, qs_ = new_params(init), new_params(init)
    whole, sliced = cpu_adam(ps, "8bit"), cpu_adam(qs_, "8bit")
    sliced.moments.chunk_elements = 700  # 8bit: two rows of 300 per slice, one row of 5000
    run_steps(whole, ps, grads)
    run_steps(sliced, qs_, grads)
    for a, b in zip(ps, qs_):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_state_dict_round_trip_gives_the_identical_next_step(precision):
    init, grads = make_data(6)
    ps = new_params(init)
    opt = cpu_adam(ps, precision)
    run_steps(opt, ps, grads[:5])
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = cpu_adam(ps2, precision)
    opt2.load_state_dict(round_trip(opt.state_dict()))
    for p, p2 in zip(ps, ps2):
        for k, v in opt.state[p].items():
            assert opt2.state[p2][k].dtype == v.dtype and torch.equal(opt2.state[p2][k], v), k
    run_steps(opt, ps, grads[5:])
    run_steps(opt2, ps2, grads[5:])
    for p, p2 in zip(ps, ps2):  # DeepSpeed's op computes beta**step by pow on a resume, by products
        torch.testing.assert_close(p, p2, rtol=0, atol=1e-6)  # otherwise: float rounding, as with fp32 moments


@pytest.mark.parametrize("precision", ["bf16", "8bit"])
def test_fp32_moments_convert_to_reduced_and_back(precision, caplog):
    init, grads = make_data(5)
    ps = new_params(init)
    fp32 = cpu_adam(ps, "fp32")
    run_steps(fp32, ps, grads)
    sd = round_trip(fp32.state_dict())

    reduced = cpu_adam([torch.nn.Parameter(p.detach().clone()) for p in ps], precision)
    with caplog.at_level(logging.INFO, logger=qs.__name__):
        reduced.load_state_dict(sd)
    lines = [r.message for r in caplog.records if "converted the loaded Adam moments" in r.message]
    assert lines == [
        f"cpu_adam: converted the loaded Adam moments (fp32 -> {precision}) to this run's --adam-state-precision"
    ]
    back = cpu_adam([torch.nn.Parameter(p.detach().clone()) for p in ps], "fp32")
    adamw = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=1e-2)
    back.load_state_dict(round_trip(reduced.state_dict()))
    adamw.load_state_dict(back.state_dict())
    for i, p in enumerate(ps):
        rp, bp = reduced.param_groups[0]["params"][i], back.param_groups[0]["params"][i]
        want = fp32.state[p]
        got = back.state[bp]
        assert set(got) == {"step", "exp_avg", "exp_avg_sq"} and got["exp_avg"].dtype == torch.float32
        # back to fp32 = the reduced moments, dequantized: within the codes' bounds of the original
        m, v = qs.fp32_moments(rp, reduced.state[rp])
        assert torch.equal(got["exp_avg"], m) and torch.equal(got["exp_avg_sq"], v)
        torch.testing.assert_close(got["exp_avg"], want["exp_avg"], rtol=0.01, atol=want["exp_avg"].abs().max() / 250)
        torch.testing.assert_close(got["exp_avg_sq"].sqrt(), want["exp_avg_sq"].sqrt(), rtol=0.03, atol=1e-12)
        assert torch.equal(adamw.state[adamw.param_groups[0]["params"][i]]["exp_avg"], m)


def test_flags_parse_and_bf16_host_grads_needs_cpu_offload():
    from toolkit.train.resolve import parse_train_config

    cfg = parse_train_config(
        [
            "d",
            "--ddp-backend",
            "fully_sharded",
            "--cpu-offload",
            "--cpu",
            "--bf16-host-grads",
            "--adam-state-precision",
            "8bit",
        ]
    )
    assert cfg.distributed.bf16_host_grads and cfg.optimizer.adam_state_precision == "8bit"
    with pytest.raises(
        UserError,
        match=r"^--bf16-host-grads requires --cpu-offload \(it keeps the offloaded "
        r"gradients in bf16\)$",
    ):
        parse_train_config(["d", "--ddp-backend", "fully_sharded", "--bf16-host-grads"])


def test_8bit_and_fp16_stats_are_exclusive():
    with pytest.raises(UserError, match="--fp16-adam-stats and --adam-state-precision 8bit both set"):
        build_optimizer(dict(ADAM, adam_state_precision="8bit", fp16_adam_stats=True), new_params(make_data(0)[0]))


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


def test_dtensor_states_and_full_state_dict_conversions(mesh):
    """FSDP2's case: states are DTensors placed like the parameter (the 8-bit scales too, sharded by rows)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    init, grads = make_data(6)
    dparams = lambda ts: [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in ts]  # noqa
    dgrads = [[distribute_tensor(g, mesh, [Shard(0)]) for g in step] for step in grads]
    ref, ps = new_params(init), dparams(init)
    run_steps(cpu_adam(ref, "8bit"), ref, grads)
    m1, opt1 = torch.nn.ParameterList(ps), cpu_adam(ps, "8bit")
    run_steps(opt1, ps, dgrads[:3])
    st = opt1.state[ps[0]]
    assert all(isinstance(st[k], DTensor) and st[k].placements == (Shard(0),) for k in st if k != "step")
    assert st["exp_avg_absmax"].shape == (64, 1)
    for options in (None, full):  # DCP's sharded and consolidated forms: 8bit -> fp32 -> 8bit
        ps2 = dparams([p.detach().full_tensor() for p in ps])
        m2, opt2 = torch.nn.ParameterList(ps2), cpu_adam(ps2, "fp32")
        set_optimizer_state_dict(m2, opt2, get_optimizer_state_dict(m1, opt1, options=options), options=options)
        assert opt2.state[ps2[0]]["exp_avg"].dtype == torch.float32
        ps3 = dparams([p.detach().full_tensor() for p in ps])
        m3, opt3 = torch.nn.ParameterList(ps3), cpu_adam(ps3, "8bit")
        set_optimizer_state_dict(m3, opt3, get_optimizer_state_dict(m2, opt2, options=options), options=options)
        for k, v in opt1.state[ps[0]].items():  # dequantize -> requantize is exact
            assert torch.equal(
                opt3.state[ps3[0]][k].full_tensor() if k != "step" else opt3.state[ps3[0]][k],
                v.full_tensor() if k != "step" else v,
            ), k
    run_steps(opt3, ps3, dgrads[3:])
    for p, r in zip(ps3, ref):  # the plain-tensor run, up to DeepSpeed's beta**step rounding on a resume
        torch.testing.assert_close(p.detach().full_tensor(), r.detach(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("saved,loaded", [("fp32", "bf16"), ("bf16", "fp32")])
def test_dcp_load_converts_between_fp32_and_bf16(saved, loaded, tmp_path):
    """A sharded checkpoint fills this run's state tensors in place: DCP casts fp32 <-> bf16 moments as it copies."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    init, grads = make_data(4)
    ps = new_params(init)
    model, opt = torch.nn.ParameterList(ps), cpu_adam(ps, saved)
    run_steps(opt, ps, grads)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path), no_dist=True)
    ps2 = new_params(init)
    model2, opt2 = torch.nn.ParameterList(ps2), cpu_adam(ps2, loaded)
    tensors = {"optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(tensors, checkpoint_id=str(tmp_path), no_dist=True)
    set_optimizer_state_dict(model2, opt2, tensors["optim"])
    want = torch.bfloat16 if loaded == "bf16" else torch.float32
    for p, p2 in zip(ps, ps2):
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt2.state[p2][k].dtype == want and torch.equal(opt2.state[p2][k], opt.state[p][k].to(want))


@pytest.mark.parametrize("precision", ["fp32", "8bit"])
def test_bf16_host_grads_under_fsdp2(mesh, precision):
    """--bf16-host-grads: FSDP2's gradients are re-stored in bf16 (the fp32 ones rounded) and cpu_adam steps on them."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from toolkit.distributed.host_grads import keep_grads_in_bf16

    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.ReLU(), torch.nn.Linear(64, 80))  # noqa
    models = [make(), make()]
    models[1].load_state_dict(models[0].state_dict())
    for m in models:
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
    assert keep_grads_in_bf16(models[1]) == 4
    opts = [cpu_adam(list(m.parameters()), precision) for m in models]
    for step in range(3):
        x = torch.randn(5, 96)
        for m in models:
            m(x).pow(2).sum().backward()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert isinstance(b.grad, DTensor) and b.grad.dtype == torch.bfloat16 and a.grad.dtype == torch.float32
            assert torch.equal(b.grad.to_local(), a.grad.to_local().bfloat16())
            a.grad = b.grad.to(torch.float32)  # the reference steps on the same (rounded) values in fp32
        for o in opts:
            o.step()
            o.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a.detach().full_tensor(), b.detach().full_tensor(), rtol=0, atol=1e-6)


def test_refusals(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    p = torch.nn.Parameter(distribute_tensor(torch.randn(64, 128), mesh, [Shard(1)]))
    with pytest.raises(UserError, match=r"8-bit moments need row sharding \(FSDP2's Shard\(0\)\)"):
        qs.zeros_state("8bit", p)
    opt = cpu_adam(new_params(make_data(0)[0]), "8bit")
    with pytest.raises(UserError) as e:
        qs.check_sharded_load("ck", ["optim.state.a.exp_avg", "optim.state.a.exp_avg_sq"], opt)
    assert str(e.value) == (
        "ck: its Adam moments are saved as float and this run keeps them as 8bit "
        "(--adam-state-precision); convert through a consolidated checkpoint: run "
        "toolkit-consolidate ck and pass the .pt to --restore-file, or add --reset-optimizer"
    )
    qs.check_sharded_load("ck", ["optim.state.a.exp_avg", "optim.state.a.exp_avg_absmax"], opt)
