"""Random tiny Hugging Face folders of the Llama family (Llama 3, Qwen2, Qwen3 with and without a local layer,
Mistral with and without a sliding window, OLMo 2): Llama and Mistral with a word-level tokenizer, Qwen2 and Qwen3 with a byte-level BPE
whose tokenizer.json lacks Qwen2's digit splitting (as
transformers 5 builds it, ``Qwen2Tokenizer`` splits digits anyway: ``AutoTokenizer`` gives other ids than the file).

Import only after ``pytest.importorskip("transformers")`` / ``("tokenizers")``: the optional extras are
imported here at module level.
"""

from __future__ import annotations

import tokenizers
import torch
import transformers

WORDS = [f"w{i}" for i in range(60)]
SHAPES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    initializer_range=0.3,
)
KINDS = {
    "llama": (
        transformers.LlamaConfig,
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        dict(num_key_value_heads=1, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6),
    ),
    "mistral": (transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=None)),
    # QK-norm, heads of 32 (not 64 / 4), untied
    "qwen3": (
        transformers.Qwen3Config,
        dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6),
    ),
    # every position sees the last 6 (the tests' texts are longer)
    "mistral_window": (transformers.MistralConfig, dict(num_key_value_heads=2, sliding_window=6)),
    # layer 0 global, layer 1 local within the last 6 positions (use_sliding_window from max_window_layers on)
    "qwen3_window": (
        transformers.Qwen3Config,
        dict(
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
        ),
    ),
    # norms after attention and the MLP, QK-norm over the whole projections, GQA
    "olmo2": (
        transformers.Olmo2Config,
        dict(num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=500000.0),
    ),
    # a local layer (window 6) then a global one, each with its rotary base; soft-capped scores and logits
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            num_key_value_heads=2,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=30.0,
            final_logit_softcapping=20.0,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
}
WINDOW = 6


#: Qwen2's test BPE: characters, then merges of which "1 7" and "1 2" join digits (Qwen2Tokenizer never does)
QWEN2_MERGES = [("\u0120", "w"), ("1", "7"), ("1", "2"), ("5", "9")]


def save_qwen2_tokenizer(folder: str) -> dict:
    """A byte-level BPE, end-of-text last, no BOS; GPT-2's pre-tokenizer (digits kept together)."""
    chars = ["w", "z", "\u0120"] + [str(i) for i in range(10)]
    vocab = {tok: i for i, tok in enumerate(chars + ["".join(m) for m in QWEN2_MERGES] + ["<|endoftext|>"])}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, QWEN2_MERGES))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    names = dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **names).save_pretrained(folder)
    return dict(
        bos_token_id=None, eos_token_id=vocab["<|endoftext|>"], vocab_size=len(vocab) + 48
    )  # unused rows, as Qwen2 has


#: role names a chat template writes as words (the word-level tokenizer knows them when given a chat template)
ROLE_WORDS = ["system", "user", "assistant", "tool"]
#: a chat template in the manner of Llama's: BOS, then each turn as its role, its content and EOS; the assistant's
#: content and EOS inside {% generation %} marks
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}assistant "
    "{% generation %}{{ m['content'] }} {{ eos_token }}{% endgeneration %} "
    "{% else %}{{ m['role'] }} {{ m['content'] }} {{ eos_token }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
#: the same template without the marks (prefix rendering finds the assistant turns)
UNMARKED_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def save_tokenizer(folder: str, kind: str, chat_template: str = None) -> dict:
    """A word-level tokenizer: Llama/Mistral's specials first (<unk> 0, <s> 1, </s> 2) and BOS added, with the role
    words and ``chat_template`` when one is given; Qwen2's and Qwen3's: :func:`save_qwen2_tokenizer`."""
    if kind.startswith("qwen"):
        return save_qwen2_tokenizer(folder)
    words = WORDS + (ROLE_WORDS if chat_template else [])
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>"] + words)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=chat_template
    )
    fast.save_pretrained(folder)
    return dict(bos_token_id=1, eos_token_id=2, vocab_size=len(vocab))


def make_hf(folder: str, kind: str, chat_template: str = None, **overrides):
    """A random model of ``kind`` with its tokenizer (and ``chat_template``, Llama's word-level tokenizer only);
    ``overrides`` replace config values (vocab_size, rope_scaling)."""
    config_cls, extra = KINDS[kind]
    torch.manual_seed(0)
    ids = save_tokenizer(folder, kind, chat_template)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**{**SHAPES, **extra, **ids, **overrides})).eval()
    hf.save_pretrained(folder)
    return hf


