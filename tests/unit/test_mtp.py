"""Multi-token prediction (``toolkit.models.common.mtp``) in the DeepSeek-V3 family (``--mtp-depth``): the depth's
loss equals the cross-entropy of the token two ahead computed here from the model's pieces (the embedding of the
token one ahead first in ``eh_proj``, the decoder's last hidden state before its norm, the depth's own norm, the
shared head, padding and the last position left out); the tokens ahead of a context-parallel rank's chunks are the
whole row's; training through the criterion logs ``mtp_loss`` apart from ``loss`` and both decrease; evaluation and
a forward without the targets runs no depth."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tests.unit.test_deepseek_v3 import _tiny
from toolkit.criterions.cross_entropy import CrossEntropyCriterion
from toolkit.distributed.context_parallel import ContextShard
from toolkit.models.common.attention import attention_mask
from toolkit.models.common.mtp import tokens_ahead
from toolkit.train.trainer import forward_and_loss

PAD = 1


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 64, (2, 17), generator=g)
    target = tokens[:, 1:].clone()
    target[1, -3:] = PAD  # a right-padded row
    return tokens[:, :-1], target


def test_the_depth_predicts_the_token_two_ahead_from_the_next_ones_embedding():
    model = _tiny(mtp_depth=1, mtp_loss_coef=0.25).train()
    tokens, target = _batch()
    seen = {}
    model.norm.register_forward_pre_hook(lambda module, args: seen.setdefault("hidden", args[0]))
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
