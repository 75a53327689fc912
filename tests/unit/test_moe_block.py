"""The MoE block (``toolkit.models.common.moe``) against direct computations: the router's choice and weights
from the scores, the sorted grouped dispatch against a loop over tokens and their experts (values and
gradients), the CPU per-expert matmuls against ``torch._grouped_mm``, the balance and z losses from their
definitions, the aux-loss-free bias update and the idle-expert warning."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from toolkit.models.common import moe as moe_module
from toolkit.models.common.mlp import FEED_FORWARDS
from toolkit.models.common.moe import (
    MoE,
    Router,
    _grouped_mm_applies,
    grouped_matmul,
    load_balancing_loss,
    logger as moe_logger,
    padded_slots,
    per_expert_matmul,
    router_z_loss,
)

C, FF, E, K = 16, 24, 4, 2


def make_moe(seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(C, FF, num_experts=E, top_k=K, **kw)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token over its k experts: no sorting, no grouping."""
    flat = x.reshape(-1, x.size(-1))
    routing = moe.gate(flat)
    e = moe.experts
    rows = []
    for n in range(flat.size(0)):
        out = torch.zeros(flat.size(1))
        for slot in range(routing.experts.size(1)):
            i = int(routing.experts[n, slot])
            h = F.silu(e.gate_proj[i] @ flat[n]) * (e.up_proj[i] @ flat[n])
            out = out + routing.weights[n, slot] * (e.down_proj[i] @ h)
        rows.append(out)
    out = torch.stack(rows)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(flat)
    return out.view_as(x)


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_router_matches_direct_top_k(renormalize):
    torch.manual_seed(1)
    router = Router(C, E, K, "softmax", renormalize)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(10, C)
    r = router(x)
    probs = torch.softmax(x @ router.weight.t(), -1).detach()
    for n in range(10):
        ranked = sorted(range(E), key=lambda i: -float(probs[n, i]))[:K]
        assert r.experts[n].tolist() == ranked
        want = probs[n, ranked] / (probs[n, ranked].sum() if renormalize else 1.0)
        torch.testing.assert_close(r.weights[n], want)


def test_sigmoid_router_chooses_by_bias_weights_without_it():
    torch.manual_seed(2)
    router = Router(C, E, K, "sigmoid", renormalize=True, balance_bias=True)
    torch.nn.init.normal_(router.weight)
    router.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 10.0]))  # experts 0 and 3 always chosen
    r = router(torch.randn(6, C))
    assert sorted(r.experts[0].tolist()) == [0, 3] and all(sorted(e) == [0, 3] for e in r.experts.tolist())
    scores = torch.sigmoid(r.logits)
    want = scores.gather(1, r.experts)
    torch.testing.assert_close(r.weights, want / want.sum(-1, keepdim=True))


