"""Generation: the KV cache, greedy / sampling / beam search against direct computations, the two commands."""

import itertools
import math

import pytest
import torch

from toolkit.data.dictionary import Dictionary
from toolkit.generation import GenerationConfig, SequenceGenerator
from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig


def make_dictionary(n_symbols: int) -> Dictionary:
    d = Dictionary()
    for i in range(n_symbols):
        d.add_symbol(f"w{i}")
    return d


def make_model(
    d: Dictionary,
    learned: bool = False,
    pre_norm: bool = True,
    seed: int = 1,
    scale: float = 1.0,
    max_positions: int = 64,
) -> TransformerLanguageModel:
    cfg = TransformerLMConfig(
        decoder_layers=2,
        decoder_embed_dim=16,
        decoder_ffn_embed_dim=32,
        decoder_attention_heads=2,
        dropout=0.0,
        max_target_positions=max_positions,
        decoder_learned_pos=learned,
        decoder_normalize_before=pre_norm,
    )
    model = TransformerLanguageModel(cfg, len(d), d.pad(), seed=seed).eval()
    with torch.no_grad():
        model.output_projection.weight.mul_(scale)  # scale > 1: a peaked next-token distribution
    return model


def adjusted_log_probs(model, d, tokens, temperature=1.0, unkpen=0.0):
    """Direct computation: the whole prefix through the model, no cache; [V] for the next token."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([tokens]))[0, -1].float() / temperature, dim=-1)
    lp[d.pad()] = -math.inf
    lp[d.unk()] -= unkpen
    return lp


MODEL_KINDS = [(False, True), (True, True), (False, False), (True, False)]  # (learned positions, pre-norm)
PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 5]]


@pytest.mark.parametrize("learned,pre_norm", MODEL_KINDS)
def test_cache_equals_full_forward(learned, pre_norm):
    d = make_dictionary(20)
    model = make_model(d, learned, pre_norm)
    x = torch.randint(4, len(d), (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)
        state = {}
        chunks = [model(x[:, a:b], incremental_state=state) for a, b in [(0, 7), (7, 8), (8, 9), (9, 20)]]
        assert torch.allclose(torch.cat(chunks, 1), full, atol=1e-5)
        assert state["positions"] == 20

        # beam search reorders (and repeats) rows; continuing must equal the reordered full forward
        order = torch.tensor([2, 2, 0])
        state = {}
        model(x[:, :10], incremental_state=state)
        model.reorder_incremental_state(state, order)
        tail = model(x[order, 10:], incremental_state=state)
        assert torch.allclose(tail, model(x[order])[:, 10:], atol=1e-5)


def greedy_reference(model, d, prompt, max_len, min_len=1):
    """Step by step, argmax of the full recomputation (fairseq's beam 1)."""
    tokens, scores = [d.eos()], []
    for step in range(max_len + 1):
        lp = adjusted_log_probs(model, d, tokens)
        if step < len(prompt):
            tok = prompt[step]
        else:
            if step < min_len:
                lp[d.eos()] = -math.inf
            if step >= max_len:
                lp[torch.arange(len(lp)) != d.eos()] = -math.inf
            tok = int(lp.argmax())
        tokens.append(tok)
        scores.append(float(lp[tok]))
        if tok == d.eos() and step >= len(prompt):
            break
    return tokens[1:], scores


@pytest.mark.parametrize("learned,pre_norm", MODEL_KINDS[:2])
def test_greedy_equals_stepwise_argmax(learned, pre_norm):
    d = make_dictionary(20)
    model = make_model(d, learned, pre_norm, scale=3.0)
    cfg = GenerationConfig(beam=1, max_len_b=9, min_len=4)
    hypos = SequenceGenerator([model], d, cfg).generate([torch.tensor(p) for p in PROMPTS + [[]]])
    for prompt, (best,) in zip(PROMPTS + [[]], hypos):
        tokens, scores = greedy_reference(model, d, prompt, max_len=9, min_len=4)
        assert best["tokens"].tolist() == tokens
        assert torch.allclose(best["positional_scores"], torch.tensor(scores), atol=1e-5)
        assert best["score"] == pytest.approx(sum(scores) / len(scores), abs=1e-5)


def test_max_new_tokens_counts_past_each_prompt():
    """--max-new-tokens N: every prompt, short or long, gets at most N generated tokens (transformers' count), and it
    replaces --max-len-b (which counts the prompt, as fairseq's)."""
    d = make_dictionary(20)
    model = make_model(d, *MODEL_KINDS[0], scale=3.0)
    prompts = [torch.tensor(p) for p in PROMPTS]
    hypos = SequenceGenerator([model], d, GenerationConfig(beam=1, max_new_tokens=3, max_len_b=1, min_len=1)).generate(
        prompts
    )
    for prompt, (best,) in zip(prompts, hypos):
        generated = best["tokens"][len(prompt) :]
        assert len(generated) <= 4 and (len(generated) == 4) == (generated[-1].item() == d.eos())  # 3 + </s>
        assert best["tokens"][: len(prompt)].tolist() == prompt.tolist()
    assert any(len(best["tokens"]) > 1 + len(p) for p, (best,) in zip(prompts, hypos))


CONFIGS = [
    dict(beam=1, max_len_b=12),
    dict(beam=3, nbest=3, max_len_b=10, lenpen=0.5, unkpen=0.3, no_repeat_ngram_size=2),
    dict(beam=2, nbest=2, sampling=True, sampling_topk=4, temperature=0.8, max_len_b=10),
    dict(beam=2, nbest=2, sampling=True, sampling_topp=0.7, max_len_b=10, min_len=6),
]


@pytest.mark.parametrize("learned,pre_norm", MODEL_KINDS)
def test_cache_and_no_cache_give_the_same_hypotheses(learned, pre_norm):
    d = make_dictionary(20)
    model = make_model(d, learned, pre_norm)
    prompts = [torch.tensor(p) for p in PROMPTS]
    for values in CONFIGS:
        results = []
        for incremental in (True, False):
            gen = SequenceGenerator(
                [model],
                d,
                GenerationConfig(**values),
                incremental=incremental,
                generator=torch.Generator().manual_seed(3),
            )
            results.append(gen.generate(prompts))
        for cached, recomputed in zip(*results):
            assert len(cached) == len(recomputed) == values["beam"]
            for a, b in zip(cached, recomputed):
                assert torch.equal(a["tokens"], b["tokens"]), values
                assert a["score"] == pytest.approx(b["score"], abs=1e-5)
                assert torch.allclose(a["positional_scores"], b["positional_scores"], atol=1e-5)


def sample(model, d, cfg, prompts, seed):
    gen = SequenceGenerator([model], d, cfg, generator=torch.Generator().manual_seed(seed))
    return gen.generate([torch.tensor(p) for p in prompts])


def sampled_steps(model, d, cfg, prompts, hypos):
    """(distribution recomputed without cache, chosen token, its score) for every sampled token."""
    out = []
    for prompt, prompt_hypos in zip(prompts, hypos):
        assert len(prompt_hypos) == cfg.beam
        for h in prompt_hypos:
            tokens = h["tokens"].tolist()
            for t in range(len(prompt), len(tokens)):
                if t == cfg.max_len_b:  # the final </s> is forced, not sampled
                    continue
                lp = adjusted_log_probs(model, d, [d.eos()] + tokens[:t], cfg.temperature)
                if t < cfg.min_len:
                    lp[d.eos()] = -math.inf
                out.append((lp, tokens[t], float(h["positional_scores"][t])))
    return out


def token_lists(hypos):
    return [h["tokens"].tolist() for prompt_hypos in hypos for h in prompt_hypos]


def test_top_k_emits_only_the_top_k_and_is_reproducible():
    d = make_dictionary(40)
    model = make_model(d)
    prompts = PROMPTS[:2]
    cfg = GenerationConfig(beam=2, nbest=2, sampling=True, sampling_topk=3, temperature=0.7, max_len_b=14)
    hypos = sample(model, d, cfg, prompts, seed=5)
    steps = sampled_steps(model, d, cfg, prompts, hypos)
    assert len(steps) > 30
    for lp, token, score in steps:
        assert token in lp.topk(3).indices.tolist()
        assert score == pytest.approx(float(lp[token]), abs=1e-5)  # the untruncated log-probability
    assert token_lists(sample(model, d, cfg, prompts, seed=5)) == token_lists(hypos)
    assert token_lists(sample(model, d, cfg, prompts, seed=6)) != token_lists(hypos)


def test_top_p_emits_only_the_nucleus_and_is_reproducible():
    d = make_dictionary(40)
    model = make_model(d, scale=2.0)
    prompts = PROMPTS[:2]
    cfg = GenerationConfig(beam=2, nbest=2, sampling=True, sampling_topp=0.5, max_len_b=14)
    hypos = sample(model, d, cfg, prompts, seed=5)
    sizes = []
    for lp, token, score in sampled_steps(model, d, cfg, prompts, hypos):
        probs = lp.exp()
        mass_before = float(probs[probs > probs[token]].sum())  # tokens ranked above this one
        assert mass_before < 0.5
        sizes.append(int((probs.sort(descending=True).values.cumsum(0) < 0.5).sum()) + 1)
        assert score == pytest.approx(float(lp[token]), abs=1e-5)
    assert max(sizes) > 1  # the test would be vacuous with one-token nuclei
    assert token_lists(sample(model, d, cfg, prompts, seed=5)) == token_lists(hypos)


def reference_beam_search(model, d, prompt, K, max_len, min_len=1, lenpen=1.0, unkpen=0.0, ngram=0):
    """fairseq's beam search written plainly: lists of hypotheses, the whole prefix recomputed each step."""
    live = [([d.eos()], 0.0, [])]  # (tokens, summed score, per-token scores)
    finalized = []
    for step in range(max_len + 1):
        cands = []
        forced = step < min(len(prompt), max_len)
        for tokens, total, per_token in live:
            lp = adjusted_log_probs(model, d, tokens, unkpen=unkpen)
            if step >= max_len:
                lp[torch.arange(len(lp)) != d.eos()] = -math.inf
            if forced:
                lp[torch.arange(len(lp)) != prompt[step]] = -math.inf
            else:
                if step < min_len:
                    lp[d.eos()] = -math.inf
                for i in range(len(tokens) - ngram + 1) if ngram else []:
                    if tokens[i : i + ngram - 1] == tokens[len(tokens) - ngram + 1 :]:
                        lp[tokens[i + ngram - 1]] = -math.inf
            cands += [
                (total + float(lp[w]), tokens + [w], per_token + [float(lp[w])])
                for w in range(len(lp))
                if lp[w] > -math.inf
            ]
        cands.sort(key=lambda c: -c[0])
        cands = cands[: 2 * K]
        for total, tokens, per_token in cands[:K]:
            if tokens[-1] == d.eos() and not forced and len(finalized) < K:
                finalized.append((tokens[1:], total / (step + 1) ** lenpen, per_token))
        if len(finalized) >= K or step >= max_len:
            break
        live = [(tokens, total, per_token) for total, tokens, per_token in cands if tokens[-1] != d.eos() or forced][:K]
    return sorted(finalized, key=lambda f: -f[1])


@pytest.mark.parametrize(
    "values",
    [
        dict(beam=3, lenpen=0.6, max_len_b=8),
        dict(beam=4, lenpen=1.5, unkpen=0.5, min_len=5, max_len_b=9, no_repeat_ngram_size=2),
    ],
)
def test_beam_search_matches_a_plain_reference(values):
    d = make_dictionary(8)
    model = make_model(d, learned=True, scale=2.0)
    cfg = GenerationConfig(nbest=values["beam"], **values)
    prompts = [[5, 6, 7], [8], [9, 10, 11, 5]]
    hypos = SequenceGenerator([model], d, cfg).generate([torch.tensor(p) for p in prompts])
    for prompt, got in zip(prompts, hypos):
        want = reference_beam_search(
            model, d, prompt, cfg.beam, cfg.max_len_b, cfg.min_len, cfg.lenpen, cfg.unkpen, cfg.no_repeat_ngram_size
        )
        assert [h["tokens"].tolist() for h in got] == [w[0] for w in want]
        for h, (_, score, per_token) in zip(got, want):
            assert h["score"] == pytest.approx(score, abs=1e-5)
            assert torch.allclose(h["positional_scores"], torch.tensor(per_token), atol=1e-5)


def test_a_beam_wider_than_every_sequence_is_exhaustive():
    """All 84 sequences of up to 3 tokens (+ </s>) over a 6-symbol vocabulary, scored directly.

    fairseq caps the beam at V - 1; lifted here to 100 (more than every hypothesis alive at
    any step), beam search prunes nothing, so its ranking must be the brute force's.
    """
    d = Dictionary()
    d.add_symbol("a"), d.add_symbol("b")
    model = make_model(d, scale=2.0, seed=2)
    max_len, lenpen = 3, 1.3
    choices = [i for i in range(len(d)) if i not in (d.pad(), d.eos())]
    scored = []
    for n in range(1, max_len + 1):  # min_len 1: at least one token before </s>
        for seq in itertools.product(choices, repeat=n):
            tokens = list(seq) + [d.eos()]
            per_token = [
                float(adjusted_log_probs(model, d, [d.eos()] + tokens[:t])[tokens[t]]) for t in range(len(tokens))
            ]
            scored.append((sum(per_token) / len(tokens) ** lenpen, tokens, per_token))
    scored.sort(key=lambda s: -s[0])
    assert len(scored) == 84
    gen = SequenceGenerator([model], d, GenerationConfig(beam=5, max_len_b=max_len, lenpen=lenpen))
    assert gen.beam == len(d) - 1
    gen.beam = 100
    (got,) = gen.generate([torch.tensor([], dtype=torch.long)])
    assert [h["tokens"].tolist() for h in got] == [s[1] for s in scored]
    for h, (score, _, per_token) in zip(got, scored):
        assert h["score"] == pytest.approx(score, abs=1e-5)
        assert torch.allclose(h["positional_scores"], torch.tensor(per_token), atol=1e-5)


def test_batched_prompts_equal_one_at_a_time():
    d = make_dictionary(20)
    model = make_model(d, learned=True)
    cfg = GenerationConfig(beam=3, nbest=3, max_len_b=10, lenpen=0.8)
    gen = SequenceGenerator([model], d, cfg)
    batched = gen.generate([torch.tensor(p) for p in PROMPTS])
    for prompt, hypos in zip(PROMPTS, batched):
        (alone,) = gen.generate([torch.tensor(prompt)])
        assert [h["tokens"].tolist() for h in hypos] == [h["tokens"].tolist() for h in alone]
        assert [h["score"] for h in hypos] == pytest.approx([h["score"] for h in alone], abs=1e-5)


def test_ensemble_greedy_follows_the_averaged_probabilities():
    d = make_dictionary(20)
    models = [make_model(d, seed=1, scale=2.0), make_model(d, learned=True, seed=2, scale=2.0)]
    prompt, max_len = [5, 6], 8
    ((best,),) = SequenceGenerator(models, d, GenerationConfig(beam=1, max_len_b=max_len)).generate(
        [torch.tensor(prompt)]
    )
    tokens, scores = [d.eos()], []
    for step in range(max_len + 1):
        lps = torch.stack([adjusted_log_probs(m, d, tokens) for m in models])
        lp = torch.logsumexp(lps, dim=0) - math.log(2)  # the mean of the two models' probabilities
        if step >= max_len:
            lp[torch.arange(len(lp)) != d.eos()] = -math.inf
        tok = prompt[step] if step < len(prompt) else int(lp.argmax())
        tokens.append(tok)
        scores.append(float(lp[tok]))
        if tok == d.eos():
            break
    assert best["tokens"].tolist() == tokens[1:]
    assert torch.allclose(best["positional_scores"], torch.tensor(scores), atol=1e-5)


def test_a_prompt_as_long_as_the_model_is_forced_to_max_len_then_ends_as_in_fairseq():
    """toolkit-generate without --prefix-size makes each whole sample (up to the model's positions) a prompt;
    fairseq's LM task passes it as prefix_tokens, forces it up to max_len = min(max_len_b, positions - 1) and
    then forces </s>. A prompt longer than the model's positions is refused (fairseq: an invalid sample size)."""
    from toolkit.core.errors import UserError

    d = make_dictionary(20)
    model = make_model(d, max_positions=16)
    prompt = torch.randint(4, len(d), (16,), generator=torch.Generator().manual_seed(0))
    for max_len_b, kept in [(200, 15), (5, 5)]:
        gen = SequenceGenerator([model], d, GenerationConfig(beam=3, max_len_b=max_len_b))
        [hypos] = gen.generate([prompt])
        assert hypos  # one: the forced prefix leaves the other beams at -inf, never finalized (as fairseq's)
        for h in hypos:
            assert h["tokens"].tolist() == prompt[:kept].tolist() + [d.eos()]
    with pytest.raises(UserError, match="prompt of 17 tokens is longer than the model's 16 positions"):
        SequenceGenerator([model], d, GenerationConfig(beam=3)).generate([torch.cat([prompt, prompt[:1]])])