def greedy_pair(model, hf, prompt: torch.Tensor, steps: int):
    """(transformers' ``generate(do_sample=False)`` tokens, ours through the KV cache) after ``prompt``; EOS is
    never picked (``min_new_tokens``: transformers masks it, so ours is masked too)."""
    with torch.no_grad():
        want = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=steps,
            do_sample=False,
            min_new_tokens=steps,
            pad_token_id=0,
        )[0, prompt.size(1) :].tolist()
        state, got = {}, []
        logits = model(prompt, incremental_state=state)
        for _ in range(steps):
            got.append(int(logits[0, -1].index_fill(0, torch.tensor([hf.config.eos_token_id]), -1e9).argmax()))
            logits = model(torch.tensor([[got[-1]]]), incremental_state=state)
    return want, got


# --- malformed folders: what a hand edit, a cut download or a wrong file make of one (each a one-line refusal) ---


def _edit_config(change):
    def edit(folder: str) -> None:
        import json

        path = f"{folder}/config.json"
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(change(config), f)

    return edit


def _write(name: str, text: str):
    def write(folder: str) -> None:
        with open(f"{folder}/{name}", "w", encoding="utf-8") as f:
            f.write(text)

    return write


def _cut_weights(folder: str) -> None:
    import os

    path = f"{folder}/model.safetensors"
    os.truncate(path, os.path.getsize(path) // 2)


def _edit_weights(change):
    """A damage that rewrites model.safetensors with ``change(tensors)`` (a dict of name -> tensor)."""

    def edit(folder: str) -> None:
        from safetensors.torch import load_file, save_file

        path = f"{folder}/model.safetensors"
        save_file(change(load_file(path)), path, metadata={"format": "pt"})

    return edit


def drop_tensor(name: str):
    """A damage: the folder's weights without tensor ``name`` (a download cut between tensors, a bad merge)."""
    return _edit_weights(lambda tensors: {k: v for k, v in tensors.items() if k != name})


def nan_in(name: str):
    """A damage: one value of tensor ``name`` NaN."""

    def change(tensors):
        tensors[name].view(-1)[0] = float("nan")
        return tensors

    return _edit_weights(change)


def index_naming(shard: str):
    """A damage: model.safetensors replaced by an index whose weight_map sends every tensor to ``shard`` (a path
    that leaves the folder; the real file is moved there when it is a plain ``../`` path, so only the refusal
    stops the read)."""

    def damage(folder: str) -> None:
        import json
        import os

        from safetensors import safe_open

        path = f"{folder}/model.safetensors"
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
        target = os.path.normpath(os.path.join(folder, shard))
        if not os.path.isabs(shard) and not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(path, target)
        else:
            os.unlink(path)
        with open(f"{folder}/model.safetensors.index.json", "w", encoding="utf-8") as f:
            json.dump({"metadata": {}, "weight_map": {n: shard for n in names}}, f)

    return damage


def edit_config(change):
    """A damage: config.json as ``change(config)`` returns it (``change`` may edit the dict in place)."""
    return _edit_config(lambda config: change(config) or config)


def _without(key: str):
    return lambda config: {k: v for k, v in config.items() if k != key}


#: name -> (how the folder is damaged, the file the refusal names, a fragment of what it says)
MALFORMED = {
    "config-not-json": (_write("config.json", "{not json"), "config.json", "JSONDecodeError"),
    "config-a-list": (_write("config.json", "[1, 2]"), "config.json", "holds a JSON list, not an object"),
    "config-no-layers": (_edit_config(_without("num_hidden_layers")), "config.json", "no num_hidden_layers"),
    "config-layers-a-string": (
        _edit_config(lambda c: dict(c, num_hidden_layers="two")),
        "config.json",
        "num_hidden_layers 'two'; these are counts",
    ),
    "config-llama3-rope-cut": (
        _edit_config(lambda c: dict(c, rope_scaling={"rope_type": "llama3", "factor": 8.0})),
        "config.json",
        "rope_scaling of rope_type llama3 has no low_freq_factor",
    ),
    "config-rope-factor-a-list": (
        _edit_config(
            lambda c: dict(
                c,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": [8],
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            )
        ),
        "config.json",
        "TypeError",
    ),
    "half-a-safetensors-file": (_cut_weights, "model.safetensors", "SafetensorError"),
    "tokenizer-garbage": (_write("tokenizer.json", "garbage{"), "tokenizer.json", "expected value"),
    "tokenizer-config-not-json": (_write("tokenizer_config.json", "{x"), "tokenizer_config.json", "JSONDecodeError"),
    "index-not-json": (_write("model.safetensors.index.json", "{x"), "model.safetensors.index.json", "JSONDecodeError"),
}


def malformed_copy(base: str, folder: str, name: str) -> str:
    """A copy of the Llama folder ``base`` at ``folder`` damaged as ``MALFORMED[name]`` says."""
    import shutil

    shutil.copytree(base, folder)
    MALFORMED[name][0](folder)
    return folder
