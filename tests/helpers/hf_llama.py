"""Random tiny Hugging Face folders of the Llama family (Llama 3, Qwen2, Mistral) with a word-level tokenizer.

Import only after ``pytest.importorskip("transformers")`` / ``("tokenizers")``: the optional extras are
imported here at module level.
"""
from __future__ import annotations

import tokenizers
import torch
import transformers

WORDS = [f"w{i}" for i in range(60)]
SHAPES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, initializer_range=0.3)
KINDS = {
    "llama": (transformers.LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
                                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 16})),
    "qwen2": (transformers.Qwen2Config, dict(num_key_value_heads=1, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                             rope_theta=1e6)),
    "mistral": (transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=None)),
}


def save_tokenizer(folder: str, kind: str) -> dict:
    """A word-level tokenizer: Llama/Mistral's specials first (<unk> 0, <s> 1, </s> 2) and BOS added;
    Qwen2's end-of-text last, no BOS."""
    specials = ["<unk>", "<s>", "</s>"] if kind != "qwen2" else []
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + (["<|endoftext|>"] if kind == "qwen2" else []))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>" if specials else None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    if kind == "qwen2":
        names = dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    else:
        tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        names = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **names)
    fast.save_pretrained(folder)
    ids = {"bos_token_id": None if kind == "qwen2" else 1, "eos_token_id": vocab.get("<|endoftext|>", 2)}
    return dict(ids, vocab_size=len(vocab) + (7 if kind == "qwen2" else 0))


def make_hf(folder: str, kind: str):
    config_cls, extra = KINDS[kind]
    torch.manual_seed(0)
    ids = save_tokenizer(folder, kind)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**SHAPES, **extra, **ids)).eval()
    hf.save_pretrained(folder)
    return hf
