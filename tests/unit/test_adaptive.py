"""Adaptive input / softmax, adaptive_loss, the wiki103/gbw archs and the decoder's size/LayerDrop flags.

References are computed here, independently of toolkit.models.adaptive: band lookups and
projections by hand, the factorized softmax in float64, fairseq's state-dict key names and
shapes (fairseq/modules/adaptive_input.py, adaptive_softmax.py) written out, and parameter
counts from the module shapes of fairseq's transformer_lm_baevski_wiki103.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.adaptive import C, CUTOFF, PAD, V, cfg, model, tokens
from toolkit.criterions.adaptive_loss import AdaptiveLoss
from toolkit.train.trainer import forward_and_loss
from toolkit.core.errors import UserError
import toolkit.models as toolkit_models
from toolkit.models import build_on_meta, model_config
from toolkit.models.accounting import count_parameters
from toolkit.models.adaptive import band_token_shares, from_fairseq_state_dict, to_fairseq_state_dict
from toolkit.models.init import init_weights
from toolkit.models.transformer_lm import TransformerLanguageModel

DIMS = [32, 16, 8]  # factor 2

UNTIED = dict(adaptive_input=False, tie_adaptive_weights=False, tie_adaptive_proj=False)
VARIANTS = {"tied+proj": {}, "tied": dict(tie_adaptive_proj=False), "softmax_only": UNTIED}


def fairseq_adaptive_shapes(variant: str) -> dict:
    """Key -> shape of fairseq's adaptive modules under ``decoder.`` (aliases and buffers included)."""
    tied, tie_proj = variant != "softmax_only", variant == "tied+proj"
    out = {}
    if tied:
        for i, (lo, hi) in enumerate(zip([0] + CUTOFF, CUTOFF)):
            out[f"decoder.embed_tokens.embeddings.{i}.0.weight"] = (hi - lo, DIMS[i])
            out[f"decoder.embed_tokens.embeddings.{i}.1.weight"] = (C, DIMS[i])
        out["decoder.embed_tokens._float_tensor"] = (1,)
        out["decoder.adaptive_softmax.head.word_proj.weight"] = (CUTOFF[0], C)  # alias of band 0's embedding
        out["decoder.adaptive_softmax.head.class_proj.weight"] = (2, C)
        out["decoder.adaptive_softmax.head._float_tensor"] = (1,)
    else:
        out["decoder.embed_tokens.weight"] = (V, C)
        out["decoder.adaptive_softmax.head.weight"] = (CUTOFF[0] + 2, C)
    for i in range(2):
        size = CUTOFF[i + 1] - CUTOFF[i]
        out[f"decoder.adaptive_softmax.tail.{i}.0.weight"] = (C, DIMS[i + 1]) if tie_proj else (DIMS[i + 1], C)
        out[f"decoder.adaptive_softmax.tail.{i}.2.weight"] = (size, DIMS[i + 1])
    out["decoder.adaptive_softmax.version"] = (1,)
    return out


def fairseq_state(variant: str, body: TransformerLanguageModel, seed=5) -> dict:
    """A fairseq-layout state dict: random adaptive tensors (tied aliases equal to their source) plus
    the body's tensors under ``decoder.`` (those names are the fairseq-import path's business)."""
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(shape, generator=g) * 0.3 for k, shape in fairseq_adaptive_shapes(variant).items()}
    state["decoder.adaptive_softmax.version"] = torch.LongTensor([1])
    if variant != "softmax_only":
        state["decoder.adaptive_softmax.head.word_proj.weight"] = state["decoder.embed_tokens.embeddings.0.0.weight"]
        for i in range(2):
            state[f"decoder.adaptive_softmax.tail.{i}.2.weight"] = state[
                f"decoder.embed_tokens.embeddings.{i + 1}.0.weight"
            ]
            if variant == "tied+proj":
                state[f"decoder.adaptive_softmax.tail.{i}.0.weight"] = state[
                    f"decoder.embed_tokens.embeddings.{i + 1}.1.weight"
                ]
    for k, v in body.state_dict().items():
        if not k.startswith(("embed_tokens", "adaptive_softmax")):
            state["decoder." + k] = v.clone()
    return state


