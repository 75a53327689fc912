"""The arithmetic under ToolkitLM, without lm-eval: left truncation, batching and shared inputs change
no log-likelihood; generation stops where ``stop`` says."""

from __future__ import annotations

import pytest
import torch

from toolkit.config import options
from toolkit.data.dictionary import Dictionary
from toolkit.core.errors import UserError
from toolkit.evaluation import scoring
from toolkit.generation import GenerationConfig, SequenceGenerator
from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

POSITIONS = 12


@pytest.fixture(scope="module")
def lm():
    d = Dictionary()
    for i in range(40):
        d.add_symbol(f"w{i}")
    values = options.architecture_defaults(
        "transformer_lm",
        {
            "decoder_layers": 2,
            "decoder_embed_dim": 32,
            "decoder_ffn_embed_dim": 64,
            "decoder_attention_heads": 4,
            "decoder_input_dim": 32,
            "decoder_output_dim": 32,
            "dropout": 0.0,
            "max_target_positions": POSITIONS,
        },
    )
    model = TransformerLanguageModel(options.config_from_args(TransformerLMConfig, values), len(d), d.pad(), seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model.eval(), d


def one_by_one(model, context, continuation):
    """The definition: the last POSITIONS tokens of context + continuation minus the last, scored alone."""
    tokens = (list(context) + list(continuation))[-(POSITIONS + 1) :]
    with torch.no_grad():
        logp = model.get_normalized_probs(model(torch.tensor([tokens[:-1]])))[0]
    cont = torch.tensor(continuation)
    rows = logp[-len(cont) :]
    return float(rows.gather(1, cont[:, None]).sum()), bool((rows.argmax(-1) == cont).all())


def test_batched_sorted_truncated_and_shared_requests_equal_one_by_one(lm):
    model, d = lm
    g = torch.Generator().manual_seed(0)
    pairs = []
    for n in (1, 3, 5, 11, 14, 20):  # 14 and 20 exceed the positions: truncated from the left
        context = [d.eos()] + torch.randint(4, len(d), (n,), generator=g).tolist()
        for m in (1, 2, 1):
            pairs.append((context, torch.randint(4, len(d), (m,), generator=g).tolist()))
    pairs.append((pairs[0][0], pairs[0][1]))  # an exact repeat
    want = [one_by_one(model, c, x) for c, x in pairs]
    for batch_size in (1, 4, 64):
        got = scoring.loglikelihood_tokens([model], pairs, POSITIONS, d.pad(), batch_size)
        assert [g[1] for g in got] == [w[1] for w in want]
        assert max(abs(a[0] - b[0]) for a, b in zip(got, want)) < 1e-5


def test_a_continuation_longer_than_the_model_is_one_line(lm):
    model, d = lm
    with pytest.raises(UserError, match="longer than the model's 12 positions"):
        scoring.loglikelihood_tokens([model], [([d.eos()], [5] * 13)], POSITIONS, d.pad())


def test_generation_stops_where_stop_says(lm):
    model, d = lm
    cfg = GenerationConfig(beam=1, min_len=0, max_len_b=POSITIONS, max_new_tokens=8)
    prompts = [torch.tensor([5, 6]), torch.tensor([7, 8, 9])]
    free = SequenceGenerator([model], d, cfg).generate(prompts)
    cut = [h[0]["tokens"][len(p) : len(p) + 2] for h, p in zip(free, prompts)]  # stop after 2 new tokens
    seen = []

    def stop(i, tokens):
        seen.append(i)
        return len(tokens) >= 2 and torch.equal(tokens[:2], cut[i])

    stopped = SequenceGenerator([model], d, cfg).generate(prompts, stop=stop)
    for h, p, c in zip(stopped, prompts, cut):
        assert h[0]["tokens"].tolist() == p.tolist() + c.tolist() + [d.eos()]
    assert set(seen) == {0, 1}
