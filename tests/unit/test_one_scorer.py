"""The one scorer (toolkit.inference): target_log_probs is ensemble_log_probs' distribution gathered at the targets,
for plain and adaptive-softmax models, ensembles, softmax batches and models whose forward returns
``(tensor, extra)`` (what training accepts), computed here independently in float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from toolkit import inference
from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

V, PAD = 29, 1


def tiny(seed: int, **overrides) -> TransformerLanguageModel:
    values = dict(
        decoder_layers=1,
        decoder_embed_dim=16,
        decoder_ffn_embed_dim=32,
        decoder_attention_heads=2,
        max_target_positions=12,
        dropout=0.0,
    )
    values.update(overrides)
    return TransformerLanguageModel(TransformerLMConfig(**values), V, PAD, seed=seed).eval()


class WithExtra(torch.nn.Module):
    """A plugin-style model: forward returns (output, extra), as training's criterions accept."""

    def __init__(self, inner: TransformerLanguageModel):
        super().__init__()
        self.inner = inner

    def forward(self, tokens, incremental_state=None):
        return self.inner(tokens), {"attn": None}

    def get_normalized_probs(self, net_output, log_probs=True):
        return self.inner.get_normalized_probs(net_output[0], log_probs)


def direct(models, inputs, targets) -> torch.Tensor:
    """log mean_m p_m(target) in float64 for plain-softmax models (the adaptive softmax's float64 check is
    tests/test_adaptive.py's, against fairseq's factorization)."""
    per_model = []
    for m in models:
        m64 = copy.deepcopy(m).double()
        with torch.no_grad():
            logp = torch.log_softmax(m64(inputs), dim=-1)  # plain output layer: the logits, in float64
        per_model.append(logp.gather(-1, targets[..., None])[..., 0].exp())
    return torch.stack(per_model).mean(0).log()


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(PAD + 1, V, (3, 10), generator=g)
    return inputs, inputs.roll(-1, dims=1)


@pytest.mark.parametrize("softmax_batch", [0, 7])
@pytest.mark.parametrize(
    "members",
    [
        [dict(seed=1)],
        [dict(seed=1), dict(seed=2)],
        [dict(seed=3, adaptive_softmax_cutoff="8,16"), dict(seed=4)],
    ],
)
def test_target_log_probs_is_the_ensemble_distribution_at_the_targets(members, softmax_batch):
    models = [tiny(**m) for m in members]
    inputs, targets = batch()
    got = inference.target_log_probs(models, inputs, targets, softmax_batch)
    full = inference.ensemble_log_probs(models, inputs)
    assert got.dtype == torch.float32 and got.shape == targets.shape
    torch.testing.assert_close(got, full.gather(-1, targets[..., None])[..., 0])
    if all(m.adaptive_softmax is None for m in models):
        torch.testing.assert_close(got.double(), direct(models, inputs, targets), rtol=1e-5, atol=1e-5)


def test_positions_normalize_only_the_rows_asked():
    models = [tiny(1), tiny(2, adaptive_softmax_cutoff="8,16")]
    inputs, _ = batch(1)
    positions = torch.tensor([[0, 9], [3, 4], [9, 9]])
    some = inference.ensemble_log_probs(models, inputs, positions)
    full = inference.ensemble_log_probs(models, inputs)
    torch.testing.assert_close(some, full.gather(1, positions[:, :, None].expand(-1, -1, V)))
    assert math.isclose(float(some[0, 0].exp().sum()), 1.0, rel_tol=1e-5)


def test_a_model_returning_output_and_extra_scores_like_its_tensor():
    inner = tiny(5)
    inputs, targets = batch(2)
    plain = inference.target_log_probs([inner], inputs, targets)
    torch.testing.assert_close(inference.target_log_probs([WithExtra(inner)], inputs, targets, softmax_batch=4), plain)
    stream = torch.randint(PAD + 1, V, (25,), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(
        inference.score_stream([WithExtra(inner)], stream, 2, tokens_per_sample=12),
        inference.score_stream([inner], stream, 2, tokens_per_sample=12),
    )