def direct_embedding(state: dict, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(*x.shape, C, dtype=torch.float64)
    for pos, t in enumerate(x.reshape(-1).tolist()):
        band = next(i for i, hi in enumerate(CUTOFF) if t < hi)
        lo = CUTOFF[band - 1] if band else 0
        e = state[f"decoder.embed_tokens.embeddings.{band}.0.weight"][t - lo].double()
        out.view(-1, C)[pos] = state[f"decoder.embed_tokens.embeddings.{band}.1.weight"].double() @ e
    return out


def direct_nll(state: dict, variant: str, h: torch.Tensor, target: torch.Tensor) -> float:
    """-sum log p(target) of fairseq's factorized softmax from its tensors, float64, padding skipped."""
    s = {k: v.double() for k, v in state.items() if v.is_floating_point()}
    if variant == "softmax_only":
        head_w = s["decoder.adaptive_softmax.head.weight"]
    else:
        head_w = torch.cat(
            [s["decoder.adaptive_softmax.head.word_proj.weight"], s["decoder.adaptive_softmax.head.class_proj.weight"]]
        )
    total = 0.0
    for hv, t in zip(h.reshape(-1, C).double(), target.reshape(-1).tolist()):
        if t == PAD:
            continue
        logp_head = torch.log_softmax(head_w @ hv, 0)
        if t < CUTOFF[0]:
            total -= logp_head[t].item()
            continue
        band = 1 if t < CUTOFF[1] else 2
        proj = s[f"decoder.adaptive_softmax.tail.{band - 1}.0.weight"]
        z = hv @ proj if variant == "tied+proj" else proj @ hv  # TiedLinear(transpose=True) vs Linear
        logits = s[f"decoder.adaptive_softmax.tail.{band - 1}.2.weight"] @ z
        total -= (logp_head[CUTOFF[0] + band - 1] + torch.log_softmax(logits, 0)[t - CUTOFF[band - 1]]).item()
    return total


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fairseq_layout_state_dict_loads_and_its_loss_is_the_direct_computation(variant):
    m = model(**VARIANTS[variant])
    state = fairseq_state(variant, m)
    mapped = from_fairseq_state_dict(state, m)
    assert set(mapped) == set(m.state_dict())  # 1:1 once aliases and buffers are dropped
    m.load_state_dict(mapped)
    x = tokens()
    target = x.roll(-1, dims=1)
    target[1, -4:] = PAD
    if variant != "softmax_only":
        features = {}
        m.layers[0].register_forward_pre_hook(lambda mod, a: features.setdefault("x", a[0]))
    h = m(x)
    if variant != "softmax_only":  # sqrt(C) * adaptive input + sinusoidal positions enter layer 0
        torch.testing.assert_close(
            features["x"].double(),
            math.sqrt(C) * direct_embedding(state, x) + m.sinusoidal_positions[:16].double(),
            rtol=1e-5,
            atol=1e-5,
        )
    task = SimpleNamespace(target_dictionary=SimpleNamespace(pad=lambda: PAD))
    sample = {"net_input": {"src_tokens": x}, "target": target, "ntokens": int((target != PAD).sum())}
    loss, sample_size, log = forward_and_loss(m, AdaptiveLoss(task), sample)
    assert loss.item() == pytest.approx(direct_nll(state, variant, h.detach(), target), rel=1e-5)
    assert sample_size == sample["ntokens"] and log["nsentences"] == 3
    # and back: our state dict in fairseq's layout is the one we started from
    back = to_fairseq_state_dict(m.state_dict(), m)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state if not k.endswith("_float_tensor"))  # uninitialized


def test_shapes_are_fairseqs_and_cutoff_gets_the_vocabulary_size():
    for variant, overrides in VARIANTS.items():
        m = model(**overrides)
        ours = {k: tuple(v.shape) for k, v in to_fairseq_state_dict(m.state_dict(), m).items()}
        want = fairseq_adaptive_shapes(variant)
        assert {k: v for k, v in ours.items() if k in want} == want, variant
        assert m.adaptive_softmax.cutoff == CUTOFF
    with pytest.raises(UserError, match="larger than the vocabulary"):
        model(adaptive_softmax_cutoff="10,40", **UNTIED)
    assert model(adaptive_softmax_cutoff="10,20,37", **UNTIED).adaptive_softmax.cutoff == CUTOFF


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_normalized_probs_are_the_factorized_softmax(variant):
    m = model(**VARIANTS[variant])
    state = to_fairseq_state_dict(m.state_dict(), m)
    x = tokens()
    h = m(x)
    logp = m.get_normalized_probs(h, log_probs=True)
    assert logp.shape == (3, 16, V) and logp.dtype == torch.float32
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(3, 16), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.get_normalized_probs(h, log_probs=False), logp.exp())
    for t in (3, 15, 25):  # one word per band
        target = torch.full((1, 1), t)
        want = -direct_nll(state, variant, h[0, 5].detach()[None, None], target)
        assert logp[0, 5, t].item() == pytest.approx(want, rel=1e-5)
    plain = TransformerLanguageModel(cfg(**UNTIED, adaptive_softmax_cutoff=None), V, PAD, seed=0).eval()
    torch.testing.assert_close(plain.get_normalized_probs(plain(x)), torch.log_softmax(plain(x), -1))


