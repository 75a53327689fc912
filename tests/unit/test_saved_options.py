"""Checkpoints whose options hold the Llama family's norm switches (``gemma_norms``, ``norm_after_sublayer``: every
``llama`` and ``moe`` checkpoint saved them) load as the family that builds the model (toolkit/models/saved_options.py).

Each old-format checkpoint is written by hand as its dict, the way the checkpoint writer saved it: the arch, every
option the model's options class then had (``LLAMA_OPTIONS``: the Llama family's 31 fields, the MoE family's on
top) and the state dict under the names the model registers (the families build them under the same names). It
loads through the readers (``toolkit.inference.load_model``, the consolidated reader, a sharded checkpoint's
metadata) into the family's model with the saved weights; options that compute something no family builds are
refused in one line.
"""

from __future__ import annotations

import os

import pytest
import torch

from toolkit.checkpoint.consolidated import load_checkpoint_file
from toolkit.core.errors import UserError
from toolkit.data.dictionary import Dictionary
from toolkit.inference import load_model
from toolkit.models import model_config
from toolkit.models.saved_options import as_family

#: every option of the Llama family's options class as checkpoints saved them, with its defaults
LLAMA_OPTIONS = dict(
    decoder_layers=2,
    decoder_embed_dim=64,
    decoder_ffn_embed_dim=128,
    decoder_attention_heads=4,
    decoder_kv_heads=2,
    rope_theta=10000.0,
    rope_scaling_factor=None,
    rope_scaling="llama3",
    rope_yarn_beta_fast=32.0,
    rope_yarn_beta_slow=1.0,
    rope_attention_factor=None,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_positions=8192,
    rms_norm_eps=1e-6,
    attention_qkv_bias=False,
    decoder_head_dim=None,
    qk_norm=False,
    qk_norm_over="head",
    norm_after_sublayer=False,
    gemma_norms=False,
    mlp_activation="silu",
    query_pre_attn_scalar=None,
    rope_local_theta=None,
    attn_logit_softcap=None,
    final_logit_softcap=None,
    sliding_window=None,
    layer_types=None,
    share_decoder_input_output_embed=False,
    max_target_positions=24,
    init_std=0.02,
)
GEMMA = dict(
    decoder_head_dim=32,
    qk_norm=True,
    gemma_norms=True,
    mlp_activation="gelu_tanh",
    query_pre_attn_scalar=32.0,
    rope_theta=1e6,
    rope_local_theta=1e4,
    sliding_window=6,
    layer_types="sliding_attention,full_attention",
    share_decoder_input_output_embed=True,
)
OLMO2 = dict(qk_norm=True, qk_norm_over="projection", norm_after_sublayer=True, rope_theta=500000.0)
MOE = dict(
    decoder_head_dim=32,
    qk_norm=True,
    rope_theta=1e6,
    moe_num_experts=4,
    moe_top_k=2,
    moe_ffn_embed_dim=32,
    moe_score_func="softmax",
    moe_renormalize=True,
    moe_shared_ffn_embed_dim=0,
    moe_bias_update_rate=0.0,
    moe_aux_loss_coef=0.001,
    moe_z_loss_coef=0.0,
    moe_idle_warning_updates=100,
    qk_norm_full_width=False,
)
#: name -> (saved arch, saved options over LLAMA_OPTIONS, the family and arch it loads as)
SAVED = {
    "llama with gemma norms": ("llama", GEMMA, "gemma3", "gemma3"),
    "a gemma3 size": ("gemma3_tiny", GEMMA, "gemma3", "gemma3_tiny"),
    "llama with norms after": ("llama", OLMO2, "olmo2", "olmo2"),
    "an olmo2 size": ("olmo2_tiny", OLMO2, "olmo2", "olmo2_tiny"),
    "a llama size": ("llama_tiny", {}, "llama", "llama_tiny"),
    "moe": ("moe", MOE, "moe", "moe"),
}
VOCAB = 16


def data_dir(root) -> str:
    d = Dictionary()
    for i in range(VOCAB - 4):
        d.add_symbol(f"w{i}")
    os.makedirs(root, exist_ok=True)
    d.save(os.path.join(root, "dict.txt"))
    return str(root)


