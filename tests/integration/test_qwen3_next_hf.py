"""Hugging Face Qwen3-Next and Qwen3.5 checkpoints in and out (``models/qwen3_next/hf.py``): a random tiny
Qwen3NextForCausalLM (three gated DeltaNet layers and one gated full-attention layer with half of each head rotated,
4 experts and a gated shared expert), Qwen3_5MoeForCausalLM of the same shapes (the linear layers' projections split)
and Qwen3_5ForCausalLM (dense MLPs), each saved by transformers with a tokenizer. ``--from hf`` keeps the tokenizer's ids; the imported
model's log-probs equal transformers' within 1e-4 in fp32 on 80 positions (more than one 64-position chunk of the
delta rule); decoding through the recurrent states (linear layers) and the K/V cache (the full one) gives the full
forward's log-probs and transformers' greedy tokens; ``--format hf`` writes the same class back, tensor for tensor
the folder transformers saved, with the same log-probs. Qwen3.5 as released (``Qwen3_5ForConditionalGeneration`` and
its MoE class: the text model under ``text_config`` and ``model.language_model.``, a one-block vision tower,
M-RoPE's sections; the dense one's embeddings tied at the top level only) imports as its text model (the vision
tensors left out, one log line): the same log-probs and greedy tokens as the vision-language class given the ids
alone, and ``--format hf`` writes the text class, tensor for tensor the folder's text model."""

from __future__ import annotations

import json
import logging
import logging.handlers
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.helpers.hf_llama import greedy_pair  # noqa: E402
from tests.helpers.hf_qwen3_next import make_hf_qwen3_next  # noqa: E402
from tests.helpers.mtp_reference import layer_state, mtp_loss, our_mtp_loss  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402
from toolkit.inference import load_model  # noqa: E402
from toolkit.models.common.attention import KVCache, RecurrentState  # noqa: E402

pytestmark = pytest.mark.integration


CLASSES = {  # the folder's kind -> the class --format hf writes
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_vl": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_vl": "Qwen3_5MoeForCausalLM",
}
DENSE = ("qwen3_5", "qwen3_5_vl")


@pytest.fixture(scope="module", params=sorted(CLASSES))
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_hf_qwen3_next(str(root / "hf"), request.param)
    log, logger = logging.handlers.BufferingHandler(100), logging.getLogger("toolkit.export.hf_import")
    level = logger.level
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    try:
        run_export(ExportConfig(path=str(root / "hf"), out=str(root / "ours"), import_from="hf"))
    finally:
        logger.removeHandler(log)
        logger.setLevel(level)
    model, task, args = load_model(str(root / "ours" / "model.pt"), str(root / "ours"))
    lines = [record.getMessage() for record in log.buffer]
    return dict(root=root, hf=hf, model=model, task=task, args=args, kind=request.param, log=lines)


def batch(n: int = 80) -> torch.Tensor:
    return torch.randint(3, 60, (2, n), generator=torch.Generator().manual_seed(1))


def test_imported_options_and_ids(imported):
    model, d = imported["model"], imported["task"].dictionary
    cfg = model.cfg
    qwen3_5, dense = imported["kind"] != "qwen3_next", imported["kind"] in DENSE
    assert (cfg.full_attention_interval, cfg.partial_rotary_factor, cfg.moe_shared_ffn_embed_dim) == (
        4,
        0.5,
        0 if dense else 24,
    )
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (2, 4, 8)
    assert (cfg.linear_split_projections, cfg.dense_mlp) == (qwen3_5, dense)
    assert cfg.share_decoder_input_output_embed == (imported["kind"] == "qwen3_5_vl")  # the top level's, not text's
    assert type(model.layers[0].self_attn).__name__ == "GatedDeltaNet"
    assert type(model.layers[3].self_attn).__name__ == "GatedAttention"
    text = imported["hf"].config.get_text_config()
    assert len(d) == text.vocab_size and d.eos() == text.eos_token_id
    vision_line = [line for line in imported["log"] if "vision tower" in line]
    if imported["kind"].endswith("_vl"):
        vision = sum(name.startswith("model.visual.") for name, _ in imported["hf"].named_parameters())
        assert len(vision_line) == 1 and f"imported as its text model ({CLASSES[imported['kind']]}" in vision_line[0]
        assert f"left out the vision tower's {vision} tensors" in vision_line[0]
    else:
        assert not vision_line
    assert cfg.mtp_depth == 1 and type(model.mtp[0].layer.self_attn).__name__ == "GatedAttention"
    tok = transformers.AutoTokenizer.from_pretrained(str(imported["root"] / "ours"))
    ids = tok("w3 w17 w59 w0")["input_ids"]
    assert ids == transformers.AutoTokenizer.from_pretrained(str(imported["root"] / "hf"))("w3 w17 w59 w0")["input_ids"]