def test_adaptive_loss_needs_an_adaptive_softmax_and_reduce_false_is_per_position():
    task = SimpleNamespace(target_dictionary=SimpleNamespace(pad=lambda: PAD))
    x = tokens()
    plain = TransformerLanguageModel(cfg(**UNTIED, adaptive_softmax_cutoff=None), V, PAD, seed=0)
    with pytest.raises(UserError, match="adaptive-softmax-cutoff"):
        forward_and_loss(plain, AdaptiveLoss(task), {"net_input": {"src_tokens": x}, "target": x, "ntokens": 48})
    m = model()
    per_pos = m.adaptive_softmax.loss(m(x), x, PAD, reduce=False)
    logp = m.get_normalized_probs(m(x))
    torch.testing.assert_close(
        per_pos, -logp.reshape(-1, V).gather(1, x.reshape(-1, 1)).squeeze(1), rtol=1e-5, atol=1e-5
    )


def test_tying_errors_are_one_line():
    with pytest.raises(UserError, match="needs --adaptive-input"):
        model(adaptive_input=False)
    with pytest.raises(UserError, match="must equal --adaptive-softmax-factor"):
        model(adaptive_softmax_factor=4.0)
    with pytest.raises(UserError, match="must equal --adaptive-softmax-cutoff"):
        model(adaptive_softmax_cutoff="10,30")
    with pytest.raises(UserError, match="--decoder-output-dim"):
        model(decoder_output_dim=16)
    with pytest.raises(UserError, match="increasing"):
        model(adaptive_input_cutoff="20,10", adaptive_softmax_cutoff="20,10")


def test_init_follows_fairseq_and_meta_build_equals_plain_build():
    for overrides in (
        *VARIANTS.values(),
        dict(decoder_input_dim=16, decoder_output_dim=24, layernorm_embedding=True, **UNTIED),
    ):
        direct = model(seed=9, **overrides)
        with torch.device("meta"):
            deferred = TransformerLanguageModel(cfg(**overrides), V, PAD)
        deferred.to_empty(device="cpu")
        init_weights(deferred, 9)
        for name, value in direct.state_dict().items():
            assert torch.equal(deferred.state_dict()[name], value), name
    m = model(seed=1)
    for i, band in enumerate(m.embed_tokens.embeddings):
        emb, proj = band[0].weight, band[1].weight
        assert torch.count_nonzero(emb[PAD]) == 0  # fairseq zeroes row padding_idx of every band
        assert emb.std().item() == pytest.approx(DIMS[i] ** -0.5, rel=0.25)
        assert proj.abs().max() <= math.sqrt(6 / (C + DIMS[i]))
    w = model(seed=1, **UNTIED).adaptive_softmax.tail[0][0].weight  # xavier-uniform
    assert w.abs().max() <= math.sqrt(6 / (C + DIMS[1])) and w.std().item() > 0.5 * math.sqrt(2 / (C + DIMS[1]))


def test_input_output_dims_add_fairseqs_projections_only_when_they_differ():
    m = model(decoder_input_dim=16, decoder_output_dim=24, **UNTIED, adaptive_softmax_cutoff=None)
    assert m.embed_tokens.weight.shape == (V, 16)
    assert m.project_in_dim.weight.shape == (C, 16) and m.project_out_dim.weight.shape == (24, C)
    assert m.project_in_dim.bias is None and m.output_projection.weight.shape == (V, 24)
    assert m(tokens()).shape == (3, 16, V)
    same = model(decoder_input_dim=C, decoder_output_dim=C, **UNTIED, adaptive_softmax_cutoff=None)
    assert same.project_in_dim is None and same.project_out_dim is None
    with_asm = model(decoder_output_dim=24, **UNTIED)
    assert with_asm(tokens()).shape == (3, 16, 24) and with_asm.adaptive_softmax.input_dim == 24


