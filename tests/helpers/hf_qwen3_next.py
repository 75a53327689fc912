"""A random tiny Hugging Face ``Qwen3NextForCausalLM`` folder saved by transformers with a word-level tokenizer
(``hf_llama``'s), the shapes of ``qwen3_next_tiny`` (or Qwen3.5's text classes of the same shapes, or those as
the vision-language classes Qwen3.5 is released as, with a one-block vision tower and the processors' files): 4
layers (three gated DeltaNet, the last gated full attention with half of each head rotated), 4 experts of 16 (top 2) and a gated shared expert in every layer.

Each folder holds one multi-token prediction layer as the releases store it (``add_mtp_layer``; transformers ignores
``mtp.*``): a gated full-attention layer with the layers' MLP under ``mtp.layers.0.``, ``mtp.fc`` [C, 2C], the
zero-centered ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden`` and ``mtp.norm``, all drawn.

The routers are drawn wide (std 1) so that each token's experts are far from ties; the norms' scales, ``dt_bias``
and the shared expert's gate are drawn too (transformers initializes them to constants), so that a wrong key or a
(1 + w) read as w shows. Import only after ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import json
import os

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


CLASSES = {  # kind -> (config class, the values it does not take)
    "qwen3_next": ("Qwen3NextConfig", ()),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", ()),
    "qwen3_5": ("Qwen3_5TextConfig", ("num_experts", "num_experts_per_tok", "moe_intermediate_size")),
}


VISION_LANGUAGE = {  # kind -> (the released vision-language class, its config class, the text model's kind)
    "qwen3_5_vl": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config", "qwen3_5"),
    "qwen3_5_moe_vl": ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig", "qwen3_5_moe"),
}
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4)
MROPE = dict(mrope_section=[1, 1, 0], mrope_interleaved=True)  # of the 2 rotated frequencies, the second the height's


def _vision_language(kind: str, values: dict, ids: dict):
    """The released layout of the text model ``values``: a tiny vision tower beside it, M-RoPE's sections in its
    rotary settings; the dense one's embeddings tied at the top level only (its text_config says untied), as
    transformers ties them."""
    model_class, config_class, _ = VISION_LANGUAGE[kind]
    text = dict(values, **ids, pad_token_id=None, rope_parameters={**values["rope_parameters"], **MROPE})
    config = getattr(transformers, config_class)(
        text_config=text, vision_config=VISION, tie_word_embeddings=kind == "qwen3_5_vl"
    )
    return getattr(transformers, model_class)(config)


def save_processor_files(folder: str) -> None:
    """The image and video processors' settings a released folder ships beside its tokenizer (written as the
    releases write them: saving transformers' processors needs torchvision), and the tokenizer's processor class."""
    image = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processors = {
        "preprocessor_config.json": dict(image, image_processor_type="Qwen2VLImageProcessorFast"),
        "video_preprocessor_config.json": dict(image, video_processor_type="Qwen3VLVideoProcessor"),
    }
    for name, values in processors.items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(dict(values, processor_class="Qwen3VLProcessor"), f)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        tokenizer = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(tokenizer, processor_class="Qwen3VLProcessor"), f)


def make_hf_qwen3_next(folder: str, kind: str = "qwen3_next", **overrides):
    """A random ``kind`` (Qwen3-Next, Qwen3.5's MoE or dense text model, or either as released: ``qwen3_5_vl``,
    ``qwen3_5_moe_vl``) of the tiny shapes, saved with a tokenizer."""
    torch.manual_seed(0)
    ids = save_tokenizer(folder, "llama" if kind == "qwen3_next" else "qwen")  # AutoTokenizer reads Qwen3.5's as Qwen's
    text_kind = VISION_LANGUAGE[kind][2] if kind in VISION_LANGUAGE else kind
    config_class, absent = CLASSES[text_kind]
    values = {k: v for k, v in {**CONFIG, **overrides}.items() if k not in absent}
    if text_kind == "qwen3_5":
        values.pop("shared_expert_intermediate_size")
    if kind in VISION_LANGUAGE:
        hf = _vision_language(kind, values, ids).eval()
        save_processor_files(folder)
    else:
        config = getattr(transformers, config_class)(**values, **ids, pad_token_id=None)
        hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith(("norm.weight", "dt_bias", "shared_expert_gate.weight")):
                p.normal_(0.0 if "layernorm" in name or "q_norm" in name or "k_norm" in name else 1.0, 0.3)
    hf.save_pretrained(folder)
    add_mtp_layer(folder, hf)
    return hf


def add_mtp_layer(folder: str, hf) -> None:
    """Qwen's layout of the MTP layer (named as the full-attention layer 3's tensors under ``mtp.layers.0.``) and
    ``mtp_num_hidden_layers`` 1 in config.json."""
    import json

    from safetensors.torch import load_file, save_file

    path, C = f"{folder}/model.safetensors", hf.config.get_text_config().hidden_size
    tensors = load_file(path)
    text = "model.language_model." if any(k.startswith("model.language_model.") for k in tensors) else "model."
    layer = f"{text}layers.3."  # a released vision-language folder's text model is under model.language_model.
    full = {k[len(layer) :]: t.shape for k, t in tensors.items() if k.startswith(layer)}
    own = {f"mtp.{n}.weight": (C,) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    own["mtp.fc.weight"] = (C, 2 * C)
    g = torch.Generator().manual_seed(5)
    for name, shape in {**{f"mtp.layers.0.{k}": v for k, v in full.items()}, **own}.items():
        scale = 1.0 if name.endswith("mlp.gate.weight") else 0.2  # the router wide, as the other layers'
        tensors[name] = torch.randn(shape, generator=g) * scale
    save_file(tensors, path, metadata={"format": "pt"})
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    if "text_config" in config:  # the released folders name it in the text model's config
        config["text_config"]["mtp_num_hidden_layers"] = 1
    else:
        config["mtp_num_hidden_layers"] = 1
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f, indent=2)
