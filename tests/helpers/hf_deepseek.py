"""A random tiny Hugging Face ``DeepseekV3ForCausalLM`` folder saved by transformers with a word-level tokenizer
(``hf_llama``'s): multi-head latent attention with the q low-rank path, 8 routed experts in 2 groups (top 2 of
them, from 1 group), a shared expert, the first layer dense, YaRN with DeepSeek's mscale, interleaved rotary
features (transformers' default for the class).

The routers are drawn wide (std 1) so that each token's experts are far from ties: a route that flips on a
last-bit difference would make log-probs differ by more than rounding; the correction bias is drawn too, so
that choosing by the biased scores and weighting by the unbiased ones is exercised. Import only after
``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import torch
import transformers

from tests.helpers.hf_llama import save_tokenizer

CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=12,
    qk_nope_head_dim=16,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=64,
    initializer_range=0.3,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_nextn_predict_layers=0,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=16,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
)


def make_hf_deepseek(folder: str, mtp_layers: int = 0, **overrides):
    """The folder; with ``mtp_layers``, that many multi-token prediction layers after the decoder's, drawn at random
    and stored as DeepSeek's checkpoints store them (transformers builds and saves none)."""
    torch.manual_seed(0)
    ids = save_tokenizer(folder, "llama")
    overrides = dict(overrides, num_nextn_predict_layers=mtp_layers)
    config = transformers.DeepseekV3Config(**{**CONFIG, **overrides}, **ids, pad_token_id=None)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    hf.save_pretrained(folder)
    if mtp_layers:
        add_mtp_layers(folder, hf, mtp_layers)
    return hf


def add_mtp_layers(folder: str, hf, count: int) -> None:
    """DeepSeek-V3's layout of a multi-token prediction layer N+k: a MoE decoder layer's tensors (named as the saved
    layer 1's), ``enorm``, ``hnorm``, ``eh_proj`` [C, 2C], ``shared_head.norm``, copies of the embedding and head."""
    from safetensors.torch import load_file, save_file

    path = f"{folder}/model.safetensors"
    tensors, C, N = load_file(path), hf.config.hidden_size, hf.config.num_hidden_layers
    moe_layer = {k[len("model.layers.1.") :]: t.shape for k, t in tensors.items() if k.startswith("model.layers.1.")}
    g = torch.Generator().manual_seed(5)
    for k in range(count):
        own = dict(moe_layer, **{"enorm.weight": (C,), "hnorm.weight": (C,), "shared_head.norm.weight": (C,)})
        own["eh_proj.weight"] = (C, 2 * C)
        for name, shape in own.items():
            scale = 1.0 if name.endswith("gate.weight") else 0.1  # the router wide, as the other layers'
            tensors[f"model.layers.{N + k}.{name}"] = torch.randn(shape, generator=g) * scale
        tensors[f"model.layers.{N + k}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"model.layers.{N + k}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
