"""The OLMo 3 and SmolLM3 families beyond their Hugging Face round trips (tests/integration/test_olmo3_smollm3_hf.py).

toolkit-plan of a model whose layers differ (``toolkit.plan.model_stats``: three local layers of window 4, then a
global one; Gemma 3's sizes alike) traces its first layers with their own ``--layer-types``, so the plan prices the
model toolkit-train builds. A ``config.json`` that the families' models would compute otherwise (OLMo 3's local
layers with a base or a scaling of their own, a ``no_rope_layers`` list that is not one 0/1 per layer) is refused in
one line naming the key."""

from __future__ import annotations

import pytest
import torch

from toolkit.core.errors import UserError
from toolkit.models.olmo3.hf import Olmo3Adapter
from toolkit.models.smollm3.hf import SmolLM3Adapter
from toolkit.plan.model_stats import model_stats
from toolkit.train.resolve import parse_train_config

LOCAL_THEN_GLOBAL = "sliding_attention,sliding_attention,sliding_attention,full_attention"


@pytest.mark.parametrize(
    "flags",
    [
        ("--arch", "olmo3_tiny", "--decoder-layers", "4", "--layer-types", LOCAL_THEN_GLOBAL),
        (
            "--arch",
            "smollm3_tiny",
            "--decoder-layers",
            "4",
            "--sliding-window",
            "4",
            "--layer-types",
            LOCAL_THEN_GLOBAL,
        ),
    ],
    ids=["olmo3", "smollm3"],
)
def test_a_model_of_local_and_global_layers_is_planned_as_built(flags):
    from toolkit import models

    cfg = parse_train_config(["data", *flags, "--tokens-per-sample", "16", "--max-update", "1"])
    stats = model_stats(cfg, torch.float32, 64)
    layers = {k: getattr(cfg.model, k) for k in ("decoder_layers", "sliding_window", "layer_types")}
    built = models.build_on_meta(cfg.components.arch, 64, 16, **layers)
    assert stats.num_layers == 4 and stats.num_params == sum(p.numel() for p in built.parameters())
    assert stats.activations.per_layer > 0 and stats.kv_width == 4 * built.layers[0].self_attn.kv_width()


SHAPE = dict(
    num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=64
)
OLMO3 = dict(SHAPE, model_type="olmo3", sliding_window=4, layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize(
    "adapter,config,message",
    [
        (
            Olmo3Adapter,
            dict(
                OLMO3,
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
            ),
            r"rope_parameters.sliding_attention of rope_type 'default', rope_theta 10000.0; .* global base \(500000.0\)",
        ),
        (
            Olmo3Adapter,
            dict(
                OLMO3,
                rope_parameters={
                    "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0},
                },
            ),
            r"rope_parameters.sliding_attention of rope_type 'linear'",
        ),
        (
            Olmo3Adapter,
            dict(OLMO3, sliding_window=64, rope_scaling={"rope_type": "linear", "factor": 2.0}),
            r"sliding_window 64 never binds",
        ),
        (SmolLM3Adapter, dict(SHAPE, model_type="smollm3", no_rope_layers=[1]), r"no_rope_layers \[1\]: give 1"),
        (SmolLM3Adapter, dict(SHAPE, model_type="smollm3", no_rope_layers=[1, 2]), r"no_rope_layers \[1, 2\]"),
        (SmolLM3Adapter, dict(SHAPE, model_type="smollm3", no_rope_layer_interval=-1), r"no_rope_layer_interval -1"),
    ],
    ids=[
        "olmo3-local-base",
        "olmo3-local-scaling",
        "olmo3-window-never-binds",
        "smollm3-short",
        "smollm3-2",
        "interval",
    ],
)
def test_a_config_the_model_would_compute_otherwise_is_refused_in_one_line(adapter, config, message):
    with pytest.raises(UserError, match=rf"^config.json: {message}") as refused:
        adapter().options_from_hf(config, "config.json")
    assert "\n" not in str(refused.value)


def test_smollm3_reads_a_nope_list_that_is_not_periodic_as_its_layers():
    config = dict(SHAPE, num_hidden_layers=4, model_type="smollm3", no_rope_layers=[0, 1, 1, 1, 0])
    options = SmolLM3Adapter().options_from_hf(config, "config.json")
    assert (options["nope_layers"], options["nope_layer_interval"]) == ("0", 4)


def test_tensor_parallel_plan_splits_the_qk_norm_over_all_heads_with_the_heads():
    """OLMo 3's (OLMo 2's) QK-norm over the whole projections: ``projection_norm``, its weight divided over the tp
    ranks with the heads of ``q_proj`` and ``k_proj``."""
    from toolkit import models
    from toolkit.distributed.tensor_parallel import split_parameters

    model = models.build_on_meta("olmo3_tiny", 64, tokens_per_sample=16)
    assert model.tensor_parallel_plan().block["self_attn.q_norm"] == "projection_norm"
    assert {f"layers.{i}.self_attn.{n}_norm.weight" for i in range(len(model.layers)) for n in "qk"} <= (
        split_parameters(model)
    )
