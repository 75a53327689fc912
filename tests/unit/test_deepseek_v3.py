"""The DeepSeek-V3 family (``toolkit.models.deepseek_v3``): the named sizes against transformers' own
DeepseekV3ForCausalLM built on the meta device from the published configs; the tiny model's decoding through the
latent cache against its full forward; its training forward (the routers' terms, the dense first layer, the bias
kept and moved); the options it refuses; the sequence-wise balance loss by hand; multi-token prediction
(``--mtp-depth``): the depth's loss against the cross-entropy of the token two ahead computed from the model's pieces,
the tokens ahead of a context-parallel rank's chunks, training through the criterion (``mtp_loss`` logged apart,
both losses decreasing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from toolkit import models
from toolkit.core.errors import UserError
from toolkit.models.accounting import default_vocab_size
from toolkit.models.common.attention import KVCache, LatentAttention
from toolkit.models.common.moe import MoE
from toolkit.criterions.cross_entropy import CrossEntropyCriterion
from toolkit.distributed.context_parallel import ContextShard
from toolkit.models.common.attention import attention_mask
from toolkit.models.common.mtp import finetuning_depths, tokens_ahead
from toolkit.train.trainer import forward_and_loss

PUBLISHED = {  # the Hugging Face config.json values (MTP layers left out: the counts are at --mtp-depth 0)
    "deepseek_v3_671b": dict(),
    "moonlight_16b_a3b": dict(
        vocab_size=163840,
        hidden_size=2048,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=2,
        n_routed_experts=64,
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
    ),
    "kimi_k2": dict(
        vocab_size=163840,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_routed_experts=384,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    ),
}


class _Vocabulary:
    def __len__(self) -> int:
        return 64

    def pad(self) -> int:
        return 1


def meta_model(arch: str, **overrides):
    return models.build_on_meta(arch, default_vocab_size(arch), **overrides)


@pytest.mark.parametrize("arch", sorted(PUBLISHED))
def test_parameters_equal_the_published_models(arch):
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(**PUBLISHED[arch], num_nextn_predict_layers=0)
    with torch.device("meta"):
        theirs = transformers.DeepseekV3ForCausalLM(config)
    ours = meta_model(arch)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    cfg = ours.cfg
    moe_layers = cfg.decoder_layers - cfg.first_k_dense_replace
    idle = moe_layers * (cfg.moe_num_experts - cfg.moe_top_k) * 3 * cfg.decoder_embed_dim * cfg.moe_ffn_embed_dim
    assert ours.active_parameters() == sum(p.numel() for p in ours.parameters()) - idle
    assert [n for n, _ in ours.named_buffers() if n.endswith("expert_bias")] == [
        f"layers.{i}.mlp.gate.expert_bias" for i in range(cfg.first_k_dense_replace, cfg.decoder_layers)
    ]


def _tiny(**options):
    torch.manual_seed(0)
    task = SimpleNamespace(dictionary=_Vocabulary(), cfg=SimpleNamespace(tokens_per_sample=32))
    model = models.build_model("deepseek_v3_tiny", models.model_config("deepseek_v3_tiny", **options), task)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoE):
                m.gate.weight.normal_(0.0, 1.0)  # far from ties: the routes of the two computations agree
    return model


def test_decoding_through_the_latent_cache_equals_the_full_forward(monkeypatch):
    """A prompt, then one token at a time, in the absorbed form (no keys or values expanded: ``keys_values`` is
    not called): each layer's cache holds the latent and the shared rotary key per position (r + Dr = 24 numbers,
    where the expanded keys and values are H (Dn + Dr + Dv) = 144)."""
    model = _tiny().eval()
    tokens = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        monkeypatch.setattr(LatentAttention, "keys_values", None)
        state = {}
        pieces = [model(tokens[:, :5], incremental_state=state)]
        pieces += [model(tokens[:, t : t + 1], incremental_state=state) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)
    cache = state["layers"][0]
    assert isinstance(cache, KVCache) and [tuple(b.shape[1::2]) for b in cache.buffers] == [(1, 16), (1, 8)]
    attn = model.layers[0].self_attn
    assert isinstance(attn, LatentAttention) and attn.kv_width() == 24


def test_training_forward_has_a_dense_first_layer_and_the_routers_terms():
    model = _tiny(moe_bias_update_rate=0.001).train()
    assert not isinstance(model.layers[0].mlp, MoE) and all(isinstance(b.mlp, MoE) for b in model.layers[1:])
    logits, extra = model(torch.randint(3, 64, (2, 16)))
    assert set(extra["metrics"]) == {"moe_max_load_0", "moe_max_load_1", "moe_dropped"}
    logits.float().logsumexp(-1).mean().backward()
    layer = model.layers[1].mlp
    assert layer.gate.weight.grad.abs().sum() > 0 and layer.shared_experts.up_proj.weight.grad.abs().sum() > 0
    loads = layer.tokens_per_expert.clone()
    layer.after_optimizer_step()
    torch.testing.assert_close(layer.gate.expert_bias, 0.001 * torch.sign(loads.mean() - loads))


def test_without_updates_the_correction_bias_stays_where_it_was_loaded():
    model = _tiny().train()
    layer = model.layers[2].mlp
    layer.gate.expert_bias.fill_(0.25)
    model(torch.randint(3, 64, (2, 16)))
    layer.after_optimizer_step()
    assert torch.equal(layer.gate.expert_bias, torch.full((8,), 0.25))


@pytest.mark.parametrize(
    "options, flag",
    [
        (dict(moe_n_group=3), "--moe-n-group 3"),
        (dict(moe_topk_group=3), "--moe-n-group 2"),
        (dict(moe_top_k=5), "--moe-top-k 5"),
        (dict(qk_norm=True), "--qk-norm"),
        (dict(first_k_dense_replace=4), "--first-k-dense-replace 4"),
    ],
)
def test_impossible_options_are_refused_in_one_line(options, flag):
    with pytest.raises(UserError, match=f"^{flag}") as err:
        meta_model("deepseek_v3_tiny", **options)
    assert "\n" not in str(err.value)


def test_sequence_balance_loss_is_deepseeks_by_hand():
    """Two sequences of 2 tokens, 4 experts, top 2: per sequence sum_i f_i P_i, f_i = 4 / (2 x 2) x tokens routed
    to i, P_i = the mean normalized score; the mean over the sequences."""
    from toolkit.models.common.moe import sequence_balance_loss

    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    experts = torch.tensor([[0, 1], [1, 2], [2, 3], [0, 3]])
    # sequence 0: counts (1, 2, 1, 0), P = (0.25, 0.4, 0.25, 0.1): 1 x 0.25 + 2 x 0.4 + 1 x 0.25 = 1.3
    # sequence 1: counts (1, 0, 1, 2), P = (0.475, 0.175, 0.175, 0.175): 0.475 + 0.175 + 0.35 = 1.0
    want = torch.tensor((1.3 + 1.0) / 2)
    torch.testing.assert_close(sequence_balance_loss(probs.requires_grad_(), experts, 2), want)


def test_the_sequence_balance_loss_is_a_logged_term_of_its_coefficient():
    model = _tiny(moe_seq_aux_loss_coef=1e-3).train()
    _, extra = model(torch.randint(3, 64, (2, 16)))
    value, coefficient = extra["aux_losses"]["moe_seq_aux_loss"]
    assert coefficient == 1e-3 and value.requires_grad and 0.5 < value.item() < 4.0
    assert "moe_seq_aux_loss" not in _tiny().train()(torch.randint(3, 64, (2, 16)))[1]["aux_losses"]


# ---- multi-token prediction (toolkit.models.common.mtp) ----

PAD = 1


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 64, (2, 17), generator=g)
    target = tokens[:, 1:].clone()
    target[1, -3:] = PAD  # a right-padded row
    return tokens[:, :-1], target


def test_the_depth_predicts_the_token_two_ahead_from_the_next_ones_embedding():
    model = _tiny(mtp_depth=1, mtp_loss_coef=0.25).train()
    with torch.no_grad():  # away from 1: h^0 after the final norm differs from the stream before it
        model.norm.weight.normal_(1.0, 0.5, generator=torch.Generator().manual_seed(3))
    tokens, target = _batch()
    seen = {}
    model.norm.register_forward_hook(lambda module, args, out: seen.setdefault("hidden", out))  # h^0: normed
    _, extra = model(tokens, target=target)
    value, coefficient = extra["aux_losses"]["mtp_loss"]
    depth, T = model.mtp[0], tokens.size(1)
    joined = depth.eh_proj(torch.cat([depth.enorm(model.embed_tokens(target)), depth.hnorm(seen["hidden"])], -1))
    h = depth.layer(joined, model.rope_cos[:T], model.rope_sin[:T], attn_mask=attention_mask(None, T, head_dim=8))
    logits = model.output_projection(depth.norm(h))[:, :-1]  # the last position has no token two ahead
    want = F.cross_entropy(logits.reshape(-1, 64), target[:, 1:].reshape(-1), ignore_index=PAD)
    assert coefficient == 0.25
    torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6)
    model.eval()
    assert isinstance(model(tokens, target=target), torch.Tensor)  # evaluation: the decoder's logits alone


def test_tokens_ahead_of_a_context_parallel_rank_are_the_whole_rows():
    whole = torch.arange(100, 116).view(1, 16)
    for shift in (0, 1, 3):
        want = F.pad(whole[:, shift:], (0, shift), value=PAD)
        torch.testing.assert_close(tokens_ahead(whole, shift, PAD), want)
        for rank in range(2):
            shard = ContextShard(16, 2, rank, None, target=whole)
            got = tokens_ahead(whole[:, shard.query_index], shift, PAD, shard)
            torch.testing.assert_close(got, want[:, shard.query_index])


def test_training_logs_mtp_loss_apart_and_both_losses_decrease():
    """Adam on one batch through the criterion: ``loss`` is the next token's cross-entropy alone, the depth's
    mean loss logged as ``mtp_loss``; 6 updates lower both."""
    model = _tiny(mtp_depth=1, decoder_layers=2).train()
    criterion = CrossEntropyCriterion(SimpleNamespace(target_dictionary=SimpleNamespace(pad=lambda: PAD)))
    tokens, target = _batch(1)
    sample = {"net_input": {"src_tokens": tokens}, "target": target, "ntokens": int(target.ne(PAD).sum())}
    without = CrossEntropyCriterion.reduce_metrics([criterion(model(tokens), sample)[2]])  # no targets: no depth
    assert "mtp_loss" not in without
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    logged = []
    for _ in range(6):
        loss, sample_size, log = forward_and_loss(model, criterion, sample)
        optimizer.zero_grad()
        (loss / sample_size).backward()
        optimizer.step()
        logged.append(CrossEntropyCriterion.reduce_metrics([log]))
    first, last = logged[0], logged[-1]
    assert abs(first["loss"] - without["loss"]) < 1e-5 and first["mtp_loss"] > 0  # fused head against logits
    assert last["loss"] < first["loss"] - 0.5 and last["mtp_loss"] < first["mtp_loss"] - 0.3, (first, last)


def test_fine_tuning_leaves_out_or_adds_depths():
    """--finetune-from-model: a checkpoint's depths past the run's --mtp-depth are left out (one line naming the
    flag that keeps them), a run's depth the checkpoint lacks keeps the run's initialization, the rest loads as saved
    (a strict load); the same depths: the weights untouched."""
    one = _tiny(mtp_depth=1, decoder_layers=1)
    saved, plain = one.state_dict(), _tiny(decoder_layers=1)
    weights, line = finetuning_depths(plain, saved)
    assert weights.keys() == plain.state_dict().keys() and "1 left out (give --mtp-depth 1" in line
    deeper = _tiny(mtp_depth=2, decoder_layers=1)
    weights, line = finetuning_depths(deeper, saved)
    deeper.load_state_dict(weights)
    assert torch.equal(deeper.mtp[0].eh_proj.weight, saved["mtp.0.eh_proj.weight"]) and "1 start from" in line
    assert not torch.equal(deeper.mtp[1].eh_proj.weight, deeper.mtp[0].eh_proj.weight)
    assert finetuning_depths(one, saved) == (saved, None)
