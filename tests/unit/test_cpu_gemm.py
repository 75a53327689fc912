"""fp32 CPU products through oneDNN (toolkit.core.cpu_gemm): the same numbers as torch's to fp32 rounding, every
operand that is not a plain fp32 CPU tensor left to torch, the choice measured once per machine, and the switch that
puts it in force for the process (toolkit.ops): every F.linear, backward and checkpointing's recomputation included."""

import json

import pytest
import torch
import torch.nn.functional as F

from toolkit import ops
from toolkit.core import cpu_gemm
from toolkit.models.fused_loss import linear_cross_entropy

needs_onednn = pytest.mark.skipif(not cpu_gemm.onednn_available(), reason="torch built without oneDNN")


@pytest.fixture
def onednn_calls(monkeypatch):
    """oneDNN selected for the test; the list of the operand shapes of every oneDNN product it runs."""
    calls = []
    real = cpu_gemm._lp

    def counted(x, w, bias=None):
        calls.append((tuple(x.shape), tuple(w.shape)))
        return real(x, w, bias)

    monkeypatch.setattr(cpu_gemm, "_lp", counted)
    monkeypatch.setitem(cpu_gemm._state, "onednn", True)
    return calls


def _close_to_float64(ours, ref64, k):
    """Within what fp32 sums of k products round to (torch's own error is of the same order)."""
    tol = 4 * k * torch.finfo(torch.float32).eps * ref64.abs().max().item()
    assert (ours.double() - ref64).abs().max().item() <= tol


@needs_onednn
@pytest.mark.parametrize("m,k,n", [(512, 256, 688), (300, 688, 256), (64, 512, 4096)])
def test_products_equal_float64_to_fp32_rounding(onednn_calls, m, k, n):
    g = torch.Generator().manual_seed(0)
    a, b, c = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(m, n, generator=g)
    _close_to_float64(cpu_gemm.mm_nt(a, b), a.double() @ b.double().t(), k)
    _close_to_float64(cpu_gemm.mm_nn(c, b), c.double() @ b.double(), n)
    grad_w = cpu_gemm.mm_tn(c, a)  # [n, k]: either orientation, same values
    assert grad_w.shape == (n, k)
    _close_to_float64(grad_w, c.double().t() @ a.double(), m)
    assert len(onednn_calls) == 3


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_linear_forward_and_gradients_match_f_linear(onednn_calls, bias):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, 128, generator=g, requires_grad=True)
    w = torch.randn(256, 128, generator=g, requires_grad=True)
    b = torch.randn(256, generator=g, requires_grad=True) if bias else None
    grad_y = torch.randn(4, 64, 256, generator=g)
    y = cpu_gemm.linear(x, w, b)
    y.backward(grad_y)
    assert len(onednn_calls) == 3  # forward, input gradient, weight gradient
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    y64 = F.linear(x64, w64, b64)
    y64.backward(grad_y.double())
    _close_to_float64(y, y64.detach(), 128)
    _close_to_float64(x.grad, x64.grad, 256)
    _close_to_float64(w.grad, w64.grad, 256)
    assert w.grad.shape == w.shape
    if bias:
        _close_to_float64(b.grad, b64.grad, 256)


@needs_onednn
def test_linear_without_gradients_and_frozen_weights(onednn_calls):
    x, w = torch.randn(64, 128), torch.randn(512, 128)
    with torch.no_grad():
        y = cpu_gemm.linear(x, w)
    assert not y.requires_grad and len(onednn_calls) == 1
    x.requires_grad_()
    cpu_gemm.linear(x, w).sum().backward()  # the weight wants no gradient: no weight product
    assert len(onednn_calls) == 3 and x.grad is not None


class _Subclass(torch.Tensor):
    pass


