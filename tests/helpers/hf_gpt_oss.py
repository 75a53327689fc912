"""A random tiny Hugging Face ``GptOssForCausalLM`` folder saved by transformers with a tokenizer in the manner of
the release's harmony one (o200k_harmony: a byte-level BPE, the harmony format's markers as special tokens,
``<|return|>`` the end of a generation, ``<|endoftext|>`` the padding, no BOS added), and the same model as the
release stores it (experts in MXFP4 blocks and scales).

2 layers of 32 (a local layer with a window of 4, then a global one), 4 heads of 8 on 2 key/value heads, 4
experts of 32, top 2, YaRN with the ramp's ends unrounded (``truncate`` false, as released) over an original
context of 16, the SwiGLU clamped at 2 (not 7: at this size the clamp would never bind). Routers are drawn wide
(std 1) so each token's top 2 are far from ties; every bias and sink is drawn (transformers starts them at 0).
Import only after ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import json
import os
import string

import tokenizers
import torch
import transformers

from tests.helpers.hf_llama import QWEN2_MERGES
from toolkit.models.gpt_oss import mxfp4

VOCAB_SIZE = 64  # rows past the tokenizer's ids stay unused, as the release's 201,088 past o200k_harmony's
CONFIG = dict(
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    max_position_embeddings=64,
    vocab_size=VOCAB_SIZE,
    initializer_range=0.3,
    swiglu_limit=2.0,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=4.0,
        original_max_position_embeddings=16,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    ),
)
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


#: the harmony format's markers (o200k_harmony's special tokens), in the release's order
HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>"]
HARMONY += ["<|message|>", "<|call|>"]


def save_harmony_tokenizer(folder: str) -> dict:
    """A byte-level BPE (lowercase letters, digits, then ``hf_llama``'s merges), the harmony markers as special tokens after them;
    the config's token ids."""
    chars = list(string.ascii_lowercase) + ["\u0120"] + [str(i) for i in range(10)]
    vocab = {tok: i for i, tok in enumerate(chars + ["".join(m) for m in QWEN2_MERGES])}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, QWEN2_MERGES))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(HARMONY)
    names = dict(bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **names).save_pretrained(folder)
    ids = {name: tok.token_to_id(token) for name, token in names.items()}
    return dict(bos_token_id=ids["bos_token"], eos_token_id=ids["eos_token"], pad_token_id=ids["pad_token"])


def make_hf_gpt_oss(folder: str):
    torch.manual_seed(0)
    ids = save_harmony_tokenizer(folder)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**CONFIG, **ids)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith(("bias", "sinks")):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(folder)
    return hf


def save_mxfp4(hf, folder: str) -> None:
    """``hf``'s folder as the release stores it: the experts' matrices [E, out, in] as MXFP4 blocks and scales
    (``*_blocks``, ``*_scales``), everything else as it is, ``quantization_config`` mxfp4."""
    from safetensors.torch import save_file

    hf.config.save_pretrained(folder)
    state = {}
    for name, tensor in hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.quantize(tensor.transpose(1, 2))
            state[name + "_blocks"], state[name + "_scales"] = blocks, scales
        else:
            state[name] = tensor.detach().clone().contiguous()
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = MXFP4_CONFIG
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    save_harmony_tokenizer(folder)
