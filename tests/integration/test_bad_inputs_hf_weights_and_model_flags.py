"""The bad-input catalogue: Hugging Face folders that would import an incomplete or impossible model, an index that
reaches outside the folder, and the model flags whose impossible values trained (or died) instead of stopping.

Every case keeps the catalogue's promise (``tests.helpers.bad_inputs.check_bad_input``): exit 1, one
``prog: error:`` line with the fragment, no traceback, every prepared file byte-identical. The folders are the
tiny random ones of ``tests/helpers/hf_llama.py`` and ``hf_moe.py`` (and a GPT-2), each damaged one way.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.bad_inputs import MODEL, check_bad_input

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests.helpers.hf_llama import drop_tensor, edit_config, index_naming, make_hf, nan_in  # noqa: E402
from tests.helpers.hf_moe import make_hf_moe  # noqa: E402

TRAIN, EXPORT, PLAN = "toolkit_cli.train", "toolkit_cli.export", "toolkit_cli.plan"
EXPERT = "model.layers.0.mlp.experts.1.down_proj.weight"


def _rope(**values):
    return edit_config(lambda c: c["rope_parameters"].update(values))


def _yarn(**values):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e4}
    return edit_config(lambda c: c.update(rope_parameters={**scaling, **values}))


#: name -> (the folder damaged, how, the file the refusal names (in the damaged copy), what it says)
DAMAGED = {
    # every tensor the model needs comes from the folder (every family: the check is the shared reader's)
    "olmoe-expert-missing": ("olmoe", drop_tensor(EXPERT), "model.safetensors", f"no tensor {EXPERT}"),
    "qwen3-moe-expert-missing": (
        "qwen3_moe",
        drop_tensor("model.layers.1.mlp.experts.3.gate_proj.weight"),
        "model.safetensors",
        "no tensor model.layers.1.mlp.experts.3.gate_proj.weight",
    ),
    "mixtral-expert-missing": (
        "mixtral",
        drop_tensor("model.layers.1.block_sparse_moe.experts.0.w2.weight"),
        "model.safetensors",
        "no tensor model.layers.1.block_sparse_moe.experts.0.w2.weight",
    ),
    "llama-norm-missing": (
        "llama",
        drop_tensor("model.norm.weight"),
        "model.safetensors",
        "no tensor model.norm.weight",
    ),
    "qwen3-qk-norm-missing": (
        "qwen3",
        drop_tensor("model.layers.1.self_attn.k_norm.weight"),
        "model.safetensors",
        "no tensor model.layers.1.self_attn.k_norm.weight",
    ),
    "olmo2-norm-missing": (
        "olmo2",
        drop_tensor("model.layers.0.post_feedforward_layernorm.weight"),
        "model.safetensors",
        "no tensor model.layers.0.post_feedforward_layernorm.weight",
    ),
    "gemma3-norm-missing": (
        "gemma3",
        drop_tensor("model.layers.1.pre_feedforward_layernorm.weight"),
        "model.safetensors",
        "no tensor model.layers.1.pre_feedforward_layernorm.weight",
    ),
    # NaN weights
    "olmoe-nan-expert": (
        "olmoe",
        nan_in("model.layers.1.mlp.experts.2.up_proj.weight"),
        "model.safetensors",
        "tensor model.layers.1.mlp.experts.2.up_proj.weight holds 1 NaN/infinite value(s)",
    ),
    "llama-nan-weight": (
        "llama",
        nan_in("model.layers.0.self_attn.q_proj.weight"),
        "model.safetensors",
        "tensor model.layers.0.self_attn.q_proj.weight holds 1 NaN",
    ),
    "gemma3-nan-weight": (
        "gemma3",
        nan_in("model.layers.1.mlp.down_proj.weight"),
        "model.safetensors",
        "tensor model.layers.1.mlp.down_proj.weight holds 1 NaN",
    ),
    "gpt2-nan-weight": (
        "gpt2",
        nan_in("transformer.h.0.mlp.c_fc.bias"),
        "model.safetensors",
        "tensor transformer.h.0.mlp.c_fc.bias holds 1 NaN",
    ),
    # the index never leads outside --path
    "index-parent-folder": (
        "llama",
        index_naming("../elsewhere/model.safetensors"),
        "model.safetensors.index.json",
        "weight_map names '../elsewhere/model.safetensors', not a file inside",
    ),
    "index-absolute-path": (
        "llama",
        index_naming("/etc/hostname"),
        "model.safetensors.index.json",
        "weight_map names '/etc/hostname', not a file inside",
    ),
    "index-user-blob": (
        "llama",
        index_naming("../../user/blob.bin"),
        "model.safetensors.index.json",
        "weight_map names '../../user/blob.bin'",
    ),
    # what toolkit-train refuses, refused at import naming the config key
    "rope-theta-negative": (
        "llama",
        _rope(rope_theta=-10000.0),
        "config.json",
        "rope_parameters.rope_theta -10000.0: must be greater than 1",
    ),
    "rope-theta-nan": (
        "olmoe",
        _rope(rope_theta=float("nan")),
        "config.json",
        "rope_parameters.rope_theta nan: must be a finite number",
    ),
    "rope-theta-zero": ("qwen3_moe", _rope(rope_theta=0.0), "config.json", "rope_parameters.rope_theta 0.0: must be"),
    "gemma3-local-theta-below-1": (
        "gemma3",
        edit_config(lambda c: c["rope_parameters"]["sliding_attention"].update(rope_theta=0.5)),
        "config.json",
        "rope_parameters.sliding_attention.rope_theta 0.5: must be greater than 1",
    ),
    "gemma3-query-scalar-0": (
        "gemma3",
        edit_config(lambda c: c.update(query_pre_attn_scalar=0)),
        "config.json",
        "query_pre_attn_scalar 0.0: must be greater than 0, as for toolkit-train's --query-pre-attn-scalar",
    ),
    "olmo2-rms-norm-eps-0": (
        "olmo2",
        edit_config(lambda c: c.update(rms_norm_eps=0.0)),
        "config.json",
        "rms_norm_eps 0.0: must be greater than 0",
    ),
    "rms-norm-eps-negative": (
        "llama",
        edit_config(lambda c: c.update(rms_norm_eps=-1e-5)),
        "config.json",
        "rms_norm_eps -1e-05: must be greater than 0, as for toolkit-train's --rms-norm-eps",
    ),
    "llama3-factor-below-1": (
        "llama",
        _rope(factor=0.5),
        "config.json",
        "rope_parameters.factor 0.5: must be at least 1",
    ),
    "llama3-low-freq-factor-0": (
        "llama",
        _rope(low_freq_factor=0.0),
        "config.json",
        "rope_parameters.low_freq_factor 0.0: must be greater than 0",
    ),
    "yarn-attention-factor-0": (
        "llama",
        _yarn(attention_factor=0.0),
        "config.json",
        "rope_parameters.attention_factor 0.0: must be greater than 0",
    ),
    "yarn-attention-factor-negative": (
        "llama",
        _yarn(attention_factor=-1.0),
        "config.json",
        "rope_parameters.attention_factor -1.0: must be greater than 0",
    ),
    "yarn-factor-below-1": (
        "llama",
        _yarn(factor=0.5),
        "config.json",
        "rope_parameters.factor 0.5: must be at least 1",
    ),
    "olmoe-aux-coef-negative": (
        "olmoe",
        edit_config(lambda c: c.update(router_aux_loss_coef=-100.0)),
        "config.json",
        "router_aux_loss_coef -100.0: must be at least 0",
    ),
    "olmoe-experts-1e9": (
        "olmoe",
        edit_config(lambda c: c.update(num_experts=10**9)),
        "config.json",
        "the model has 18,560,000,033,152 parameters",
    ),  # a size check, before anything is allocated
    # the file to fix named, not another one
    "vocab-size-below-the-tokenizer": (
        "llama",
        edit_config(lambda c: c.update(vocab_size=10)),
        "config.json",
        "vocab_size 10 is not a count of at least the tokenizer's 63 ids",
    ),
    "eos-past-the-vocabulary": (
        "llama",
        edit_config(lambda c: c.update(eos_token_id=9999)),
        "config.json",
        "eos_token_id 9999 is not a token id of the vocabulary (0..62)",
    ),
    "config-value-transformers-refuses": (
        "olmoe",
        edit_config(lambda c: c.update(router_aux_loss_coef=-1)),
        "config.json",
        "StrictDataclassFieldValidationError: Validation error for field 'router_aux_loss_coef'",
    ),  # transformers' own check, met while it builds the tokenizer: still config.json's
}

LLAMA = ["--arch", "llama_tiny", "--save-dir", "{root}/fresh_llama", "--no-save", "--batch-size", "2", "--cpu"]
MOE = ["--arch", "moe_tiny", "--save-dir", "{root}/fresh_moe", "--no-save", "--batch-size", "2", "--cpu"]
CP2 = ["--distributed-world-size", "2", "--context-parallel-size", "2"]
PLAN_LLAMA = ["--arch", "llama_tiny", "--vocab-size", "100"]

CASES = [
    *[
        (
            f"import-{name}",
            EXPORT,
            ["--from", "hf", "--path", f"{{hf}}/{name}", "--out", "{root}/imported"],
            f"{{hf}}/{name}/{file}: {fragment}",
        )
        for name, (_, _, file, fragment) in DAMAGED.items()
    ],
    # --- context parallelism: samples that do not cut into 2 x cp chunks, before any worker starts ----------
    (
        "train-cp2-tokens-63",
        TRAIN,
        ["{bin}", *LLAMA, *CP2, "--tokens-per-sample", "63"],
        "--tokens-per-sample 63 with --context-parallel-size 2: each sample is cut into 4 equal chunks (2 x 2 "
        "ranks), so its 63 positions must be a multiple of 4; use --tokens-per-sample 60 or 64",
    ),
    (
        "train-cp4-tokens-6",
        TRAIN,
        ["{bin}", *LLAMA, "--distributed-world-size", "4", "--context-parallel-size", "4", "--tokens-per-sample", "6"],
        "--tokens-per-sample 6 with --context-parallel-size 4: each sample is cut into 8 equal chunks",
    ),
    (
        "train-cp2-bos",
        TRAIN,
        ["{bin}", *LLAMA, *CP2, "--tokens-per-sample", "64", "--add-bos-token"],
        "its 65 positions (with --add-bos-token's <s>) must be a multiple of 4; use --tokens-per-sample 63 or 67",
    ),
    (
        "plan-cp2-tokens-63",
        PLAN,
        [*PLAN_LLAMA, *CP2, "--tokens-per-sample", "63"],
        "--tokens-per-sample 63 with --context-parallel-size 2: each sample is cut into 4 equal chunks",
    ),
    # --- MoE and rotary flags: refused at parse time, as --z-loss-coef -1 is --------------------------------
    (
        "train-moe-aux-loss-coef-negative",
        TRAIN,
        ["{bin}", *MOE, "--moe-aux-loss-coef", "-100"],
        "-100: must be at least 0",
    ),
    ("train-moe-z-loss-coef-negative", TRAIN, ["{bin}", *MOE, "--moe-z-loss-coef=-1"], "-1: must be at least 0"),
    (
        "train-moe-experts-1e9",
        TRAIN,
        ["{bin}", *MOE, "--moe-num-experts", "1000000000"],
        "the model has 12,416,000,065,984 parameters",
    ),  # a size check, not the allocator's traceback
    ("train-rope-theta-0", TRAIN, ["{bin}", *LLAMA, "--rope-theta", "0"], "argument --rope-theta: 0: must be greater"),
    ("train-rope-theta-nan", TRAIN, ["{bin}", *LLAMA, "--rope-theta", "nan"], "nan: must be a finite number"),
    ("train-rms-norm-eps-negative", TRAIN, ["{bin}", *LLAMA, "--rms-norm-eps=-1e-5"], "-1e-05: must be greater than 0"),
    (
        "train-rope-original-max-positions-0",
        TRAIN,
        ["{bin}", *LLAMA, "--rope-scaling-factor", "4", "--rope-original-max-positions", "0"],
        "argument --rope-original-max-positions: 0: must be at least 1",
    ),
    (
        "train-rope-original-max-positions-negative",
        TRAIN,
        ["{bin}", *LLAMA, "--rope-scaling-factor", "4", "--rope-original-max-positions", "-8"],
        "argument --rope-original-max-positions: -8: must be at least 1",
    ),
    (
        "train-rope-low-freq-factor-0",
        TRAIN,
        ["{bin}", *LLAMA, "--rope-scaling-factor", "4", "--rope-low-freq-factor", "0"],
        "argument --rope-low-freq-factor: 0: must be greater than 0",
    ),
    (
        "train-rope-attention-factor-0",
        TRAIN,
        ["{bin}", *LLAMA, "--rope-scaling", "yarn", "--rope-scaling-factor", "4", "--rope-attention-factor", "0"],
        "argument --rope-attention-factor: 0: must be greater than 0",
    ),
    (
        "train-rope-attention-factor-negative",
        TRAIN,
        ["{bin}", *LLAMA, "--rope-scaling", "yarn", "--rope-scaling-factor", "4", "--rope-attention-factor", "-1"],
        "argument --rope-attention-factor: -1: must be greater than 0",
    ),
    (
        "train-yarn-factor-below-1",
        TRAIN,
        ["{bin}", *LLAMA, "--rope-scaling", "yarn", "--rope-scaling-factor", "0.5"],
        "argument --rope-scaling-factor: 0.5: must be at least 1",
    ),
    (
        "train-yarn-without-factor",
        TRAIN,
        ["{bin}", *LLAMA, "--rope-scaling", "yarn"],
        "--rope-scaling yarn: give --rope-scaling-factor F",
    ),
    # --- the cause named: NaN from the starting weights is not the learning rate's --------------------------
    (
        "train-from-nan-weights-names-them-not-lr",
        TRAIN,
        ["{bin}", MODEL, "--save-dir", "{root}/fresh_nan", "--no-save", "--finetune-from-model", "{bad}/nan.pt"],
        "at update 1; no step of this run had changed the weights yet, so not --lr",
    ),
]


@pytest.fixture(scope="module")
def paths(prepared, tmp_path_factory):
    hf = str(tmp_path_factory.mktemp("hf_damaged"))
    bases = {"gpt2": _gpt2}
    for kind in ("llama", "qwen3", "olmo2", "gemma3"):
        bases[kind] = lambda folder, kind=kind: make_hf(folder, kind)
    for kind in ("olmoe", "qwen3_moe", "mixtral"):
        bases[kind] = lambda folder, kind=kind: make_hf_moe(folder, kind)
    for kind in sorted({base for base, *_ in DAMAGED.values()}):
        bases[kind](f"{hf}/{kind}")
    for name, (base, damage, _, _) in DAMAGED.items():
        _copy(f"{hf}/{base}", f"{hf}/{name}")
        damage(f"{hf}/{name}")
    return {**prepared, "hf": hf}


def _copy(src: str, dst: str) -> None:
    import shutil

    shutil.copytree(src, dst)


def _gpt2(folder: str) -> None:
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)


def test_catalogue_cases_are_named_once():
    assert len({c[0] for c in CASES}) == len(CASES) >= 40


@pytest.mark.parametrize("name,module,argv,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, module, argv, fragment, paths, tmp_path):
    check_bad_input(module, argv, fragment, paths, tmp_path)
    assert not os.path.exists(f"{paths['root']}/imported")
    assert not any(os.path.exists(f"{paths['root']}/{d}") for d in ("fresh_llama", "fresh_moe", "fresh_nan"))
