"""Adaptive input / softmax, adaptive_loss, the wiki103/gbw archs and the decoder's size/LayerDrop flags.

References are computed here, independently of toolkit.models.adaptive: band lookups and
projections by hand, the factorized softmax in float64, fairseq's state-dict key names and
shapes (fairseq/modules/adaptive_input.py, adaptive_softmax.py) written out, and parameter
counts from the module shapes of fairseq's transformer_lm_baevski_wiki103.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.adaptive import C, CUTOFF, PAD, model, tokens
from tests.helpers.cli import run_cli
from tests.helpers.dist_helpers import make_lm_data_bin
from tests.helpers.fairseq_readme import readme_argv
from toolkit.criterions.adaptive_loss import AdaptiveLoss
from toolkit.train.trainer import forward_and_loss


def test_every_band_gets_a_gradient_even_without_its_tokens():
    """DDP (c10d) needs every parameter in every backward: absent bands run on zero rows."""
    m = model().train()
    x = torch.randint(2, CUTOFF[0], (2, 8))  # head words only
    task = SimpleNamespace(target_dictionary=SimpleNamespace(pad=lambda: PAD))
    loss, _, _ = forward_and_loss(m, AdaptiveLoss(task), {"net_input": {"src_tokens": x}, "target": x, "ntokens": 16})
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    assert torch.count_nonzero(m.embed_tokens.embeddings[2][0].weight.grad) == 0


def test_dropout_placement_follows_fairseq():
    """--adaptive-softmax-dropout: on the softmax input and after each tail projection, training only."""
    m = model(adaptive_softmax_dropout=0.5).train()
    tails = [t[1] for t in m.adaptive_softmax.tail]
    assert all(isinstance(d, torch.nn.Dropout) and d.p == 0.5 for d in tails)
    h = torch.randn(2, 4, C)
    x = tokens(2, 4)
    assert m.adaptive_softmax.loss(h, x, PAD).item() != m.adaptive_softmax.loss(h, x, PAD).item()
    m.eval()
    assert m.adaptive_softmax.loss(h, x, PAD).item() == m.adaptive_softmax.loss(h, x, PAD).item()


def _ran_layers(m, x):
    ran = []
    handles = [layer.register_forward_hook(lambda mod, a, o, i=i: ran.append(i)) for i, layer in enumerate(m.layers)]
    m(x)
    for h in handles:
        h.remove()
    return ran


def test_layerdrop_skips_whole_layers_in_training_the_same_way_for_the_same_seed():
    ranks = [model(decoder_layers=8, decoder_layerdrop=0.5) for _ in range(2)]
    assert _ran_layers(ranks[0].eval(), tokens()) == list(range(8))  # evaluation runs every layer
    runs = []
    for rank, m in enumerate(ranks):  # the trainer seeds each update with seed + num_updates on every rank
        m.train()
        torch.manual_seed(123)
        torch.rand(17 if rank else 3)  # different RNG use before (different batch sizes)
        runs.append([_ran_layers(m, tokens()) for _ in range(3)])
    assert runs[0] == runs[1]
    assert any(len(r) < 8 for r in runs[0]) and runs[0][0] != runs[0][1]  # draws differ per forward


@pytest.fixture(scope="module")
def wikitext_bin(tmp_path_factory):
    """A synthetic data-bin of 128 symbols (the bands below are 20 / 40 / 68 words)."""
    return make_lm_data_bin(str(tmp_path_factory.mktemp("adaptive") / "bin"))


def test_readme_adaptive_inputs_command_without_the_missing_loop_flags(wikitext_bin, tmp_path):
    """The same command with the two training-loop flags the toolkit lacks replaced by its own names."""
    argv = readme_argv(wikitext_bin, str(tmp_path), "--skip-invalid-size-inputs-valid-test", "--ddp-backend=legacy_ddp")
    run = run_cli("toolkit_cli.train", argv + ["--ddp-backend", "no_c10d"])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    losses = run.losses()
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())
    assert run.records("train_inner")[0]["wpb"] == "192"  # --update-freq 3 x 64 tokens
    # eval-lm's scoring path (inference.score_stream) through the hub: get_normalized_probs of the adaptive softmax
    from toolkit.inference.hub_utils import from_pretrained

    hub = from_pretrained(str(tmp_path), "checkpoint_last.pt", wikitext_bin)
    scored = hub.score("w1 w2")
    assert scored["positional_scores"].shape == (3,) and bool(torch.isfinite(scored["positional_scores"]).all())
    assert isinstance(hub.sample("w1", max_len=4, seed=0), str) and isinstance(
        hub.sample("w1", sampling=False, beam=2, max_len=3), str
    )
