"""A model family is a folder and one registration line (``toolkit.core.registry.BUILTIN_FAMILIES``): every built-in
family provides its options, named sizes, model, tensor-parallel plan and Hugging Face adapter; a new family written
as a folder (a GPT-NeoX-like toy: LayerNorm, an ungated GELU MLP, a quarter of each head rotated, built from
``toolkit.models.common``'s blocks) registered by one line builds, trains a step, splits by its plan and converts
its state dict through its adapter; the three placements of the norms compute what their formulas say."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import textwrap

import pytest
import torch

from toolkit import models
from toolkit.core import registry
from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.common.hf_adapter import HFAdapter
from toolkit.models.decoder import DecoderInterface


@pytest.mark.parametrize("family", sorted(registry.BUILTIN_FAMILIES))
def test_every_family_provides_options_sizes_model_plan_and_adapter(family):
    registry.import_all_components()
    parts = registry.family_modules(family, registry.BUILTIN_FAMILIES[family])
    entry = registry.MODEL_REGISTRY.get(family)
    options_module, _, options_class = parts["options"].partition(":")
    assert dataclasses.is_dataclass(entry.config)
    assert getattr(importlib.import_module(options_module), options_class) is entry.config
    sizes = sorted(a for a, model in registry.ARCH_MODEL_NAME.items() if model == family)
    assert family in sizes and len(sizes) > 1, sizes  # its bare name and its named sizes
    assert issubclass(entry.cls, DecoderInterface) and entry.cls.__module__ == parts["model"]
    for module in ("parallel", "hf"):
        importlib.import_module(f"toolkit.models.{family}.{module}")
    adapter = entry.cls.HF_ADAPTER
    assert issubclass(adapter, HFAdapter) and adapter.FAMILY == family and entry.cls.HF_CLASSES == adapter.CLASSES
    for arch in [a for a in sizes if a == family or "tiny" in a]:  # the published sizes: the same modules, more
        model = models.build_on_meta(arch, 64, 16)
        plan = model.tensor_parallel_plan()
        assert isinstance(plan, TensorParallelPlan)
        for path in plan.top:
            model.get_submodule(path)
        built = {name for layer in model.layers for name, _ in layer.named_modules()}
        assert set(plan.block) | set(plan.experts) <= built, arch  # in some block (a hybrid's: of either kind)


TOY = {
    "__init__.py": """
        '''A GPT-NeoX-like toy family, for the test that a family is a folder and one registration line.'''
        from . import archs  # noqa: F401
    """,
    "config.py": """
        from dataclasses import dataclass

        from toolkit.models.common.options import DecoderOptions


        @dataclass
        class ToyConfig(DecoderOptions):
            pass
    """,
    "archs.py": """
        from toolkit.core.registry import register_model_architecture
        from toolkit.models.common.options import set_shape


        @register_model_architecture("toy", "toy")
        def toy(cfg):
            cfg.partial_rotary_factor = 0.25


        @register_model_architecture("toy", "toy_tiny")
        def toy_tiny(cfg):
            set_shape(cfg, layers=2, dim=32, ffn=64, heads=2, kv=2)
            cfg.partial_rotary_factor = 0.25
    """,
    "parallel.py": """
        from toolkit.models.common.parallel import decoder_plan

        BLOCK = {
            "self_attn.q_proj": "column", "self_attn.k_proj": "column", "self_attn.v_proj": "column",
            "mlp.up_proj": "column", "self_attn.o_proj": "row", "mlp.down_proj": "row",
        }


        def tensor_parallel_plan(model):
            return decoder_plan(model, BLOCK)
    """,
    "hf.py": """
        from toolkit.models.common import hf_config
        from toolkit.models.common.hf_adapter import DecoderHFAdapter, KeyMap

        KIND = hf_config.DecoderClass("ToyForCausalLM")


        class ToyAdapter(DecoderHFAdapter):
            FAMILY = "toy"
            CLASSES = {"toy": "ToyForCausalLM"}
            KEY_MAP = KeyMap(rules=(("output_projection.weight", "embed_out.weight"), ("{name}", "gpt.{name}")))

            def options_from_hf(self, config, where):
                rotary = {"partial_rotary_factor": config["partial_rotary_factor"]}
                return {**hf_config.shape_options(config, KIND), **hf_config.rope_options(config, where), **rotary}

            def hf_config(self, cfg, vocab_size, base=None):
                return "ToyForCausalLM", hf_config.decoder_hf_config(cfg, vocab_size, base, "toy", partial_rotary=True)
    """,
    "model.py": """
        import torch.nn as nn

        from toolkit.core.registry import register_model
        from toolkit.models.common.attention import Attention
        from toolkit.models.common.blocks import PreNormBlock
        from toolkit.models.common.mlp import FeedForward
        from toolkit.models.common.options import head_dim, kv_heads
        from toolkit.models.common.rotary_decoder import RotaryDecoderLM

        from .config import ToyConfig
        from .hf import ToyAdapter
        from .parallel import tensor_parallel_plan


        @register_model("toy", dataclass=ToyConfig)
        class ToyLanguageModel(RotaryDecoderLM):
            HF_ADAPTER = ToyAdapter
            HF_CLASSES = ToyAdapter.CLASSES

            def build_block(self, cfg, index, window):
                attention = Attention(cfg.decoder_embed_dim, cfg.decoder_attention_heads, kv_heads(cfg), head_dim(cfg))
                mlp = FeedForward(cfg.decoder_embed_dim, cfg.decoder_ffn_embed_dim, activation="gelu")
                return PreNormBlock(attention, mlp, norm=lambda: nn.LayerNorm(cfg.decoder_embed_dim))

            def build_norm(self, dim):
                return nn.LayerNorm(dim)

            def tensor_parallel_plan(self):
                return tensor_parallel_plan(self)
    """,
}


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """The toy folder, written to disk and registered by one line; the registries restored afterwards."""
    folder = tmp_path / "plugin_families" / "toy"
    folder.mkdir(parents=True)
    (folder.parent / "__init__.py").write_text("")
    for name, text in TOY.items():
        (folder / name).write_text(textwrap.dedent(text))
    registry.import_all_components()
    monkeypatch.syspath_prepend(str(tmp_path))
    tables = (registry.MODEL_REGISTRY.entries, registry.ARCH_MODEL_NAME, registry.ARCH_CONFIG_FN)
    before = [set(table) for table in tables]
    try:
        yield registry.declare_family("toy", "ToyConfig", package="plugin_families")  # the one registration line
    finally:
        for table, names in zip(tables, before):
            for name in set(table) - names:
                del table[name]
        for name in [m for m in sys.modules if m.startswith("plugin_families")]:
            del sys.modules[name]


def test_a_family_is_a_folder_and_one_registration_line(toy_family):
    from types import SimpleNamespace

    from toolkit.data.dictionary import Dictionary

    d = Dictionary()
    for i in range(20):
        d.add_symbol(f"w{i}")
    task = SimpleNamespace(dictionary=d, cfg=SimpleNamespace(tokens_per_sample=16))
    model = models.build_model("toy_tiny", models.model_config("toy_tiny"), task)
    assert type(model).__name__ == "ToyLanguageModel" and model.rope_cos.shape == (16, 4)  # heads of 16, a quarter
    tokens = torch.randint(4, len(d), (2, 16))
    loss = torch.nn.functional.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    plan = model.tensor_parallel_plan()
    for path in plan.block:
        model.layers[0].get_submodule(path)
    adapter = model.HF_ADAPTER()
    _, config = adapter.hf_config(model.cfg, len(d))
    assert config["model_type"] == "toy"
    theirs = adapter.state_to_hf(model.state_dict(), "toy")
    assert "embed_out.weight" in theirs and "gpt.layers.0.mlp.up_proj.weight" in theirs
    given = adapter.options_from_hf(config, "config.json")
    assert models.model_config("toy", **given) == model.cfg
    back = adapter.state_from_hf(iter(theirs.items()), given, "toy")
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def placements():
    from toolkit.models.common.blocks import NormAfterBlock, PreNormBlock, SandwichBlock

    return {
        PreNormBlock: lambda n, a, m, x: (lambda h: h + m(n[1](h)))(x + a(n[0](x))),
        NormAfterBlock: lambda n, a, m, x: (lambda h: h + n[1](m(h)))(x + n[0](a(x))),
        SandwichBlock: lambda n, a, m, x: (lambda h: h + n[3](m(n[2](h))))(x + n[1](a(n[0](x)))),
    }


@pytest.mark.parametrize("placement", ["PreNormBlock", "NormAfterBlock", "SandwichBlock"])
def test_each_placement_computes_its_formula(placement):
    """The block around stand-in sublayers (the attention a fixed matrix, the MLP tanh): norms where its class says,
    each its own module, registered in Hugging Face's order."""
    from toolkit.models.common import blocks

    cls = getattr(blocks, placement)
    torch.manual_seed(0)

    class Attend(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, h, cos, sin, kv_cache=None, attn_mask=None, context_parallel=None):
            return h @ self.w

    def norm():
        layer = torch.nn.LayerNorm(8)
        torch.nn.init.normal_(layer.weight)
        return layer

    block = cls(Attend(), torch.nn.Tanh(), norm)
    norms = [m for name, m in block.named_children() if name.endswith("layernorm")]
    x = torch.randn(2, 5, 8)
    formula = placements()[cls]
    torch.testing.assert_close(block(x, None, None), formula(norms, block.self_attn.w.__rmatmul__, torch.tanh, x))
    names = [name for name, _ in block.named_children()]
    order = ["input_layernorm", "self_attn", "post_attention_layernorm", "pre_feedforward_layernorm", "mlp"]
    assert names == [n for n in order + ["post_feedforward_layernorm"] if n in names]
