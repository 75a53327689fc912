"""LoRA in one process (toolkit/models/lora.py): the adapted layer's computation, its merge, which layers the
targets adapt, what is frozen, where the adapters start, and the refusals of bad targets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.models import tokens
from toolkit.config import CommonConfig, DistributedConfig, LoRAConfig
from toolkit.core.errors import UserError
from toolkit.distributed.parallelize import parallelize
from toolkit.distributed.utils import DistributedEnv
from toolkit.models import model_config
from toolkit.models.llama.model import LlamaLanguageModel
from toolkit.models.lora import LoRALinear, adapted_modules, apply_lora, detach_adapters, merged_state

RANK, ALPHA = 4, 8.0


def tiny_llama(device="cpu"):
    with torch.device(device):
        return LlamaLanguageModel(model_config("llama_tiny", max_target_positions=16), 37, 1, seed=0)


def built(targets="q_proj,v_proj", seed=1):
    """A tiny Llama through the parallelize sequence with ``--lora-rank 4`` (materialized and initialized)."""
    lora = LoRAConfig(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=targets)
    model, _ = parallelize(tiny_llama("meta"), DistributedConfig(), CommonConfig(seed=seed), DistributedEnv(), lora)
    return model


def test_adapted_layer_computes_base_plus_scaled_update_and_merges_to_it():
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 6)
    layer = LoRALinear(base, RANK, ALPHA, dropout=0.0)
    x = torch.randn(3, 8)
    torch.nn.init.normal_(layer.lora_B.weight)
    want = F.linear(x, base.weight, base.bias) + (ALPHA / RANK) * x @ layer.lora_A.weight.T @ layer.lora_B.weight.T
    torch.testing.assert_close(layer(x), want)
    state = {f"m.{k}": v for k, v in layer.state_dict().items()}
    merged = merged_state(state, ALPHA / RANK)
    assert sorted(merged) == ["m.bias", "m.weight"]
    torch.testing.assert_close(F.linear(x, merged["m.weight"], merged["m.bias"]), want)
    torch.testing.assert_close(merged["m.weight"], layer.merged_weight())


def test_targets_adapt_those_layers_of_every_block_and_freeze_the_rest():
    model = built("q_proj,v_proj,down_proj")
    names = [name for name, _ in adapted_modules(model)]
    assert names == [
        f"layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    ]
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trained == sorted(f"{n}.{part}.weight" for n in names for part in ("lora_A", "lora_B"))
    everything = built("all-linear")
    leaves = {name.rsplit(".", 1)[-1] for name, _ in adapted_modules(everything)}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert type(everything.output_projection) is torch.nn.Linear  # the head is not a block's layer


def test_adapters_start_as_peft_so_the_first_forward_is_the_base_models():
    model, plain = built(), tiny_llama("meta")
    plain, _ = parallelize(plain, DistributedConfig(), CommonConfig(seed=1), DistributedEnv())
    batch = tokens(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(model(batch), plain(batch), rtol=0, atol=0)
    layer = model.layers[0].self_attn.q_proj
    bound = 1 / layer.in_features**0.5  # peft's kaiming_uniform(a=sqrt(5)) on [r, in]: U(-1/sqrt(in), 1/sqrt(in))
    assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.std() > bound / 4
    assert not layer.lora_B.weight.any()
    again = built()  # the same seed: the same adapters (each parameter drawn from its own name's generator)
    torch.testing.assert_close(
        again.layers[1].self_attn.v_proj.lora_A.weight, model.layers[1].self_attn.v_proj.lora_A.weight
    )


def test_detached_adapters_leave_the_base_model():
    model = built()
    torch.nn.init.normal_(model.layers[0].self_attn.q_proj.lora_B.weight)
    batch = tokens(2, 12)
    base_weight = model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        adapted = model(batch)
        adapters = detach_adapters(model)
        base = model(batch)
    assert sorted(adapters) == [f"layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("q_proj", "v_proj")]
    assert type(model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert model.layers[0].self_attn.q_proj.weight is base_weight
    assert adapters["layers.0.self_attn.q_proj"][0].shape == (RANK, 64)
    assert adapters["layers.0.self_attn.q_proj"][1].shape == (64, RANK)
    assert not torch.allclose(adapted, base)


@pytest.mark.parametrize(
    "targets, message",
    [
        ("nope", "--lora-targets nope: no Linear layer of the blocks has that name (they are down_proj, gate_proj"),
        ("q_proj,nope", "--lora-targets q_proj,nope: nope names no Linear layer of the blocks"),
        (" , ", "give the last names of the blocks' Linear layers (comma separated), or all-linear"),
    ],
)
def test_targets_naming_no_layer_are_refused(targets, message):
    with pytest.raises(UserError) as refused:
        apply_lora(tiny_llama("meta"), RANK, ALPHA, 0.0, targets)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_finetune_start_continues_merges_or_refuses_the_checkpoints_adapters():
    from toolkit.models.lora import finetune_start

    model = built("q_proj,v_proj")
    torch.nn.init.normal_(model.layers[0].self_attn.q_proj.lora_B.weight)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    saved = {"lora_rank": RANK, "lora_alpha": ALPHA, "lora_targets": "q_proj,v_proj"}
    kept, line = finetune_start(model, state, saved, "ck.pt")
    assert kept is state and line == "continues its 4 LoRA adapters"
    plain = tiny_llama()
    merged, line = finetune_start(plain, state, saved, "ck.pt")
    assert line.startswith("merged its 4 LoRA adapters (r 4)") and sorted(merged) == sorted(plain.state_dict())
    plain.load_state_dict(merged)
    x = tokens(2, 8, 37)
    torch.testing.assert_close(plain(x), model(x), rtol=1e-5, atol=1e-5)  # the merge computes what the adapters do
    with pytest.raises(UserError, match=r"ck.pt: its adapters \(r 4, --lora-targets q_proj,v_proj\) are not this run"):
        finetune_start(built("q_proj"), state, saved, "ck.pt")
