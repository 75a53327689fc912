"""fairseq transformer_lm checkpoints in (eval-lm, hub, trainer) and out (--to-fairseq).

Files are built from fairseq's documented key names (tests/helpers/fairseq_layout.py); the
loaded model's logits are compared with a direct forward over those weights using
separate q/k/v projections.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from tests.helpers.fairseq_layout import (
    fairseq_010_checkpoint,
    fairseq_main_checkpoint,
    fairseq_param_names,
    fairseq_shapes,
    model_options,
    random_fairseq_model,
    reference_logits,
    task_options,
)
from tests.helpers.lm_fixtures import make_data_bin
from toolkit import inference
from toolkit.compat.fairseq import checkpoint as fc
from toolkit.compat.fairseq import export as fairseq_export
from toolkit.core.errors import UserError

LINES = ["the cat sat on the mat", "a dog ran far", "the dog sat on a mat"] * 4
MAX_POS = 24


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsck") / "data")
    return path, len(make_data_bin(path, {"train": LINES, "valid": LINES, "test": LINES}))


def check_logits(path, data_dir, sd, learned, tied):
    model, task, args = inference.load_model(path, data_dir)
    tokens = torch.randint(4, len(task.dictionary), (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(ours, reference_logits(sd, tokens, 2, 1, learned, tied), rtol=1e-5, atol=1e-5)
    return model, args


@pytest.mark.parametrize(
    "layout,learned,tied", [("0.10", True, False), ("0.10", False, True), ("main", False, False), ("main", True, True)]
)
def test_fairseq_checkpoint_loads_with_same_logits(tmp_path, data, layout, learned, tied):
    data_dir, vocab = data
    sd = random_fairseq_model(V=vocab, max_pos=MAX_POS, learned=learned, tied=tied)
    build = fairseq_010_checkpoint if layout == "0.10" else fairseq_main_checkpoint
    path = str(tmp_path / "checkpoint_last.pt")
    torch.save(
        build(sd, model_options(max_pos=MAX_POS, learned=learned, tied=tied), task_options(data_dir, MAX_POS)), path
    )
    model, args = check_logits(path, data_dir, sd, learned, tied)
    assert args.tokens_per_sample == MAX_POS and model.max_positions() == MAX_POS
    assert (model.output_projection is None) == tied


class _Node:
    """Stands in for omegaconf's nodes when *writing* a 0.12-style pickle (omegaconf is not installed)."""

    def __init__(self, value):
        self._val, self._metadata, self._parent = value, None, None


class _Container:
    def __init__(self, content):
        self._content, self._metadata, self._parent = content, _Metadata(), None


class _Metadata:
    def __init__(self):
        self.ref_type, self.object_type, self.optional, self.flags = object, dict, True, {}


def _fake_module(monkeypatch, module, **classes):
    parts = module.split(".")
    for i in range(1, len(parts)):  # parents must be importable too
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    mod = types.ModuleType(module)
    for name, cls in classes.items():
        cls.__module__, cls.__qualname__, cls.__name__ = module, name, name
        setattr(mod, name, cls)
    monkeypatch.setitem(sys.modules, module, mod)


def to_omegaconf(value):
    if isinstance(value, dict):
        return _Container({k: to_omegaconf(v) for k, v in value.items()})
    return _Node(value)


def test_pickled_omegaconf_cfg_loads(tmp_path, data, monkeypatch):
    """fairseq 0.10.1-0.12 pickled the DictConfig itself, with StrEnum choice values."""
    import enum

    data_dir, vocab = data
    choices = enum.Enum("Choices", {"none": "none", "eos": "eos"}, type=str)
    dict_config = type("DictConfig", (_Container,), {})
    any_node = type("AnyNode", (_Node,), {})
    _fake_module(monkeypatch, "omegaconf.dictconfig", DictConfig=dict_config)
    _fake_module(monkeypatch, "omegaconf.nodes", AnyNode=any_node)
    _fake_module(monkeypatch, "omegaconf.base", ContainerMetadata=_Metadata)
    _fake_module(monkeypatch, "fairseq.dataclass.constants", Choices=choices)

    def build(value):
        if isinstance(value, dict):
            return dict_config({k: build(v) for k, v in value.items()})
        return any_node(value)

    sd = random_fairseq_model(V=vocab, max_pos=MAX_POS, learned=True)
    task = {**task_options(data_dir, MAX_POS), "sample_break_mode": choices("none")}
    state = fairseq_main_checkpoint(sd, model_options(max_pos=MAX_POS), task)
    state["cfg"] = build(state["cfg"])
    path = str(tmp_path / "omegaconf.pt")
    torch.save(state, path)
    monkeypatch.undo()  # the stand-in modules are gone: loading must not need omegaconf or fairseq
    with pytest.raises(Exception):
        torch.load(path, weights_only=True)  # the reason for the restricted unpickler
    _, args = check_logits(path, data_dir, sd, learned=True, tied=False)
    assert args.sample_break_mode == "none"


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_forged_payload_is_refused_without_running(tmp_path, data):
    data_dir, vocab = data
    marker = tmp_path / "pwned"
    state = fairseq_010_checkpoint(
        random_fairseq_model(V=vocab, max_pos=MAX_POS), model_options(max_pos=MAX_POS), task_options(data_dir, MAX_POS)
    )
    state["extra_state"]["evil"] = _Payload(marker)
    path = str(tmp_path / "evil.pt")
    torch.save(state, path)
    with pytest.raises(UserError) as e:
        inference.load_model(path, data_dir)
    assert str(e.value) == f"{path}: refusing to load: unexpected object posix.system"
    assert not marker.exists()


