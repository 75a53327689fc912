"""The MoE family (``toolkit.models.moe``): named sizes against transformers' own models built on the meta
device from the published configs (total parameters), the active count against a direct count of one token's
experts, FLOPs from the active parameters, the training forward's router terms, the parallel plan's refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from toolkit import models
from toolkit.core.errors import UserError
from toolkit.models.accounting import default_vocab_size
from toolkit.models.common.moe import MoE

# The published config.json values (Hugging Face Hub: Qwen/Qwen3-30B-A3B, allenai/OLMoE-1B-7B-0924,
# mistralai/Mixtral-8x7B-v0.1), as much of them as decides the shapes.
PUBLISHED = {
    "qwen3_30b_a3b": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),
    "olmoe_1b_7b": (
        "OlmoeForCausalLM",
        "OlmoeConfig",
        dict(
            vocab_size=50304,
            hidden_size=2048,
            intermediate_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_experts=64,
            num_experts_per_tok=8,
            tie_word_embeddings=False,
        ),
    ),
    "mixtral_8x7b": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
    ),
}


def meta_model(arch: str, **overrides):
    return models.build_on_meta(arch, default_vocab_size(arch), **overrides)


@pytest.mark.parametrize("arch", sorted(PUBLISHED))
def test_total_and_active_parameters_equal_the_published_models(arch):
    transformers = pytest.importorskip("transformers")
    cls_name, config_name, values = PUBLISHED[arch]
    config = getattr(transformers, config_name)(**values)
    with torch.device("meta"):
        hf_model = getattr(transformers, cls_name)(config)
    hf_total = sum(p.numel() for p in hf_model.parameters())
    ours = meta_model(arch)
    assert sum(p.numel() for p in ours.parameters()) == hf_total
    # active: everything but the experts a token is not routed to (E - k of them, 3 matrices C x F each, per layer)
    cfg = ours.cfg
    idle = (
        cfg.decoder_layers * (cfg.moe_num_experts - cfg.moe_top_k) * 3 * cfg.decoder_embed_dim * cfg.moe_ffn_embed_dim
    )
    assert ours.active_parameters() == hf_total - idle
    embed = values["vocab_size"] * values["hidden_size"]
    attention = 12 * cfg.decoder_layers * cfg.decoder_attention_heads * 128 * 2048
    assert ours.flops_per_token(2048) == 6 * (hf_total - idle - embed) + attention


def test_published_active_counts():
    """The "A3B" / "1B" / 12.9B of the names."""
    assert meta_model("qwen3_30b_a3b").active_parameters() == 3_353_032_704
    assert meta_model("olmoe_1b_7b").active_parameters() == 1_282_017_280
    assert meta_model("mixtral_8x7b").active_parameters() == 12_879_925_248


@pytest.mark.parametrize("arch", ["moe_tiny", "olmoe_tiny", "mixtral_tiny", "moe_tiny_sigmoid"])
def test_training_forward_returns_the_router_terms(arch):
    torch.manual_seed(0)
    model = _build(arch)
    tokens = torch.randint(4, 50, (2, 16))
    model.train()
    logits, extra = model(tokens)
    assert set(extra["aux_losses"]) == {"moe_aux_loss", "moe_z_loss"}
    value, coef = extra["aux_losses"]["moe_aux_loss"]
    assert coef == model.cfg.moe_aux_loss_coef and value.requires_grad == (coef > 0)  # weighted 0: logged only
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert set(extra["metrics"]) == {"moe_max_load_0", "moe_max_load_1", "moe_dropped"}
    assert float(extra["metrics"]["moe_dropped"]) == 0.0 and all(
        float(extra["metrics"][f"moe_max_load_{i}"]) >= 1.0 for i in range(2)
    )
    assert all(float(m.tokens_per_expert.sum()) == 2 * 16 * model.cfg.moe_top_k for m in layers)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), logits.detach())  # evaluation: the logits alone, the same


def _build(arch):
    return _build_with(arch, max_target_positions=16)


def test_sigmoid_family_updates_its_bias_after_a_step():
    torch.manual_seed(0)
    model = _build("moe_tiny_sigmoid").train()
    model(torch.randint(4, 50, (2, 16)))
    layer = [m for m in model.modules() if isinstance(m, MoE)][0]
    loads = layer.tokens_per_expert.clone()
    layer.after_optimizer_step()
    torch.testing.assert_close(layer.gate.expert_bias, 0.001 * torch.sign(loads.mean() - loads))
    assert "layers.0.mlp.gate.expert_bias" in model.state_dict()


def test_the_plan_keeps_the_experts_whole_over_tensor_parallel_ranks():
    from types import SimpleNamespace

    from toolkit.config import DistributedConfig, composition
    from toolkit.distributed.tensor_parallel import check_plan_kinds
    from toolkit.models.moe.model import MoELanguageModel

    plan = meta_model("moe_tiny").tensor_parallel_plan()
    assert plan.experts == {"mlp": "ep_shard"} and "self_attn.q_proj" in plan.block
    assert not any(path.startswith("mlp") for path in plan.block)
    check_plan_kinds(plan, "MoELanguageModel")  # ep_shard: a placement the toolkit places
    with pytest.raises(UserError, match=r"'mlp' asks for expert-parallel placement 'ep_split'"):
        check_plan_kinds(dataclasses.replace(plan, experts={"mlp": "ep_split"}), "MoELanguageModel")
    dist = dataclasses.replace(DistributedConfig(), expert_parallel_size=2)
    cfg = SimpleNamespace(distributed=dist, components=SimpleNamespace(arch="moe_tiny"), model=None)
    assert composition.model_refusal(cfg, MoELanguageModel) is None  # the family places its experts
    for other in ("FSDP", "HSDP", "cpu-offload", "overlap-offload", "compile", "TP", "SP"):  # each pair tested
        assert isinstance(composition.status("EP", other), composition.Tested), other


@pytest.mark.parametrize("arch", ["moe_tiny", "olmoe_tiny", "mixtral_tiny"])
def test_the_plan_names_only_modules_the_model_builds(arch):
    """toolkit-plan reads each planned module (``split_parameters``): the MoE plan must not name a norm that this
    configuration of the shared block leaves out (it once named Gemma's ``post_feedforward_layernorm``)."""
    from toolkit.distributed.tensor_parallel import split_parameters

    model = meta_model(arch)
    split = split_parameters(model)
    assert "layers.0.self_attn.q_proj.weight" in split and not any(".mlp." in name for name in split)
    for path in model.tensor_parallel_plan().block:
        model.layers[0].get_submodule(path)


def test_bad_shapes_are_refused():
    with pytest.raises(UserError, match=r"^--moe-top-k 5: a token cannot go to more than the --moe-num-experts 4"):
        meta_model("moe_tiny", moe_top_k=5)


@pytest.mark.parametrize("arch,renormalize", [("moe_tiny", False), ("olmoe_tiny", True)])
def test_renormalize_turns_either_way_and_crosses_to_hugging_face(arch, renormalize, tmp_path):
    """The named sizes set --moe-renormalize their way (Qwen3-MoE on, OLMoE off): the flag's other spelling undoes
    it, and Hugging Face's norm_topk_prob carries the choice out and back in."""
    from toolkit.models.moe.hf import MoEAdapter
    from toolkit.train.resolve import parse_train_config

    flag = "--moe-renormalize" if renormalize else "--no-moe-renormalize"
    base = [str(tmp_path), "--cpu", "--arch", arch, "--batch-size", "1"]
    assert parse_train_config(base).model.moe_renormalize is not renormalize  # the named size's own choice
    cfg = parse_train_config([*base, flag]).model
    assert cfg.moe_renormalize is renormalize
    adapter = MoEAdapter()
    _, config = adapter.hf_config(dataclasses.replace(cfg, max_target_positions=64), 100)
    assert config["norm_topk_prob"] is renormalize
    assert adapter.options_from_hf(config, "config.json")["moe_renormalize"] is renormalize


def test_negative_router_loss_weights_are_refused_outside_flags_too():
    """A config not parsed from flags (a checkpoint's): the same refusal as --moe-aux-loss-coef -100's."""
    with pytest.raises(UserError, match=r"^--moe-aux-loss-coef -100.0: must be 0 or more"):
        meta_model("moe_tiny", moe_aux_loss_coef=-100.0)
    with pytest.raises(UserError, match=r"^--moe-z-loss-coef -1.0: must be 0 or more"):
        meta_model("moe_tiny", moe_z_loss_coef=-1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_planner_traces_the_family_in_either_precision(tmp_path, dtype):
    """toolkit-plan traces one forward and backward on the meta device, whose grouped-GEMM kernel takes bf16 only."""
    from tests.helpers.dist_helpers import make_lm_data_bin
    from toolkit.plan.model_stats import model_stats
    from toolkit.train.resolve import parse_train_config

    data = make_lm_data_bin(str(tmp_path / "bin"))
    cfg = parse_train_config(
        [data, "--task", "language_modeling", "--arch", "moe_tiny", "--tokens-per-sample", "16", "--batch-size", "2"]
    )
    stats = model_stats(cfg, dtype)
    assert stats.activations.per_layer > 0 and stats.num_layers == 2 and stats.num_params > 0


@pytest.mark.parametrize("arch", ["moe_tiny", "olmoe_tiny", "mixtral_tiny"])
def test_local_layers_decode_with_the_cache_as_the_full_forward(arch):
    """A sliding window in some layers (--layer-types): each layer's attention keeps its own window, so decoding
    with the KV cache (which keeps a local layer's last window - 1 positions) equals the full forward."""
    model = _build_with(arch, sliding_window=6, layer_types="sliding_attention,full_attention").eval()
    assert [layer.self_attn.window for layer in model.layers] == [6, None]
    tokens = torch.randint(4, 50, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, state = model(tokens), {}
        steps = [model(tokens[:, :7], incremental_state=state)]
        steps += [model(tokens[:, t : t + 1], incremental_state=state) for t in range(7, 20)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def _build_with(arch, **options):
    from types import SimpleNamespace

    from toolkit.data.dictionary import Dictionary

    d = Dictionary()
    for i in range(46):
        d.add_symbol(f"w{i}")
    task = SimpleNamespace(dictionary=d, cfg=SimpleNamespace(tokens_per_sample=20))
    return models.build_model(arch, models.model_config(arch, **options), task)


@pytest.mark.parametrize(
    "arch, options, refused",
    [
        ("moe_tiny", {}, None),
        ("deepseek_v3_tiny", {}, None),
        ("deepseek_v3_tiny", {"mtp_depth": 1}, None),
        ("gpt_oss_tiny", {}, None),
        ("glm4_moe_tiny", {}, None),
        ("qwen3_next_tiny", {}, None),
        ("olmo2_tiny", {}, "does not declare"),
    ],
)
def test_a_pipeline_takes_the_families_that_declare_it(arch, options, refused):
    """The MoE families (MoE, DeepSeek-V3, gpt-oss, GLM-4.5, Qwen3-Next) are cut into stages, multi-token prediction
    too (its depths on the last stage); the families no pipelined run compares with one process are refused in one
    line."""
    from toolkit.distributed.pipeline import build_pipeline, check_pipelinable
    from toolkit.models import build_on_meta

    model = build_on_meta(arch, 64, 32, **options)
    if refused is None:
        check_pipelinable(model)
    else:
        with pytest.raises(UserError, match=refused):
            build_pipeline(model, None, None)