def test_layernorm_embedding_normalizes_what_enters_the_first_layer():
    m = model(layernorm_embedding=True)
    seen = {}
    m.layers[0].register_forward_pre_hook(lambda mod, a: seen.setdefault("x", a[0]))
    m(tokens())
    torch.testing.assert_close(seen["x"].mean(-1), torch.zeros(3, 16), rtol=0, atol=1e-5)
    assert "layernorm_embedding.weight" in m.state_dict()


def test_layers_to_keep_builds_fewer_layers_and_loads_a_full_checkpoint_pruned():
    full = model(decoder_layers=4, seed=2)
    pruned = TransformerLanguageModel(cfg(decoder_layers=4, decoder_layers_to_keep="3,1"), V, PAD, seed=0)
    assert len(pruned.layers) == 2
    pruned.load_state_dict(full.state_dict())
    assert torch.equal(pruned.layers[0].fc1.weight, full.layers[1].fc1.weight)
    assert torch.equal(pruned.layers[1].fc1.weight, full.layers[3].fc1.weight)
    pruned.load_state_dict(pruned.state_dict())  # its own (already pruned) checkpoint loads as it is
    with pytest.raises(UserError, match="not in the checkpoint"):
        TransformerLanguageModel(cfg(decoder_layers=4, decoder_layers_to_keep="1,7"), V, PAD).load_state_dict(
            full.state_dict()
        )


def fairseq_wiki103_count(vocab: int) -> int:
    """transformer_lm_baevski_wiki103 from fairseq's module shapes (tied weights once)."""
    C_, F_, L_ = 1024, 4096, 16
    bands = [(0, 20000), (20000, 60000), (60000, vocab)]
    adaptive_input = sum((hi - lo) * (C_ // 4**i) + (C_ // 4**i) * C_ for i, (lo, hi) in enumerate(bands))
    head_class_proj = 2 * C_  # word_proj and the tails are tied to the adaptive input
    layer = 4 * (C_ * C_ + C_) + (C_ * F_ + F_) + (F_ * C_ + C_) + 2 * 2 * C_  # q,k,v,out; fc1, fc2; 2 LNs
    return adaptive_input + head_class_proj + L_ * layer  # no final norm, sinusoidal positions


def test_wiki103_and_gbw_archs_have_fairseqs_values_and_counts(capsys):
    c = model_config("transformer_lm_wiki103")
    assert (c.decoder_layers, c.decoder_embed_dim, c.decoder_ffn_embed_dim, c.decoder_attention_heads) == (
        16,
        1024,
        4096,
        8,
    )
    assert (c.dropout, c.attention_dropout, c.activation_dropout, c.adaptive_softmax_dropout) == (0.3, 0.1, 0.1, 0.2)
    assert c.adaptive_input and c.tie_adaptive_weights and c.tie_adaptive_proj and c.no_decoder_final_norm
    assert c.adaptive_input_cutoff == c.adaptive_softmax_cutoff == "20000,60000"
    assert model_config("transformer_lm_baevski_wiki103") == c
    n = count_parameters("transformer_lm_wiki103", vocab_size=267744, tokens_per_sample=3072, verbose=True)
    assert n == fairseq_wiki103_count(267744) and round(n / 1e6) == 247
    assert toolkit_models.count_parameters("transformer_lm_wiki103", vocab_size=267744) == n
    assert "transformer_lm_wiki103 at V=267,744" in capsys.readouterr().out
    g = model_config("transformer_lm_gbw")
    assert (g.decoder_layers, g.decoder_embed_dim, g.decoder_ffn_embed_dim, g.decoder_attention_heads) == (
        12,
        512,
        4096,
        16,
    )
    assert (g.dropout, g.attention_dropout, g.no_decoder_final_norm) == (0.1, 0.1, True)
    assert model_config("transformer_lm_baevski_gbw") == g
    V_gbw = 793471
    layer = 4 * (512 * 512 + 512) + (512 * 4096 + 4096) + (4096 * 512 + 512) + 4 * 512
    assert count_parameters("transformer_lm_gbw", vocab_size=V_gbw) == 2 * V_gbw * 512 + 12 * layer


def test_flops_count_the_head_for_every_token_and_tails_by_their_share():
    m = build_on_meta("transformer_lm_wiki103", vocab_size=267744, tokens_per_sample=3072)
    shares = band_token_shares([20000, 60000, 267744])
    assert sum(shares) == pytest.approx(1.0) and shares[0] > 0.75
    body = sum(p.numel() for n, p in m.named_parameters() if n.startswith("layers."))
    dims = [1024, 256, 64]
    adaptive_input = sum(s * d * 1024 for s, d in zip(shares, dims))
    head = (20000 + 2) * 1024
    tails = shares[1] * (1024 * 256 + 256 * 40000) + shares[2] * (1024 * 64 + 64 * 207744)
    assert m.num_matmul_parameters() == round(body + adaptive_input + head + tails)
    full = build_on_meta(
        "transformer_lm_wiki103",
        vocab_size=267744,
        tokens_per_sample=3072,
        adaptive_softmax_cutoff=None,
        tie_adaptive_weights=False,
        tie_adaptive_proj=False,
    )
    assert m.flops_per_token(3072) < 0.6 * full.flops_per_token(3072)  # what the adaptive softmax saves


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_losses_and_probabilities_stay_fp32(dtype):
    """Under autocast (--bf16/--fp16) and with half weights (FSDP2's policy, --memory-efficient-fp16)."""
    m = model(seed=3)
    x = tokens()
    task = SimpleNamespace(target_dictionary=SimpleNamespace(pad=lambda: PAD))
    sample = {"net_input": {"src_tokens": x}, "target": x, "ntokens": x.numel()}
    want, _, _ = forward_and_loss(m, AdaptiveLoss(task), sample)
    with torch.autocast("cpu", dtype=dtype):
        got, _, _ = forward_and_loss(m, AdaptiveLoss(task), sample)
        logp = m.get_normalized_probs(m(x))
    assert got.dtype == torch.float32 and logp.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=2e-2)
    half = model(seed=3).to(dtype)
    got, _, _ = forward_and_loss(half, AdaptiveLoss(task), sample)
    got.backward()
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=2e-2)
    assert all(p.grad is not None and p.grad.dtype == dtype for p in half.parameters())