@pytest.mark.parametrize(
    "option,value,extra_key",
    [("adaptive_softmax_cutoff", "20000,60000", None), ("scale_attn", True, "decoder.layers.0.attn_ln.weight")],
)
def test_unimplemented_fairseq_feature_is_one_line(tmp_path, data, option, value, extra_key):
    data_dir, vocab = data
    sd = random_fairseq_model(V=vocab, max_pos=MAX_POS)
    if extra_key:
        sd[extra_key] = torch.ones(16)
    path = str(tmp_path / "x.pt")
    torch.save(
        fairseq_main_checkpoint(sd, {**model_options(max_pos=MAX_POS), option: value}, task_options(data_dir, MAX_POS)),
        path,
    )
    with pytest.raises(UserError) as e:
        inference.load_model(path, data_dir)
    assert "\n" not in str(e.value) and (
        "--" + option.replace("_", "-") in str(e.value) or (extra_key or "") in str(e.value)
    )


def test_old_decoder_version_has_no_final_norm(tmp_path, data):
    data_dir, vocab = data
    sd = random_fairseq_model(V=vocab, max_pos=MAX_POS)
    sd["decoder.version"] = torch.Tensor([2])
    path = str(tmp_path / "v2.pt")
    torch.save(fairseq_main_checkpoint(sd, model_options(max_pos=MAX_POS), task_options(data_dir, MAX_POS)), path)
    model, _, _ = inference.load_model(path, data_dir)
    assert model.layer_norm is None  # fairseq's upgrade_state_dict_named drops it for version <= 2


def test_hub_reads_fairseq_checkpoint(tmp_path, data):
    data_dir, vocab = data
    sd = random_fairseq_model(V=vocab, max_pos=MAX_POS, learned=False, tied=True)
    torch.save(
        fairseq_main_checkpoint(
            sd, model_options(max_pos=MAX_POS, learned=False, tied=True), task_options(data_dir, MAX_POS)
        ),
        str(tmp_path / "model.pt"),
    )
    from toolkit.inference.hub_utils import from_pretrained

    lm = from_pretrained(str(tmp_path), "model.pt", data_dir, device="cpu")
    scored = lm.score("the cat sat")
    tokens = torch.cat([torch.tensor([lm.dictionary.eos()]), scored["tokens"][:-1]])[None]
    logp = torch.log_softmax(reference_logits(sd, tokens, 2, 1, False, True)[0], -1)
    expected = logp[torch.arange(len(scored["tokens"])), scored["tokens"]]
    torch.testing.assert_close(scored["positional_scores"], expected, rtol=1e-5, atol=1e-5)


# ---- optimizer state --------------------------------------------------------------------------


def _adam_state(sd, flat: bool, tied: bool):
    keys = [
        k
        for k in sd
        if not k.endswith(("version", "_float_tensor")) and not (tied and k.endswith("output_projection.weight"))
    ]
    moments = {k: (torch.randn(sd[k].shape), torch.rand(sd[k].shape)) for k in keys}
    if flat:  # FP16Optimizer: one flat fp32 vector over fairseq's parameter order
        state = {
            0: {
                "step": 7,
                "exp_avg": torch.cat([moments[k][0].reshape(-1) for k in keys]),
                "exp_avg_sq": torch.cat([moments[k][1].reshape(-1) for k in keys]),
            }
        }
    else:
        state = {i: {"step": 7, "exp_avg": moments[k][0], "exp_avg_sq": moments[k][1]} for i, k in enumerate(keys)}
    return {"state": state, "param_groups": [{"lr": [1e-3], "params": list(state)}], "loss_scale": 128.0}, moments