@pytest.mark.parametrize("shared", [0, 8])
def test_moe_forward_and_gradients_equal_the_loop_over_experts(shared):
    moe = make_moe(shared_hidden=shared)
    x = torch.randn(2, 5, C, requires_grad=True)
    got = moe(x)
    ref_moe = make_moe(shared_hidden=shared)
    x_ref = x.detach().clone().requires_grad_()
    want = reference_moe(ref_moe, x_ref)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(moe.named_parameters(), ref_moe.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_the_padded_slots_lay_each_experts_pairs_out_in_token_order():
    slots = padded_slots(torch.tensor([[0, 1], [0, 2], [0, 1]]), 4, limit=2.0)
    pad = 6  # N k: the pairs' count
    assert slots.cap == 3 and slots.counts.tolist() == [3, 2, 1, 0]
    assert slots.pairs.tolist() == [0, 2, 4, 1, 5, pad, 3, pad, pad, pad, pad, pad]
    assert padded_slots(torch.tensor([[0, 1], [0, 2], [0, 1]]), 4, limit=1.9) is None  # 12 rows for 6 pairs


def test_the_cpu_padded_form_equals_the_runs_values_and_gradients(monkeypatch):
    """``GroupedExperts.run_padded`` (each expert's run padded to the longest, one batched matmul per projection)
    against the sorted runs: the same sum, the same gradients of the input, the experts and the router."""
    moe = make_moe(shared_hidden=8)
    x = torch.randn(2, 6, C)
    taken, results = [], []
    for runs in (False, True):
        if runs:
            monkeypatch.setattr(moe_module, "padded_slots", lambda experts, count: None)
        else:
            monkeypatch.setattr(moe_module, "padded_slots", lambda e, n: taken.append(1) or padded_slots(e, n, 10.0))
        moe.zero_grad()
        x_in = x.clone().requires_grad_()
        y = moe(x_in)
        y.square().sum().backward()
        results.append((y.detach(), x_in.grad, *[p.grad for p in moe.parameters()]))
    assert taken == [1]
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


def test_the_export_form_runs_every_expert_to_the_same_sum():
    moe = make_moe().eval()
    x = torch.randn(10, C)
    routing = moe.gate(x)
    sorted_sum, _ = moe.experts(x, routing)
    torch.testing.assert_close(moe.experts.every_expert(x, routing), sorted_sum, atol=1e-5, rtol=1e-5)


def assert_same_products(matmul, counts, width_in, width_out, seed):
    """``matmul`` against ``per_expert_matmul``: values and both gradients."""
    torch.manual_seed(seed)
    rows = torch.randn(int(counts.sum()), width_in, requires_grad=True)
    w = torch.randn(len(counts), width_out, width_in, requires_grad=True)
    grad = torch.randn(rows.size(0), width_out)
    results = []
    for fn in (matmul, per_expert_matmul):
        rows.grad = w.grad = None
        out = fn(rows, w, counts)
        out.backward(grad)
        results.append((out.detach(), rows.grad.clone(), w.grad.clone()))
    torch.testing.assert_close(results[0], results[1])
    return rows, w


def test_per_expert_path_equals_grouped_mm_values_and_gradients():
    rows, w = assert_same_products(grouped_matmul, torch.tensor([3, 0, 5, 2]), 16, 32, seed=3)
    assert _grouped_mm_applies(rows, w) and not _grouped_mm_applies(rows[:, :6], w[:, :, :6])


def test_the_compiled_form_of_the_grouped_matmul_has_the_same_values_and_gradients():
    """``--compile`` runs the grouped matmul as an opaque op with its own backward (fp32 has no compiled kernel)."""
    from toolkit.models.common.moe import _opaque_grouped_matmul

    counts = torch.tensor([2, 4, 0, 3])
    rows, w = assert_same_products(_opaque_grouped_matmul, counts, 16, 8, seed=5)
    compiled = torch.compile(grouped_matmul, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(rows, w, counts), per_expert_matmul(rows, w, counts))


def test_balance_and_z_losses_equal_their_definitions():
    torch.manual_seed(4)
    logits = torch.randn(12, E)
    probs = logits.softmax(-1)
    experts = torch.topk(probs, K).indices
    counts = torch.bincount(experts.flatten(), minlength=E)
    direct = 0.0
    for i in range(E):
        f_i = sum(int(i in experts[n].tolist()) for n in range(12)) / (12 * K)
        direct += f_i * sum(float(probs[n, i]) for n in range(12)) / 12
    assert float(load_balancing_loss(probs, counts, K)) == pytest.approx(E * direct, rel=1e-6)
    uniform = torch.full((8, E), 1.0 / E)
    assert float(load_balancing_loss(uniform, torch.full((E,), 8 * K // E), K)) == pytest.approx(1.0)
    z = sum(float(torch.log(torch.exp(logits[n]).sum())) ** 2 for n in range(12)) / 12
    assert float(router_z_loss(logits)) == pytest.approx(z, rel=1e-6)


def test_training_forward_records_losses_and_loads():
    moe = make_moe()
    x = torch.randn(3, 4, C)
    moe(x)
    routing = moe.gate(x.reshape(-1, C))
    counts = torch.bincount(routing.experts.flatten(), minlength=E).float()
    assert float(moe.load["max_load"]) == pytest.approx(float(counts.max() / counts.mean()))
    assert float(moe.load["dropped"]) == 0.0
    torch.testing.assert_close(moe.tokens_per_expert, counts)
    torch.testing.assert_close(moe.aux["balance"], load_balancing_loss(routing.probs, counts, K))
    moe.eval()
    moe.aux, moe.load = {}, {}
    moe(x)
    assert moe.aux == {} and moe.load == {}  # evaluation records nothing


def test_bias_update_moves_towards_idle_experts():
    moe = make_moe(score_func="sigmoid", renormalize=True, bias_update_rate=0.01)
    moe.tokens_per_expert.copy_(torch.tensor([5.0, 1.0, 2.0, 0.0]))  # mean 2
    moe.after_optimizer_step()
    torch.testing.assert_close(moe.gate.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.01]))
    assert moe.tokens_per_expert.sum() == 0
    assert "gate.expert_bias" in moe.state_dict()  # saved with the model: resumes exactly


def test_idle_expert_is_warned_about_after_n_updates(caplog):
    moe = make_moe(idle_warning_updates=3, name="layers.1.mlp")
    moe_logger.disabled = False
    with caplog.at_level(logging.WARNING, logger="toolkit.moe"):
        for _ in range(3):
            assert not caplog.records
            moe.tokens_per_expert.copy_(torch.tensor([4.0, 0.0, 4.0, 0.0]))
            moe.after_optimizer_step()
    assert len(caplog.records) == 1
    assert "layers.1.mlp: expert(s) 1, 3 received no token for 3 updates" in caplog.records[0].getMessage()


def test_moe_registers_as_a_feed_forward():
    assert FEED_FORWARDS["moe"] is MoE
    out = FEED_FORWARDS["moe"](C, FF, False, num_experts=E, top_k=K)
    assert out.experts.gate_proj.shape == (E, FF, C) and out.experts.down_proj.shape == (E, C, FF)


def reference_group_limited_route(router: Router, x: torch.Tensor):
    """DeepSeek-V3's choice token by token: groups by the sum of their 2 best biased scores, the best groups' experts
    ranked by biased score, weighted by the unbiased ones renormalized and scaled."""
    scores = torch.sigmoid(x @ router.weight.t()).detach()
    biased = scores + router.expert_bias
    size = E_GROUPED // router.groups
    chosen, weights = [], []
    for n in range(x.size(0)):
        group_score = [sorted(biased[n, g * size : (g + 1) * size].tolist())[-2:] for g in range(router.groups)]
        best = sorted(range(router.groups), key=lambda g: -sum(group_score[g]))[: router.top_groups]
        allowed = [i for g in best for i in range(g * size, (g + 1) * size)]
        ranked = sorted(allowed, key=lambda i: -float(biased[n, i]))[: router.top_k]
        w = scores[n, ranked]
        chosen.append(sorted(ranked))
        weights.append(dict(zip(ranked, (w / w.sum() * router.scaling).tolist())))
    return chosen, weights


E_GROUPED = 8


@pytest.mark.parametrize("groups, top_groups", [(2, 1), (4, 2)])
def test_group_limited_sigmoid_router_matches_deepseeks_choice(groups, top_groups):
    """Experts from the kept groups only, chosen by the biased scores, weighted by the unbiased ones (renormalized,
    times the routed scaling factor); the weights' gradient reaches the router."""
    torch.manual_seed(3)
    router = Router(
        C,
        E_GROUPED,
        2,
        "sigmoid",
        renormalize=True,
        balance_bias=True,
        groups=groups,
        top_groups=top_groups,
        scaling=2.5,
    )
    torch.nn.init.normal_(router.weight)
    router.expert_bias.normal_(0.0, 0.2)
    x = torch.randn(12, C)
    r = router(x)
    chosen, weights = reference_group_limited_route(router, x)
    assert [sorted(e) for e in r.experts.tolist()] == chosen
    for n in range(12):
        want = torch.tensor([weights[n][int(e)] for e in r.experts[n]])
        torch.testing.assert_close(r.weights[n].detach(), want)
    r.weights.sum().backward()
    assert router.weight.grad.abs().sum() > 0


def test_group_limited_router_equals_transformers_deepseek_v3_router():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(
        hidden_size=C,
        n_routed_experts=E_GROUPED,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    theirs = DeepseekV3TopkRouter(config)
    torch.manual_seed(4)
    torch.nn.init.normal_(theirs.weight)
    theirs.e_score_correction_bias.normal_(0.0, 0.2)
    ours = Router(C, E_GROUPED, 3, "sigmoid", True, balance_bias=True, groups=4, top_groups=2, scaling=2.5)
    ours.load_state_dict({"weight": theirs.weight, "expert_bias": theirs.e_score_correction_bias})
    x = torch.randn(20, C)
    _, want_weights, want_experts = theirs(x)
    r = ours(x)
    order, want_order = r.experts.sort(-1), want_experts.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(r.weights.gather(1, order.indices), want_weights.gather(1, want_order.indices))


def test_routing_bias_without_updates_is_kept_and_the_groups_are_checked():
    moe = MoE(C, FF, num_experts=E_GROUPED, top_k=2, score_func="sigmoid", routing_bias=True, groups=2, top_groups=1)
    assert "gate.expert_bias" in moe.state_dict() and moe.bias_update_rate == 0.0
    with pytest.raises(ValueError):
        Router(C, 6, 2, "sigmoid", groups=4)
    with pytest.raises(ValueError):
        Router(C, E_GROUPED, 5, "sigmoid", groups=4, top_groups=1)
