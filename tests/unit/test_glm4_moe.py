"""The GLM-4.5 family (``toolkit.models.glm4_moe``): the named sizes against transformers' own Glm4MoeForCausalLM
built on the meta device from the published configs (parameters, the correction-bias buffers, the active
count); the options it refuses."""

from __future__ import annotations

import pytest
import torch

from toolkit import models
from toolkit.core.errors import UserError
from toolkit.models.accounting import default_vocab_size

PUBLISHED = {  # zai-org/GLM-4.5 and GLM-4.5-Air config.json (the MTP layer left out: our model has none)
    "glm4_5": dict(
        hidden_size=5120,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=92,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        n_routed_experts=160,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        attention_bias=True,
        partial_rotary_factor=0.5,
        vocab_size=151552,
    ),
    "glm4_5_air": dict(
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=46,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        n_routed_experts=128,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        routed_scaling_factor=1.0,
        use_qk_norm=False,
        attention_bias=True,
        partial_rotary_factor=0.5,
        vocab_size=151552,
    ),
}


@pytest.mark.parametrize("arch", sorted(PUBLISHED))
def test_parameters_equal_the_published_models(arch):
    transformers = pytest.importorskip("transformers")
    config = transformers.Glm4MoeConfig(**PUBLISHED[arch], num_nextn_predict_layers=0)
    with torch.device("meta"):
        theirs = transformers.Glm4MoeForCausalLM(config)
    ours = models.build_on_meta(arch, default_vocab_size(arch))
    total = sum(p.numel() for p in ours.parameters())
    assert total == sum(p.numel() for p in theirs.parameters())
    cfg = ours.cfg
    moe_layers = cfg.decoder_layers - cfg.first_k_dense_replace
    idle = moe_layers * (cfg.moe_num_experts - cfg.moe_top_k) * 3 * cfg.decoder_embed_dim * cfg.moe_ffn_embed_dim
    assert ours.active_parameters() == total - idle
    assert sum(b.numel() for n, b in ours.named_buffers() if n.endswith("expert_bias")) == sum(
        b.numel() for n, b in theirs.named_buffers() if n.endswith("e_score_correction_bias")
    )
    print(arch, f"{total:,}", f"{ours.active_parameters():,}")


@pytest.mark.parametrize(
    "options, flag",
    [
        (dict(moe_n_group=3), "--moe-n-group"),
        (dict(moe_n_group=2, moe_topk_group=1, moe_top_k=5), "--moe-n-group"),
        (dict(first_k_dense_replace=3), "--first-k-dense-replace"),
    ],
)
def test_refuses_groups_and_dense_layers_that_do_not_fit(options, flag):
    with pytest.raises(UserError, match=flag):
        models.build_on_meta("glm4_moe_tiny", 64, **options)
