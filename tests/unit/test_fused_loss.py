"""The fused output layer + cross-entropy (toolkit.models.fused_loss) against the logits path it replaces:
the same summed loss and the same gradient of every parameter, with padding, tied and untied heads, chunks that
do not divide the rows; and the cases where the logits path stays."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import adaptive as adaptive_helpers
from toolkit.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from toolkit.data.dictionary import Dictionary
from toolkit.train.trainer import forward_and_loss
from toolkit.models import model_config
from toolkit.models.fused_loss import LossTarget, linear_cross_entropy
from toolkit.models.llama.model import LlamaLanguageModel
from toolkit.models.outputs import aux_losses_of, summed_nll_of
from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

PAD = 1  # Dictionary()'s pad, the models' padding_idx
V = 40
RTOL, ATOL = 1e-5, 1e-5  # fp32: the chunked sums round differently from one matmul


def reference_loss(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight).float(), target, ignore_index=PAD, reduction="sum")


def padded_targets(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(PAD + 1, V, (n,), generator=g)
    target[::5] = PAD
    return target


def unfused_then_fused(rows, chunk_rows, seed, scale=1.0, autocast=False):
    """(loss, d hidden, d weight) of the logits path, then of the fused one, for ``scale * loss``."""
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(rows, 16, generator=g), torch.randn(V, 16, generator=g)
    target = padded_targets(rows)
    out = []
    for fused in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = linear_cross_entropy(h, w, target, PAD, chunk_rows) if fused else reference_loss(h, w, target)
        (scale * loss).backward()
        out.append((loss.detach(), h.grad, w.grad))
    return out


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 1000])
def test_loss_and_both_gradients_equal_the_logits_path(chunk_rows):
    # the incoming gradient scales both (a loss scale, the update's normalization)
    unfused, fused = unfused_then_fused(64, chunk_rows, seed=0, scale=2.5)
    for ours, theirs in zip(fused, unfused):
        torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    assert fused[1][::5].abs().sum() == 0  # padded rows get no gradient


def test_logits_spread_past_the_exp_floor_are_as_exact_as_the_logits_path():
    """Rows whose logits lie hundreds apart (exp(z - max) underflows: the floor at EXP_FLOOR) lose nothing: the
    fused loss and gradients are as close to float64's as the fp32 logits path is."""
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(48, 16, generator=g), 40 * torch.randn(V, 16, generator=g)
    target = padded_targets(48)
    assert (F.linear(hidden, weight).amax(1, keepdim=True) - F.linear(hidden, weight)).max() > 200

    def loss_and_grads(dtype, fused):
        h, w = (t.detach().to(dtype).clone().requires_grad_() for t in (hidden, weight))
        loss = linear_cross_entropy(h, w, target, PAD, 16) if fused else reference_loss(h, w, target)
        loss.backward()
        return [t.detach().double() for t in (loss, h.grad, w.grad)]

    exact = loss_and_grads(torch.float64, fused=False)
    logits_path = loss_and_grads(torch.float32, fused=False)
    fused = loss_and_grads(torch.float32, fused=True)
    for ours, theirs, want in zip(fused, logits_path, exact):
        assert (ours - want).abs().max() <= 2 * (theirs - want).abs().max() + 1e-6 * want.abs().max()


def test_without_grad_it_is_the_loss_alone_and_a_dummy_batch_trains_nothing():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(10, 8, generator=g), torch.randn(V, 8, generator=g, requires_grad=True)
    target = padded_targets(10)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, target, PAD, 3)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference_loss(hidden, weight.detach(), target), rtol=RTOL, atol=ATOL)
    (linear_cross_entropy(hidden, weight, target, PAD, 3) * 0.0).backward()
    assert weight.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(hidden, weight, target[:-1], PAD)


def test_bf16_autocast_stays_close_to_the_autocast_logits_path():
    unfused, fused = unfused_then_fused(32, 8, seed=2, autocast=True)
    assert fused[1].dtype == fused[2].dtype == torch.float32  # gradients in the parameters' dtype
    for ours, theirs in zip(fused, unfused):
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)


# ---- through the criterion and the model families ----


def llama(**overrides):
    return LlamaLanguageModel(model_config("llama_tiny", max_target_positions=16, **overrides), V, PAD, seed=3)


def soft_capped():
    """Gemma 2's soft-cap of the logits (the gemma3 family's --final-logit-softcap): the fused softmax reads raw
    logits, so the logits path stays."""
    from toolkit.models.gemma3.model import Gemma3LanguageModel

    cfg = model_config("gemma3_tiny", max_target_positions=16, final_logit_softcap=30.0)
    return Gemma3LanguageModel(cfg, V, PAD, seed=3)


