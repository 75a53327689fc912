"""A random tiny Hugging Face ``Qwen3NextForCausalLM`` folder saved by transformers with a word-level tokenizer
(``hf_llama``'s), the shapes of ``qwen3_next_tiny``: 4 layers (three gated DeltaNet, the last gated full attention
with half of each head rotated), 4 experts of 16 (top 2) and a gated shared expert in every layer.

The routers are drawn wide (std 1) so that each token's experts are far from ties; the norms' scales, ``dt_bias``
and the shared expert's gate are drawn too (transformers initializes them to constants), so that a wrong key or a
(1 + w) read as w shows. Import only after ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import torch
import transformers

from tests.helpers.hf_llama import save_tokenizer

CONFIG = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    max_position_embeddings=128,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    initializer_range=0.1,
    tie_word_embeddings=False,
)


def make_hf_qwen3_next(folder: str, **overrides):
    torch.manual_seed(0)
    ids = save_tokenizer(folder, "llama")
    config = transformers.Qwen3NextConfig(**{**CONFIG, **overrides}, **ids, pad_token_id=None)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith(("norm.weight", "dt_bias", "shared_expert_gate.weight")):
                p.normal_(0.0 if "layernorm" in name or "q_norm" in name or "k_norm" in name else 1.0, 0.3)
    hf.save_pretrained(folder)
    return hf
