"""A random tiny Hugging Face ``Glm4MoeForCausalLM`` folder saved by transformers with a word-level tokenizer
(``hf_llama``'s): grouped-query attention with heads wider than width / heads, half of each rotated, QK-norm,
q/k/v biases, 8 routed experts in 2 groups (top 2 of them, from 1 group), a shared expert, the first layer dense,
and one multi-token prediction layer's tensors after the last layer, laid out as DeepSeek-V3's (``hf_deepseek``'s
``add_mtp_layers``: a MoE layer, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, the copies of the embedding
and the head), as GLM-4.5's checkpoints hold them; transformers leaves them out of the model.

The routers are drawn wide (std 1) so that each token's experts are far from ties; the correction bias, the q/k/v
biases and the QK-norm scales are drawn too, so that each of them is exercised. Import only after
``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import torch
import transformers
from tests.helpers.hf_deepseek import add_mtp_layers
from tests.helpers.hf_llama import save_tokenizer

CONFIG = dict(
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    partial_rotary_factor=0.5,
    use_qk_norm=True,
    attention_bias=True,
    n_shared_experts=1,
    n_routed_experts=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=64,
    initializer_range=0.3,
    tie_word_embeddings=False,
    num_nextn_predict_layers=1,
)
DRAWN = ("mlp.gate.weight", "_proj.bias", "_norm.weight")  # std 1 routers; biases and QK-norm scales away from 0/1


def make_hf_glm4_moe(folder: str):
    torch.manual_seed(0)
    ids = save_tokenizer(folder, "llama")
    config = transformers.Glm4MoeConfig(**CONFIG, **ids, pad_token_id=None)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(DRAWN):
                p.normal_(1.0 if name.endswith("_norm.weight") else 0.0, 0.3 if "norm" in name else 1.0)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    hf.save_pretrained(folder)
    add_mtp_layers(folder, hf, CONFIG["num_nextn_predict_layers"])
    return hf
