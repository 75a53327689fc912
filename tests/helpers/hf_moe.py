"""Random tiny Hugging Face MoE folders (Qwen3-MoE, OLMoE, Mixtral: 4 experts, top 2) saved by transformers with a
tokenizer (``hf_llama``'s: Qwen's byte-level BPE for Qwen3-MoE, the word-level one that adds BOS otherwise).

The routers are drawn wide (std 1) so that each token's top 2 of 4 experts are far from ties: a route that
flips on a last-bit difference would make log-probs differ by more than rounding. Import only after
``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import torch
import transformers

from tests.helpers.hf_llama import save_tokenizer

SHAPES = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.3,
    tie_word_embeddings=False,
    num_experts_per_tok=2,
)
KINDS = {
    # per-head QK-norm, heads of 32 (not 64 / 4), renormalized top-k
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        "qwen3",
        dict(
            num_experts=4,
            moe_intermediate_size=32,
            head_dim=32,
            intermediate_size=96,
            norm_topk_prob=True,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
        ),
    ),
    # QK-norm over the whole projections, top-k weights not renormalized
    "olmoe": (transformers.OlmoeConfig, "llama", dict(num_experts=4, intermediate_size=48)),
    "mixtral": (
        transformers.MixtralConfig,
        "llama",
        dict(num_local_experts=4, intermediate_size=48, sliding_window=None),
    ),
}


def make_hf_moe(folder: str, kind: str):
    config_cls, tokenizer_kind, extra = KINDS[kind]
    torch.manual_seed(0)
    ids = save_tokenizer(folder, tokenizer_kind)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**SHAPES, **extra, **ids, pad_token_id=None)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight") and p.size(0) == 4:  # the routers
                p.normal_(0.0, 1.0)
    hf.save_pretrained(folder)
    return hf
