"""YaRN rotary scaling (``--rope-scaling yarn``, toolkit/models/common/rope.py): frequencies and attention factor
equal transformers' ``_compute_yarn_parameters``; random tiny LlamaForCausalLM and Qwen3ForCausalLM folders
with a yarn ``rope_scaling`` import with logits equal to transformers' within 1e-4 (fp32) at positions past the
original context, and export back (``--format hf``) to the same ``rope_scaling`` and logits; settings the
toolkit computes differently are refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from tests.helpers.hf_llama import make_hf  # noqa: E402
from toolkit.core.errors import UserError  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402
from toolkit.inference import load_model  # noqa: E402
from toolkit.models.common import rope  # noqa: E402
from toolkit.models.common.options import check_shapes  # noqa: E402
from toolkit.models.common.rope import decoder_scaling as rope_scaling  # noqa: E402
from toolkit.models.llama.config import LlamaConfig  # noqa: E402
from toolkit.models.llama.hf import LlamaAdapter  # noqa: E402

options_from_hf = LlamaAdapter().options_from_hf

#: name -> (kind, rope_scaling): the paper's defaults (betas 32/1, attention factor from the factor); narrow
#: betas with a given attention factor (Qwen3's heads of 32); DeepSeek's mscale pair instead of the factor
YARN = {
    "llama_default": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen3_betas": (
        "qwen3",
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 8.0,
            "beta_slow": 0.5,
            "attention_factor": 0.9,
        },
    ),
    "llama_mscale": (
        "llama",
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "mscale": 0.8,
            "mscale_all_dim": 0.5,
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(YARN))
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    kind, scaling = YARN[request.param]
    hf = make_hf(str(root / "hf"), kind, rope_scaling=dict(scaling))
    run_export(ExportConfig(path=str(root / "hf"), out=str(root / "ours"), import_from="hf"))
    model, _, _ = load_model(str(root / "ours" / "model.pt"), str(root / "ours"))
    return dict(root=root, hf=hf, model=model, scaling=scaling)


def tokens() -> torch.Tensor:
    """60 positions: past the original 16, where YaRN's interpolated frequencies matter."""
    return torch.randint(3, 60, (2, 60), generator=torch.Generator().manual_seed(1))


def test_frequencies_and_attention_factor_equal_transformers(imported):
    cfg = imported["model"].cfg
    assert cfg.rope_scaling == "yarn" and cfg.rope_scaling_factor == 4.0
    hf_config = imported["hf"].config
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    D = cfg.decoder_head_dim or cfg.decoder_embed_dim // cfg.decoder_attention_heads
    got_freq, got_factor = rope.rope_frequencies(D, cfg.rope_theta, rope_scaling(cfg))
    assert got_factor == pytest.approx(want_factor, rel=1e-12) and got_factor != 1.0
    torch.testing.assert_close(got_freq, want_freq, rtol=1e-6, atol=0)
    plain, _ = rope.rope_frequencies(D, cfg.rope_theta)
    assert (got_freq[0] == plain[0]) and torch.allclose(got_freq[-1], plain[-1] / 4)  # extrapolated .. interpolated


def test_logits_equal_transformers_past_the_original_context(imported):
    x = tokens()
    with torch.no_grad():
        ours = imported["model"](x).float()
        theirs = imported["hf"](x).logits.float()
    assert (ours - theirs).abs().max().item() < 1e-4


def test_export_back_writes_the_same_rope_scaling_and_logits(imported):
    out = imported["root"] / "back"
    run_export(ExportConfig(path=str(imported["root"] / "ours" / "model.pt"), out=str(out), format="hf"))
    written = json.loads((out / "config.json").read_text())
    scaling = written.get("rope_scaling") or written["rope_parameters"]
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 4.0
    assert scaling["original_max_position_embeddings"] == 16
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert ROPE_INIT_FUNCTIONS["yarn"](back.config, "cpu")[1] == pytest.approx(
        ROPE_INIT_FUNCTIONS["yarn"](imported["hf"].config, "cpu")[1], rel=1e-12
    )
    with torch.no_grad():
        assert (back(tokens()).logits - imported["hf"](tokens()).logits).abs().max().item() < 1e-4


def test_flags_build_the_same_tables_as_the_imported_config():
    """--rope-scaling yarn --rope-scaling-factor 4 --rope-original-max-positions 16 = the HF config's yarn."""
    cfg = LlamaConfig(rope_theta=1e6, rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_positions=16)
    imported = LlamaConfig(
        **options_from_hf(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "max_position_embeddings": 64,
                "rope_theta": 1e6,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
            },
            "x",
        )
    )
    assert rope_scaling(cfg) == rope_scaling(imported)


def llama_config(**rope) -> dict:
    """A tiny LlamaForCausalLM config.json with the rotary settings ``rope``."""
    shapes = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    return {"model_type": "llama", **shapes, "max_position_embeddings": 64, **rope}


@pytest.mark.parametrize(
    "scaling, fragment",
    [
        ({"rope_type": "yarn", "factor": 4.0}, "has no original_max_position_embeddings"),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "truncate": "no"},
            "truncate 'no': true or false",
        ),
        ({"rope_type": "longrope", "factor": 4.0}, "default, llama3, yarn and linear"),
    ],
)
def test_yarn_settings_computed_otherwise_are_refused_in_one_line(scaling, fragment):
    config = llama_config(rope_scaling=scaling)
    with pytest.raises(UserError, match=fragment) as err:
        options_from_hf(config, "config.json")
    assert "\n" not in str(err.value)


def test_untruncated_correction_range_equals_transformers():
    """gpt-oss's ``truncate`` false: the ramp's ends stay fractional; frequencies equal transformers' and differ
    from the truncated ones; the option is read from config.json and written back."""
    scaling = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "truncate": False}
    config = llama_config(rope_theta=150000.0, rope_scaling=scaling)
    cfg = LlamaConfig(**options_from_hf(config, "x"))
    assert cfg.rope_yarn_truncate is False
    want, _ = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**config), "cpu")
    got, _ = rope.rope_frequencies(16, cfg.rope_theta, rope_scaling(cfg))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    cfg.rope_yarn_truncate = True
    assert not torch.allclose(rope.rope_frequencies(16, cfg.rope_theta, rope_scaling(cfg))[0], want)
    cfg.rope_yarn_truncate = False
    from toolkit.models.common.hf_config import hf_rope_scaling

    assert hf_rope_scaling(cfg)["truncate"] is False


def test_yarn_betas_in_the_wrong_order_are_refused():
    cfg = LlamaConfig(rope_scaling="yarn", rope_scaling_factor=4.0, rope_yarn_beta_fast=1.0, rope_yarn_beta_slow=2.0)
    with pytest.raises(UserError, match="--rope-yarn-beta-fast 1.0: must not be below"):
        check_shapes(cfg)