def write_fairseq_adaptive_checkpoint(variant: str, path) -> dict:
    """fairseq's file of an adaptive ``transformer_lm_wiki103``-style model; returns its (fairseq-keyed) state."""
    state = fairseq_state(variant, model(**VARIANTS[variant]))
    for key in [k for k in state if ".qkv_proj." in k]:  # fairseq keeps q, k and v apart
        for part, value in zip("qkv", state.pop(key).chunk(3)):
            state[key.replace("qkv_proj", f"{part}_proj")] = value
    options = {k: v for k, v in dataclasses.asdict(cfg(**VARIANTS[variant])).items() if v is not None}
    options.update(_name="transformer_lm", adaptive_softmax_cutoff="10,20", tokens_per_sample=16)
    checkpoint = {
        "args": None,
        "model": state,
        "optimizer_history": [{"num_updates": 7}],
        "cfg": {"model": options, "task": {"_name": "language_modeling", "tokens_per_sample": 16}},
    }
    torch.save(checkpoint, path)
    return state


def write_adaptive_data_bin(folder, lines, split: str = "valid"):
    """A data-bin whose dictionary is the model's V ids (w4 ... w36 after the 4 specials)."""
    from tests.helpers.lm_fixtures import make_data_bin

    make_data_bin(folder, {split: lines}, symbols=[f"w{i}" for i in range(4, V)], padding_factor=1)
    return folder


@pytest.mark.parametrize("variant", ["tied+proj", "softmax_only"])
def test_eval_lm_on_a_fairseq_adaptive_checkpoint_is_the_hub_score_and_the_direct_computation(variant, tmp_path):
    """eval-lm scored the adaptive softmax's features as if they were logits (index 87 is out of bounds): now
    it goes through get_normalized_probs, the hub's scorer, and sums what a float64 computation gives."""
    from toolkit import inference
    from toolkit.inference.eval_lm_main import EvalLMConfig, main

    state = write_fairseq_adaptive_checkpoint(variant, tmp_path / "fairseq_adaptive.pt")
    words = "w4 w12 w30 w36 w5 w21 w11 w9 w33 w19 w6"  # every band, one block with its </s> (12 < 16 tokens)
    data = write_adaptive_data_bin(tmp_path / "bin", [words], split="test")
    result = main(
        EvalLMConfig(data=str(data), path=str(tmp_path / "fairseq_adaptive.pt"), cpu=True, no_progress_bar=True)
    )
    loaded, task, _ = inference.load_model(str(tmp_path / "fairseq_adaptive.pt"), str(data))
    stream = task.dictionary.encode_line(words).long()  # the words and </s>
    hub = inference.score_stream([loaded], stream, task.dictionary.eos(), tokens_per_sample=16)
    inputs = torch.cat([stream.new_tensor([task.dictionary.eos()]), stream[:-1]])[None]
    with torch.no_grad():
        direct = direct_nll(state, variant, loaded(inputs), stream[None])
    assert result["count"] == len(stream) == 12
    assert result["loss"] * math.log(2) * result["count"] == pytest.approx(direct, rel=1e-5)
    assert -float(hub.double().sum()) == pytest.approx(direct, rel=1e-5)