def transformer_lm(**overrides):
    values = dict(
        decoder_layers=2,
        decoder_embed_dim=32,
        decoder_ffn_embed_dim=64,
        decoder_attention_heads=4,
        max_target_positions=16,
        dropout=0.0,
    )
    return TransformerLanguageModel(TransformerLMConfig(**dict(values, **overrides)), V, PAD, seed=3)


def moe():
    from toolkit.models.moe.model import MoELanguageModel

    return MoELanguageModel(model_config("moe_tiny", max_target_positions=16), V, PAD, seed=3)


def criterion(chunk_rows, z_loss_coef=0.0):
    task = SimpleNamespace(target_dictionary=Dictionary())
    return CrossEntropyCriterion(
        task, CrossEntropyCriterionConfig(head_loss_chunk_rows=chunk_rows, z_loss_coef=z_loss_coef)
    )


def sample():
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(PAD + 1, V, (3, 12), generator=g)
    target = torch.roll(tokens, -1, 1)
    target[1, 8:] = PAD  # a shorter row, right-padded
    tokens[1, 9:] = PAD
    return {
        "net_input": {"src_tokens": tokens},
        "target": target,
        "ntokens": int(target.ne(PAD).sum()),
        "nsentences": 3,
    }


def loss_and_grads(model, crit):
    model.train()
    model.zero_grad(set_to_none=True)
    loss, sample_size, log = forward_and_loss(model, crit, sample())
    loss.backward()
    return loss.detach(), log, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "make",
    [
        lambda: llama(share_decoder_input_output_embed=True),
        lambda: llama(share_decoder_input_output_embed=False),
        lambda: transformer_lm(share_decoder_input_output_embed=True),
        lambda: transformer_lm(share_decoder_input_output_embed=False),
        moe,
    ],
    ids=["llama-tied", "llama-untied", "transformer_lm-tied", "transformer_lm-untied", "moe"],
)
def test_the_criterion_trains_the_same_fused_and_unfused(make, monkeypatch):
    from toolkit.models import decoder

    calls = []
    monkeypatch.setattr(decoder, "linear_cross_entropy", lambda *a: calls.append(a[-1]) or linear_cross_entropy(*a))
    model = make()
    assert model.supports_fused_loss
    unfused_loss, unfused_log, unfused = loss_and_grads(model, criterion(0))
    assert calls == []
    fused_loss, fused_log, fused = loss_and_grads(model, criterion(5))
    assert calls == [5]  # the fused head ran, 5 rows at a time
    torch.testing.assert_close(fused_loss, unfused_loss, rtol=RTOL, atol=ATOL)
    assert set(fused_log) == set(unfused_log)  # the model's router terms too (moe)
    assert fused.keys() == unfused.keys() and "embed_tokens.weight" in fused
    for name in unfused:
        torch.testing.assert_close(fused[name], unfused[name], rtol=RTOL, atol=ATOL, msg=name)


def test_the_model_returns_the_summed_nll_where_its_head_computes_the_loss():
    tokens, target = sample()["net_input"]["src_tokens"], sample()["target"]
    asked = LossTarget(target, PAD, 4)
    plain = llama()
    assert summed_nll_of(plain(tokens, loss_target=asked)) is not None
    assert plain(tokens).shape == (3, 12, V)  # not asked: logits, as before
    capped = soft_capped()
    assert capped(tokens, loss_target=asked).shape == (3, 12, V)
    adaptive, x = adaptive_helpers.model(), adaptive_helpers.tokens(T=12)  # an adaptive softmax: its own head's loss
    features = adaptive(x)
    assert features.size(-1) == adaptive_helpers.C
    own = adaptive(x, loss_target=LossTarget(x.roll(-1, 1), adaptive_helpers.PAD, 4))
    torch.testing.assert_close(
        summed_nll_of(own), adaptive.adaptive_softmax.loss(features, x.roll(-1, 1), adaptive_helpers.PAD)
    )
    with torch.autocast("cpu", dtype=torch.float16):  # fp16's loss scale must reach d logits before they are fp16
        assert plain(tokens, loss_target=asked).shape == (3, 12, V)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert summed_nll_of(plain(tokens, loss_target=asked)) is not None
    # a MoE model's routers' losses ride along with the fused NLL
    routed = moe().train()(tokens, loss_target=asked)
    assert summed_nll_of(routed) is not None and "moe_aux_loss" in aux_losses_of(routed)


def test_z_loss_and_a_soft_cap_keep_the_logits_path_and_its_loss():
    model = soft_capped()
    torch.testing.assert_close(loss_and_grads(model, criterion(5))[0], loss_and_grads(model, criterion(0))[0])
    with_z = loss_and_grads(llama(), criterion(5, z_loss_coef=1e-3))[1]
    assert "z_loss" in with_z  # the z-loss needs every logsumexp: the model was not asked to fuse
