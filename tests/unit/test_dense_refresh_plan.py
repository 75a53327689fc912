"""toolkit-plan of the families whose layers differ (``toolkit.plan.model_stats``): a model of local and global
layers (OLMo 3: three local of window 4, then a global one; Gemma 3's sizes alike) is traced through its first
layers with their own ``--layer-types``, so its plan prices the model toolkit-train builds."""

from __future__ import annotations

import pytest
import torch

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