@pytest.mark.parametrize("flat,tied", [(False, False), (True, True)])
def test_optimizer_moments_map_to_our_names(data, flat, tied):
    _, vocab = data
    sd = random_fairseq_model(V=vocab, max_pos=MAX_POS, tied=tied)
    optim, moments = _adam_state(sd, flat, tied)
    state = fairseq_main_checkpoint(sd, model_options(max_pos=MAX_POS, tied=tied), {}, optimizer_state=optim)
    mapped = fc.map_optimizer_state(state, shared=tied)
    qkv = torch.cat([moments[f"decoder.layers.1.self_attn.{p}_proj.weight"][0] for p in "qkv"])
    torch.testing.assert_close(mapped["layers.1.self_attn.qkv_proj.weight"]["exp_avg"], qkv)
    torch.testing.assert_close(mapped["layers.0.fc2.weight"]["exp_avg_sq"], moments["decoder.layers.0.fc2.weight"][1])
    assert ("output_projection.weight" in mapped) == (not tied)
    assert float(mapped["embed_tokens.weight"]["step"]) == 7.0


def test_fp16_adam_stats_are_rescaled(data):
    """fairseq's cpu_adam --fp16-adam-stats keeps (moment / scale) in fp16 and the scale beside it."""
    _, vocab = data
    sd = random_fairseq_model(V=vocab, max_pos=MAX_POS)
    optim, moments = _adam_state(sd, flat=False, tied=False)
    for entry in optim["state"].values():
        entry["exp_avg_scale"] = 4.0
        entry["exp_avg"] = (entry["exp_avg"] / 4.0).half()
    state = fairseq_main_checkpoint(sd, model_options(max_pos=MAX_POS), {}, optimizer_state=optim)
    mapped = fc.map_optimizer_state(state, shared=False)
    torch.testing.assert_close(
        mapped["layers.0.fc1.weight"]["exp_avg"], moments["decoder.layers.0.fc1.weight"][0], rtol=1e-3, atol=1e-3
    )


def test_optimizer_state_that_does_not_map_is_none(data):
    _, vocab = data
    sd = random_fairseq_model(V=vocab, max_pos=MAX_POS)
    state = fairseq_main_checkpoint(
        sd, model_options(max_pos=MAX_POS), {}, optimizer_state={"state": {0: {"momentum_buffer": torch.zeros(3)}}}
    )
    assert fc.map_optimizer_state(state, shared=False) is None


# ---- export ----------------------------------------------------------------------------------


@pytest.mark.parametrize("learned,tied", [(True, False), (False, True)])
def test_export_layout_and_round_trip(tmp_path, data, learned, tied):
    data_dir, vocab = data
    sd = random_fairseq_model(V=vocab, max_pos=MAX_POS, learned=learned, tied=tied, seed=9)
    src = str(tmp_path / "in.pt")
    torch.save(
        fairseq_main_checkpoint(
            sd, model_options(max_pos=MAX_POS, learned=learned, tied=tied), task_options(data_dir, MAX_POS)
        ),
        src,
    )
    model, _, args = inference.load_model(src, data_dir)
    toolkit_ckpt = str(tmp_path / "toolkit.pt")
    torch.save(
        {
            "cfg": vars(args),
            "model": model.state_dict(),
            "extra_state": {"trainer": {"num_updates": 3}, "train_iterator": {"epoch": 2}},
        },
        toolkit_ckpt,
    )
    out = str(tmp_path / "fairseq.pt")
    fairseq_export.export(toolkit_ckpt, out)

    written = torch.load(out, weights_only=True)  # plain values only: fairseq's torch.load reads it
    assert written["args"] is None and {"model", "task", "common"} <= set(written["cfg"])
    assert list(written["model"]) == fairseq_param_names(2, learned, tied)
    shapes = fairseq_shapes(2, 16, 24, vocab, 1, MAX_POS, learned)
    assert {k: tuple(v.shape) for k, v in written["model"].items()} == shapes
    assert written["model"]["decoder.version"].tolist() == [3.0]
    assert written["cfg"]["model"]["decoder_learned_pos"] == learned
    assert written["cfg"]["model"]["share_decoder_input_output_embed"] == tied
    assert written["cfg"]["task"]["tokens_per_sample"] == MAX_POS
    assert written["optimizer_history"][-1]["num_updates"] == 3
    assert written["extra_state"]["train_iterator"]["epoch"] == 2
    for key in sd:
        if not key.endswith("_float_tensor"):
            torch.testing.assert_close(written["model"][key], sd[key])
    check_logits(out, data_dir, sd, learned, tied)  # and back in: same logits


