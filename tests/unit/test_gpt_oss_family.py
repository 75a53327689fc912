"""The gpt-oss family (``toolkit.models.gpt_oss``): the named sizes against transformers' own models built on the
meta device (total parameters; active ones against a direct count of the idle experts); MXFP4 blocks and scales
read as transformers' ``convert_moe_packed_tensors`` reads them, and written back byte for byte; the router's
weights as gpt-oss's (softmax over the top-k logits); what the family does not compute is refused in one line."""

from __future__ import annotations

import pytest
import torch

from toolkit import models
from toolkit.core.errors import UserError
from toolkit.models.gpt_oss import mxfp4

PUBLISHED = {"gpt_oss_20b": dict(num_hidden_layers=24, num_local_experts=32), "gpt_oss_120b": {}}


@pytest.mark.parametrize("arch", sorted(PUBLISHED))
def test_total_and_active_parameters_equal_the_published_models(arch):
    """transformers' GptOssConfig defaults are gpt-oss-120b's; gpt-oss-20b has 24 layers of 32 experts."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf_model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**PUBLISHED[arch]))
    hf_total = sum(p.numel() for p in hf_model.parameters())
    ours = models.build_on_meta(arch, 201088, tokens_per_sample=4096)
    assert sum(p.numel() for p in ours.parameters()) == hf_total
    cfg = ours.cfg
    C, F = cfg.decoder_embed_dim, cfg.moe_ffn_embed_dim
    per_expert = 3 * C * F + 2 * F + C  # gate, up, down and their biases
    idle = cfg.decoder_layers * (cfg.moe_num_experts - cfg.moe_top_k) * per_expert
    assert ours.active_parameters() == hf_total - idle
    assert ours.layers[0].self_attn.window == 128 and ours.layers[1].self_attn.window is None


def test_mxfp4_reads_as_transformers_and_writes_back_byte_for_byte():
    pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 132, (3, 8, 2), dtype=torch.uint8, generator=gen)
    ours = mxfp4.dequantize(blocks, scales)  # [E, rows, 64]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transposed: [E, 64, rows]
    assert torch.equal(ours, theirs.transpose(1, 2))
    again_blocks, again_scales = mxfp4.quantize(ours)
    assert torch.equal(mxfp4.dequantize(again_blocks, again_scales), ours)  # random blocks: other encodings
    weights = torch.randn(8, 4, 64, generator=gen)
    blocks, scales = mxfp4.quantize(weights)
    approx = mxfp4.dequantize(blocks, scales)
    again = mxfp4.quantize(approx)  # what it writes, read and written again: the same bytes
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)
    largest = torch.maximum(blocks & 7, (blocks >> 4) & 7).amax(-1)  # each block's largest code (5: 3, 7: 6)
    assert largest.min() == 5  # blocks with their largest at 3 among them: their scale kept
    negative_zero = torch.where(torch.arange(64) < 32, -0.0, 1.0).expand(2, 64)
    assert mxfp4.quantize(negative_zero)[0][0, 0, 0].item() == 0x88  # the sign bit of -0 kept, as stored
    step = torch.exp2(torch.ceil(torch.log2(weights.view(8, 4, 2, 32).abs().amax(-1) / 6)))  # a block's unit
    assert ((approx - weights).abs().view(8, 4, 2, 32) <= step.unsqueeze(-1)).all()  # half the widest gap, 2 units


def test_router_weights_are_the_softmax_of_the_top_k_logits():
    from toolkit.models.gpt_oss.model import TopKLogitRouter

    torch.manual_seed(0)
    router = TopKLogitRouter(8, 4, 2)
    torch.nn.init.normal_(router.weight)
    torch.nn.init.normal_(router.bias)
    x = torch.randn(5, 8)
    routing = router(x)
    logits = x @ router.weight.t() + router.bias
    top = logits.topk(2, dim=-1)
    assert torch.equal(routing.experts, top.indices)
    torch.testing.assert_close(routing.weights, top.values.softmax(-1))


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(moe_score_func="sigmoid"), "softmax over the top-k logits"),
        (dict(attention_qkv_bias=False), "biases on q, k, v and o"),
        (dict(moe_swiglu_limit=-1.0), "--moe-swiglu-limit -1.0: must be above 0"),
    ],
)
def test_what_the_family_does_not_compute_is_refused(overrides, fragment):
    with pytest.raises(UserError, match=fragment) as err:
        models.build_on_meta("gpt_oss_tiny", 64, tokens_per_sample=16, **overrides)
    assert "\n" not in str(err.value)


def test_the_import_logs_flags_that_rebuild_the_model():
    """The fine-tune command an import prints turns the YaRN rounding off with its --no- form."""
    import shlex

    from toolkit.core import registry
    from toolkit.models.hf_checkpoint import training_flags
    from toolkit.train.arguments import parse_train_args

    registry.declare_builtin_components()  # as the commands do
    given = dict(rope_yarn_truncate=False, moe_swiglu_limit=2.0, sliding_window=4)
    flags = training_flags("gpt_oss", given)
    assert "--no-rope-yarn-truncate" in flags
    args, _ = parse_train_args(["data-bin"] + shlex.split(flags))
    assert (args.arch, args.rope_yarn_truncate, args.moe_swiglu_limit) == ("gpt_oss", False, 2.0)


def test_the_tensor_parallel_plan_splits_the_sinks_and_q_k_v_biases_with_the_heads():
    """What toolkit-plan counts 1/M of: each layer's sinks (Shard(0), as q_proj's heads) and q/k/v's weights and
    biases; o_proj's bias stays whole (added once after the row-parallel reduce), as do the experts (ep's)."""
    from toolkit.distributed.tensor_parallel import split_parameters

    model = models.build_on_meta("gpt_oss_tiny", 64, tokens_per_sample=16)
    assert model.tensor_parallel_plan().block["self_attn"] == "attention_sinks"
    split = split_parameters(model)
    for i in range(len(model.layers)):
        attention = f"layers.{i}.self_attn"
        heads = {f"{attention}.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")}
        assert {f"{attention}.sinks"} | heads <= split
        assert f"{attention}.o_proj.weight" in split and f"{attention}.o_proj.bias" not in split
    assert not any(".mlp." in name for name in split)
