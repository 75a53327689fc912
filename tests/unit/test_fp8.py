"""``--fp8``: torchao float8 training of the blocks' Linear layers (CPU: torch emulates the float8 matmuls)."""

import sys

import pytest
import torch

from toolkit.distributed import float8
from toolkit.core.errors import UserError
from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig
from toolkit.train.resolve import parse_train_config

pytest.importorskip("torchao.float8", reason="--fp8 needs torchao (pip install torchao)")


def tiny_model(seed: int = 0) -> TransformerLanguageModel:
    cfg = TransformerLMConfig(
        decoder_layers=2,
        decoder_embed_dim=64,
        decoder_ffn_embed_dim=128,
        decoder_attention_heads=4,
        decoder_normalize_before=True,
        max_target_positions=32,
        dropout=0.0,
    )
    return TransformerLanguageModel(cfg, 96, 1, seed=seed)


def test_only_the_blocks_linear_layers_become_float8_and_keys_stay():
    model = tiny_model()
    keys = list(model.state_dict())
    assert float8.apply_float8(model) == 8  # qkv_proj, out_proj, fc1, fc2 in each of the 2 blocks
    swapped = {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert swapped and all(name.startswith("layers.") for name in swapped)
    assert type(model.output_projection).__name__ == "Linear"
    assert list(model.state_dict()) == keys  # checkpoints move between float8 and bf16 runs


def test_float8_forward_is_close_to_the_high_precision_one():
    model, reference = tiny_model(), tiny_model()
    float8.apply_float8(model)
    tokens = torch.randint(4, 96, (2, 32))
    with torch.no_grad():
        got, want = model(tokens)[0], reference(tokens)[0]
    assert not torch.equal(got, want)  # float8 really ran
    rel = (got - want).norm() / want.norm()
    assert rel < 0.05, rel  # e4m3 has a 3-bit mantissa: a few percent on logits, no more


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--fp8", "--fp16"], "--fp8 with --fp16"),
        (["--fp8", "--fp8-all-gather", "--ddp-backend", "fully_sharded"], "only with --fp8-recipe tensorwise"),
        (["--fp8", "--fp8-recipe", "tensorwise", "--fp8-all-gather"], "needs --ddp-backend fully_sharded"),
        (["--fp8-recipe", "tensorwise"], "only applies with --fp8"),
    ],
)
def test_fp8_conflicts_are_one_line_before_any_worker(argv, message):
    with pytest.raises(UserError, match=message):
        parse_train_config(["d", "--cpu", *argv])


def test_missing_torchao_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    with pytest.raises(UserError, match="pip install torchao"):
        parse_train_config(["d", "--cpu", "--fp8"])