class _DispatchOnly(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl


@needs_onednn
def test_what_stays_with_torch(onednn_calls):
    x, w = torch.randn(64, 128), torch.randn(512, 128)
    cpu_gemm.linear(x.bfloat16(), w.bfloat16())  # not fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts below F.linear
        assert cpu_gemm.linear(x, w).dtype == torch.bfloat16
    cpu_gemm.linear(x.as_subclass(_Subclass), w)  # a tensor subclass (DTensor, quantized weights ...)
    cpu_gemm.linear(x[:1], w[:64])  # a product too small to gain (one row through a small layer)
    assert onednn_calls == []
    cpu_gemm._state["onednn"] = False
    cpu_gemm.linear(x, w)
    assert onednn_calls == []


@needs_onednn
def test_select_sends_every_nn_linear_to_onednn(onednn_calls):
    layer = torch.nn.Linear(128, 512)
    x = torch.randn(8, 16, 128)
    expected = layer(x)
    assert onednn_calls == []  # nothing selected: torch's
    assert ops.select("onednn")
    y = layer(x)
    assert len(onednn_calls) == 1
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert ops.select(None)  # None keeps the earlier choice (a harness run inside training)
    assert not ops.select("torch")
    layer(x)
    assert len(onednn_calls) == 1
    assert not ops.select(None) and ops.chosen() is False
    assert not ops.select("onednn", device="meta") and ops.chosen() is False  # off the CPU nothing is decided
    with torch.device("meta"):  # selected inside another mode's context, whose exit pops only its own mode
        assert ops.select("onednn")
        assert torch.empty(1).is_meta
    assert not torch.empty(1).is_meta
    layer(x)
    assert len(onednn_calls) == 2


@needs_onednn
@pytest.mark.parametrize("entry", ["Tensor.backward", "autograd.backward", "autograd.grad", "DTensor-like loss"])
def test_checkpoint_recomputation_replays_the_forwards_library(onednn_calls, entry):
    """torch's own activation checkpointing: the recomputation in backward runs in the switch's mode, so it takes
    oneDNN as the forward did (torch's products there would save other tensors, which checkpointing refuses), and
    the gradients equal those of the same run without checkpointing, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    ops.select("onednn")
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    x = torch.randn(4, 64, 256, requires_grad=True)
    leaves = [x, *block.parameters()]

    def grads(checkpointed: bool):
        for t in leaves:
            t.grad = None
        loss = (checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)).square().sum()
        if entry == "DTensor-like loss":  # a subclass without a __torch_function__ of its own (as DTensor)
            loss.as_subclass(_DispatchOnly).backward()
        elif entry == "Tensor.backward":
            loss.backward()
        elif entry == "autograd.backward":
            torch.autograd.backward([loss])
        else:
            return torch.autograd.grad(loss, leaves)
        return [t.grad for t in leaves]

    plain = grads(checkpointed=False)
    assert len(onednn_calls) == 2 + 4  # forward; input and weight gradients (the first layer's x too)
    del onednn_calls[:]
    recomputed = grads(checkpointed=True)
    assert len(onednn_calls) == 2 + 2 + 4  # forward, the recomputed forward, the gradients
    for a, b in zip(recomputed, plain):
        assert torch.equal(a, b)


@needs_onednn
def test_export_keeps_torchs_products(onednn_calls):
    """A graph exported in a process that selected oneDNN holds torch's linear, not the toolkit's op."""
    ops.select("onednn")
    exported = torch.export.export(torch.nn.Linear(128, 512), (torch.randn(64, 128),))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert "aten.linear.default" in targets and not any("toolkit" in t for t in targets)


@needs_onednn
def test_fused_loss_through_onednn_matches_torch_products(onednn_calls):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1100, 128, generator=g, requires_grad=True)  # three chunks, the last partial
    weight = (0.1 * torch.randn(3000, 128, generator=g)).requires_grad_()
    target = torch.randint(0, 3000, (1100,), generator=g)
    target[::7] = 1  # ignored rows
    ops.select("onednn")  # the head's products are plain F.linear calls, which the switch sends to oneDNN
    loss = linear_cross_entropy(hidden, weight, target, ignore_index=1, chunk_rows=512)
    loss.backward()
    assert len(onednn_calls) == 9  # three per chunk
    ours = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
    assert weight.grad.shape == weight.shape
    hidden.grad = weight.grad = None
    ops.select("torch")
    loss = linear_cross_entropy(hidden, weight, target, ignore_index=1, chunk_rows=512)
    loss.backward()
    assert len(onednn_calls) == 9
    for a, b in zip(ours, (loss.detach(), hidden.grad, weight.grad)):  # sums of 128 or 1,100 fp32 products
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5 * b.abs().max().item())


def test_select_measures_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(cpu_gemm._state, "onednn", None)
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: True)
    monkeypatch.setattr(cpu_gemm, "measure_speedup", lambda threads=None: 2.0)
    assert cpu_gemm.select("auto") and cpu_gemm.selected()
    kept = json.loads((tmp_path / cpu_gemm.CACHE_NAME).read_text())
    assert [entry["speedup"] for entry in kept.values()] == [2.0]

    def measured_again(threads=None):
        raise AssertionError("measured again")

    monkeypatch.setattr(cpu_gemm, "measure_speedup", measured_again)
    assert cpu_gemm.select("auto")  # the file's answer
    assert not cpu_gemm.select("torch") and not cpu_gemm.selected()
    assert cpu_gemm.select("onednn")
    (tmp_path / cpu_gemm.CACHE_NAME).write_text('{"cut sh')  # a file cut short: measured again
    monkeypatch.setattr(cpu_gemm, "measure_speedup", lambda threads=None: 1.02)
    assert not cpu_gemm.select("auto")  # within 10%: torch's
    with pytest.raises(ValueError, match="--cpu-matmul"):
        cpu_gemm.select("mkl")


def test_select_without_onednn_keeps_torch(monkeypatch, caplog):
    monkeypatch.setitem(cpu_gemm._state, "onednn", None)
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: False)
    assert not cpu_gemm.select("auto")
    assert not cpu_gemm.select("onednn")
    assert "no oneDNN linear kernel" in caplog.text


@needs_onednn
def test_measured_speedup_is_a_ratio():
    assert 0.05 < cpu_gemm.measure_speedup(threads=1) < 20


@needs_onednn
def test_grouped_linear_matches_one_matmul_per_expert(onednn_calls, monkeypatch):
    from toolkit.models.common.moe import grouped_matmul, per_expert_matmul

    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([300, 0, 41, 683])  # an expert without tokens
    rows = torch.randn(int(counts.sum()), 128, generator=g, requires_grad=True)
    weights = torch.randn(4, 256, 128, generator=g, requires_grad=True)
    grad = torch.randn(rows.size(0), 256, generator=g)
    grouped_matmul(rows, weights, counts)  # runs of 256 rows on average, 8.4M multiply-adds: torch's grouped GEMM
    assert onednn_calls == []
    monkeypatch.setattr(cpu_gemm, "GROUPED_MIN_MULTIPLY_ADDS", 1 << 20)
    out = grouped_matmul(rows, weights, counts)
    out.backward(grad)
    assert len(onednn_calls) >= 3 * 3  # forward, rows' and weights' gradients of the three non-empty runs
    ours = (out.detach(), rows.grad.clone(), weights.grad.clone())
    rows.grad = weights.grad = None
    per_expert_matmul(rows, weights, counts).backward(grad)
    expected = (per_expert_matmul(rows, weights, counts).detach(), rows.grad, weights.grad)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5 * b.abs().max().item())
    assert weights.grad[1].abs().max() == 0 and ours[2][1].abs().max() == 0


@needs_onednn
def test_compiled_linear_calls_the_onednn_op(onednn_calls):
    """In a graph compiled where the switch selected oneDNN (--compile's blocks) the product is
    toolkit::onednn_linear, forward and backward; the gradients equal torch's eager ones."""
    torch._dynamo.reset()
    layer = torch.nn.Linear(128, 512)
    x = torch.randn(4, 64, 128, requires_grad=True)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    ops.select("onednn")
    compiled(x).square().sum().backward()
    assert len(onednn_calls) == 3
    got = (x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())
    x.grad = layer.weight.grad = layer.bias.grad = None
    ops.select("torch")
    layer(x).square().sum().backward()  # torch's, eager
    for a, b in zip(got, (x.grad, layer.weight.grad, layer.bias.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5 * b.abs().max().item())
    torch._dynamo.reset()