@pytest.mark.parametrize("flat", [False, True])
def test_load_fairseq_into_trainer(tmp_path, data, flat):
    """--restore-file/--finetune-from-model with a fairseq file: weights and Adam moments, by our names."""
    import types as _types

    from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

    data_dir, vocab = data
    sd = random_fairseq_model(V=vocab, max_pos=MAX_POS)
    optim, moments = _adam_state(sd, flat, tied=False)
    path = str(tmp_path / "checkpoint_last.pt")
    torch.save(
        fairseq_010_checkpoint(
            sd, model_options(max_pos=MAX_POS), task_options(data_dir, MAX_POS), optimizer_state=optim
        ),
        path,
    )
    cfg = TransformerLMConfig(
        decoder_layers=2,
        decoder_embed_dim=16,
        decoder_ffn_embed_dim=24,
        decoder_attention_heads=2,
        decoder_learned_pos=True,
        max_target_positions=MAX_POS,
    )
    model = TransformerLanguageModel(cfg, vocab, 1, seed=0)
    trainer = _types.SimpleNamespace(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    info = fc.load_fairseq_into_trainer(path, trainer)
    assert info == {"num_updates": 7, "epoch": 1}
    torch.testing.assert_close(
        model.layers[0].self_attn.qkv_proj.bias.detach(),
        torch.cat([sd[f"decoder.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"]),
    )
    state = trainer.optimizer.state[model.layers[1].self_attn.qkv_proj.weight]
    torch.testing.assert_close(
        state["exp_avg_sq"], torch.cat([moments[f"decoder.layers.1.self_attn.{p}_proj.weight"][1] for p in "qkv"])
    )
    assert float(state["step"]) == 7.0
    torch.testing.assert_close(
        trainer.optimizer.state[model.embed_tokens.weight]["exp_avg"], moments["decoder.embed_tokens.weight"][0]
    )


def test_resume_from_a_fairseq_file_sets_updates_and_restarts_the_epoch(tmp_path, data):
    """The adapter's resume (what --restore-file does with a fairseq file): weights, the saved update count
    handed to the trainer, and the saved epoch started over (fairseq's data position does not map onto ours)."""
    import types as _types

    from toolkit.compat.fairseq import adapter
    from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

    data_dir, vocab = data
    sd = random_fairseq_model(V=vocab, max_pos=MAX_POS)
    path = str(tmp_path / "checkpoint_last.pt")
    torch.save(fairseq_010_checkpoint(sd, model_options(max_pos=MAX_POS), task_options(data_dir, MAX_POS)), path)
    cfg = TransformerLMConfig(
        decoder_layers=2,
        decoder_embed_dim=16,
        decoder_ffn_embed_dim=24,
        decoder_attention_heads=2,
        decoder_learned_pos=True,
        max_target_positions=MAX_POS,
    )
    model = TransformerLanguageModel(cfg, vocab, 1, seed=0)
    loaded = {}
    trainer = _types.SimpleNamespace(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        load_state_dict=lambda state, reset_lr_scheduler: loaded.update(state),
    )
    position = adapter.resume_trainer(path, adapter.read_checkpoint(path), trainer, reset_optimizer=True)
    assert position == {"epoch": 1, "iterations_in_epoch": 0, "shuffle": True}
    assert loaded == {"num_updates": 7}
    torch.testing.assert_close(model.embed_tokens.weight.detach(), sd["decoder.embed_tokens.weight"])


def test_a_fairseq_script_unpacks_logits_and_extra(tmp_path, data):
    """``logits, extra = model(src)`` on a model from fairseq's Python API (load_model_ensemble_and_task, the
    hub's ``.models``): the logits and fairseq's ``extra`` (``inner_states`` [T, B, C], embedded input then
    each layer's output; ``attn`` [None]) equal a direct forward over the fairseq weights; the library's
    scorer reads such a model unchanged."""
    from tests.helpers.fairseq_layout import reference_forward
    from toolkit import checkpoint_utils
    from toolkit.inference.hub_utils import from_pretrained

    data_dir, vocab = data
    sd = random_fairseq_model(V=vocab, max_pos=MAX_POS)
    path = str(tmp_path / "model.pt")
    torch.save(fairseq_main_checkpoint(sd, model_options(max_pos=MAX_POS), task_options(data_dir, MAX_POS)), path)
    [model], _, _ = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides={"data": data_dir})
    hub = from_pretrained(str(tmp_path), "model.pt", data_dir)
    tokens = torch.randint(4, vocab, (3, 11), generator=torch.Generator().manual_seed(0))
    want_logits, want_extra = reference_forward(sd, tokens, 2, 1, learned=True, tied=False)
    for loaded in (model, hub.models[0]):
        with torch.no_grad():
            logits, extra = loaded(tokens)
            again, _ = loaded(tokens)  # a second call starts its own list
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert set(extra) >= {"attn", "inner_states"} and extra["attn"] == [None]
        assert len(extra["inner_states"]) == len(want_extra["inner_states"]) == 3
        for got, want in zip(extra["inner_states"], want_extra["inner_states"]):
            assert got.shape == (11, 3, 16)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again, logits)
    plain, _, _ = inference.load_model(path, data_dir)
    torch.testing.assert_close(
        inference.ensemble_log_probs([model], tokens), inference.ensemble_log_probs([plain], tokens)
    )