def test_the_imported_mtp_layer_computes_qwens_multi_token_prediction(imported):
    """The depth's training loss equals the one transformers' own modules give from the folder's ``mtp.*`` tensors
    as vLLM's Qwen3NextMultiTokenPredictor runs them (``tests/helpers/mtp_reference.py``): ``pre_fc_norm_embedding``
    and ``pre_fc_norm_hidden`` (zero-centered), ``mtp.fc``, the block in a copy of the full-attention layer 3,
    ``mtp.norm``."""
    from safetensors.torch import load_file

    hf, model = imported["hf"], imported["model"]
    if imported["kind"].endswith("_vl"):  # a released folder: the same layer beside the vision-language class's text
        hf = SimpleNamespace(model=hf.model.language_model, lm_head=hf.lm_head, config=hf.config.get_text_config())
    mtp = {
        k[len("mtp.") :]: v
        for k, v in load_file(str(imported["root"] / "hf" / "model.safetensors")).items()
        if k.startswith("mtp.")
    }
    block = layer_state(mtp, "layers.0.", getattr(hf.config, "num_experts", 0))
    norms = [mtp[f"{n}.weight"] for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")]
    x = batch(17)
    want = mtp_loss(hf, 3, block, norms, mtp["fc.weight"], x[:, :-1], x[:, 1:], model.padding_idx)
    torch.testing.assert_close(our_mtp_loss(model, x[:, :-1], x[:, 1:]), want, rtol=1e-4, atol=1e-5)


def test_log_probs_equal_transformers(imported):
    model, hf, x = imported["model"], imported["hf"], batch()
    with torch.no_grad():
        ours = model.get_normalized_probs(model(x))
        theirs = torch.log_softmax(hf(x).logits.float(), dim=-1)
    assert (ours - theirs).abs().max().item() < 1e-4
    if imported["kind"] == "qwen3_5_vl":  # the vision-language class given the ids alone, greedy by full forwards
        prompt = torch.tensor([[1, 5, 9, 13, 7, 8]])
        with torch.no_grad():
            assert greedy(model, prompt, 6) == greedy(lambda seq: hf(seq).logits, prompt, 6)


def greedy(forward, prompt: torch.Tensor, steps: int) -> list:
    """The ``steps`` tokens argmax picks after ``prompt``, each from a full forward of the sequence so far."""
    seq = prompt
    for _ in range(steps):
        seq = torch.cat([seq, forward(seq)[:, -1:].argmax(-1)], dim=1)
    return seq[0, prompt.size(1) :].tolist()


def test_decoding_keeps_recurrent_states_and_equals_the_full_forward_and_transformers(imported):
    model, x = imported["model"], batch(12)
    with torch.no_grad():
        full = model.get_normalized_probs(model(x))
        state = {}
        steps = [model(x[:, :5], incremental_state=state)] + [
            model(x[:, t : t + 1], incremental_state=state) for t in range(5, 12)
        ]
    torch.testing.assert_close(model.get_normalized_probs(torch.cat(steps, dim=1)), full, rtol=0, atol=1e-4)
    assert [type(c) for c in state["layers"]] == [RecurrentState] * 3 + [KVCache]
    if imported["kind"] == "qwen3_next":  # transformers' generate with the same layers is slow: one class
        want, got = greedy_pair(model, imported["hf"], torch.tensor([[1, 5, 9, 13, 7, 8]]), 6)
        assert got == want


def test_export_back_is_the_same_class_tensors_and_log_probs(imported):
    from safetensors import safe_open

    back = imported["root"] / "back"
    run_export(ExportConfig(path=str(imported["root"] / "ours" / "model.pt"), out=str(back), format="hf"))
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    assert type(hf2).__name__ == CLASSES[imported["kind"]]
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(hf2(x).logits, imported["hf"](x).logits, rtol=0, atol=1e-5)
    with (
        safe_open(str(imported["root"] / "hf" / "model.safetensors"), "pt") as a,
        safe_open(str(back / "model.safetensors"), "pt") as b,
    ):
        text = {  # the folder's text model under the text class's names
            name.replace("model.language_model.", "model."): name
            for name in a.keys()
            if not name.startswith("model.visual.")
        }
        assert set(text) == set(b.keys())
        for name, theirs in text.items():
            assert torch.equal(a.get_tensor(theirs).float(), b.get_tensor(name).float()), name
    if imported["kind"].endswith("_vl"):
        config = json.loads((back / "config.json").read_text())
        assert config["rope_parameters"]["mrope_section"] == [1, 1, 0] and "vision_config" not in config
        assert config["tie_word_embeddings"] == (imported["kind"] == "qwen3_5_vl")