WIKI103_TINY = dict(
    decoder_layers=2,
    decoder_embed_dim=C,
    decoder_ffn_embed_dim=64,
    decoder_attention_heads=4,
    adaptive_input_cutoff="10,20",
    adaptive_softmax_cutoff="10,20",
    adaptive_input_factor=2.0,
    adaptive_softmax_factor=2.0,
)


def write_wiki103_checkpoint(folder, data) -> TransformerLanguageModel:
    """A toolkit checkpoint (as the trainer writes it: flat cfg + state) of a tiny ``--arch transformer_lm_wiki103``:
    adaptive input and softmax, tied weights and projections, no final norm; every value randomized."""
    from toolkit import options

    arch = "transformer_lm_wiki103"
    m = TransformerLanguageModel(model_config(arch, max_target_positions=16, **WIKI103_TINY), V, PAD, seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    cfg = {
        "task": "language_modeling",
        "arch": arch,
        "data": str(data),
        "tokens_per_sample": 16,
        "sample_break_mode": "none",
        "add_bos_token": False,
        "seed": 1,
        **options.architecture_defaults(arch, WIKI103_TINY),
    }
    folder.mkdir()
    torch.save({"cfg": cfg, "model": m.state_dict()}, folder / "checkpoint_best.pt")
    return m.eval()


def test_eval_lm_on_a_wiki103_checkpoint_is_the_hub_score_and_the_float64_computation(tmp_path):
    """The one scorer (inference.ensemble_log_probs through get_normalized_probs) on the adaptive softmax of
    ``--arch transformer_lm_wiki103``: eval-lm's sum = the hub's positional scores = fairseq's factorized
    softmax computed in float64 from the checkpoint's tensors."""
    from toolkit.inference.eval_lm_main import EvalLMConfig, main
    from toolkit.inference.hub_utils import from_pretrained

    words = "w4 w12 w30 w36 w5 w21 w11 w9 w33 w19 w6"  # every band, one block with its </s> (12 < 16 tokens)
    data = write_adaptive_data_bin(tmp_path / "bin", [words], split="test")
    m = write_wiki103_checkpoint(tmp_path / "run", data)
    result = main(
        EvalLMConfig(data=str(data), path=str(tmp_path / "run" / "checkpoint_best.pt"), cpu=True, no_progress_bar=True)
    )
    hub = from_pretrained(str(tmp_path / "run"), "checkpoint_best.pt", str(data))
    scored = hub.score(words)
    stream = scored["tokens"]
    inputs = torch.cat([stream.new_tensor([hub.dictionary.eos()]), stream[:-1]])[None]
    with torch.no_grad():
        direct = direct_nll(to_fairseq_state_dict(m.state_dict(), m), "tied+proj", m(inputs), stream[None])
    assert result["count"] == len(stream) == 12
    assert result["loss"] * math.log(2) * result["count"] == pytest.approx(direct, rel=1e-5)
    assert -float(scored["positional_scores"].double().sum()) == pytest.approx(direct, rel=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fairseq_adaptive_checkpoint_loads_through_eval_and_hub_path(variant, tmp_path):
    """fairseq's file layout (cfg sections, ``decoder.`` keys, separate q/k/v, tied aliases, buffers) read by
    ``toolkit.inference.load_model`` (eval-lm and the hub): its loss equals the direct computation."""
    from toolkit import inference

    state = write_fairseq_adaptive_checkpoint(variant, tmp_path / "fairseq_adaptive.pt")
    data = write_adaptive_data_bin(tmp_path / "bin", ["w4 w5"])
    loaded, task, _ = inference.load_model(str(tmp_path / "fairseq_adaptive.pt"), str(data))
    assert len(task.dictionary) == V
    x = tokens()
    target = x.roll(-1, dims=1)
    with torch.no_grad():
        h = loaded(x)
        logp = loaded.get_normalized_probs(h, log_probs=True)
    nll = -logp.gather(-1, target.unsqueeze(-1)).double().sum().item()
    assert nll == pytest.approx(direct_nll(state, variant, h, target), rel=1e-5)