def old_checkpoint(path, arch: str, saved: dict, state: dict, data: str) -> dict:
    """What the checkpoint writer saved for such a run: the run's options, the model's, the weights."""
    cfg = {
        "task": "language_modeling",
        "arch": arch,
        "data": data,
        "tokens_per_sample": 24,
        "sample_break_mode": "none",
        "add_bos_token": False,
        **LLAMA_OPTIONS,
        **saved,
    }
    ckpt = {"cfg": cfg, "model": state, "extra_state": {"trainer": {"num_updates": 2}}}
    torch.save(ckpt, path)
    return ckpt


def the_family_model(family: str, saved: dict):
    """The model the saved options describe, built by the family that builds it (its own options only)."""
    from toolkit.core.registry import resolve_arch

    names = {f for f in model_config(family).__dataclass_fields__}
    cfg = model_config(family, **{k: v for k, v in {**LLAMA_OPTIONS, **saved}.items() if k in names})
    return resolve_arch(family).cls(cfg, VOCAB, padding_idx=1, seed=5).eval()


@pytest.mark.parametrize("case", sorted(SAVED))
def test_an_old_checkpoint_loads_as_its_family_with_its_weights(case, tmp_path):
    arch, saved, family, loaded_arch = SAVED[case]
    reference = the_family_model(family, saved)
    path = tmp_path / "checkpoint_last.pt"
    old_checkpoint(path, arch, saved, reference.state_dict(), data_dir(tmp_path / "bin"))
    model, _, args = load_model(str(path))
    assert type(model) is type(reference) and args.arch == loaded_arch
    assert not {"gemma_norms", "norm_after_sublayer"} & set(vars(args))
    tokens = torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))


def test_the_readers_of_saved_options_upgrade_them(tmp_path):
    """The consolidated reader (resume, fine-tuning, consolidation), a sharded checkpoint's metadata and an exported
    safetensors folder's config.json each hand the family's options on."""
    from toolkit.checkpoint import sharded

    reference = the_family_model("gemma3", GEMMA)
    path = tmp_path / "old.pt"
    old_checkpoint(path, "llama", GEMMA, reference.state_dict(), data_dir(tmp_path / "bin"))
    cfg = load_checkpoint_file(str(path))["cfg"]
    assert cfg["arch"] == "gemma3" and "gemma_norms" not in cfg and "qk_norm_over" not in cfg
    assert cfg["rope_local_theta"] == 1e4 and cfg["query_pre_attn_scalar"] == 32.0  # the family's own options stay
    folder = tmp_path / "sharded"
    folder.mkdir()
    torch.save({"format": sharded.FORMAT, "cfg": dict(torch.load(path, weights_only=True)["cfg"])}, folder / "meta.pt")
    assert sharded.read_meta(str(folder))["cfg"] == cfg


def test_options_already_a_familys_own_pass_as_they_are():
    new = {"arch": "gemma3_tiny", **model_config("gemma3_tiny").__dict__}
    assert as_family(new, "x") is new
    fairseq_like = {"model": {"_name": "transformer_lm"}, "task": {}}
    assert as_family(fairseq_like, "x") is fairseq_like


@pytest.mark.parametrize(
    "arch,saved,message",
    [
        ("llama", dict(final_logit_softcap=30.0), r"--final-logit-softcap 30.0: the llama family has no such option"),
        ("llama_tiny", dict(qk_norm=True, qk_norm_over="projection"), r"--qk-norm-over projection: the llama family"),
        ("moe", dict(MOE, gemma_norms=True), r"--arch moe with --gemma-norms: no family builds these norms"),
    ],
)
def test_options_no_family_builds_are_refused_in_one_line(tmp_path, arch, saved, message):
    path = tmp_path / "old.pt"
    old_checkpoint(path, arch, saved, {}, str(tmp_path))
    with pytest.raises(UserError, match=f"^{path}: {message}") as e:
        load_checkpoint_file(str(path))
    assert "\n" not in str(e.value)


def test_a_switch_that_changes_nothing_is_dropped():
    """--qk-norm-over projection without --qk-norm normalizes nothing: a plain Llama."""
    cfg = as_family({"arch": "llama", **LLAMA_OPTIONS, "qk_norm_over": "projection"}, "x")
    assert cfg["arch"] == "llama" and "qk_norm_over" not in cfg
