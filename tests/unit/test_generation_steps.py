"""A decoding step's host work: no device reads where the search does not need one, and the
NaN check that rides on the step's one read still stops a broken model (both families)."""

import pytest
import torch

from toolkit.config import options
from toolkit.core import registry
from toolkit.data.dictionary import Dictionary
from toolkit.generation import GenerationConfig, SequenceGenerator
from toolkit.generation.sequence_generator import BrokenModelOutput
from toolkit.generation.step_counter import StepCounter

ARCHS = ["transformer_lm_gpt2_tiny", "llama_tiny"]
PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 5]]


def build(arch: str, n_symbols: int = 30):
    registry.import_all_components()
    entry = registry.resolve_arch(arch)
    cfg = options.config_from_args(entry.config, options.architecture_defaults(arch, {"max_target_positions": 64}))
    d = Dictionary()
    for i in range(n_symbols):
        d.add_symbol(f"w{i}")
    return entry.cls(cfg, len(d), d.pad(), seed=0).eval(), d


def syncs(model, d, prompts, **values) -> int:
    gen = SequenceGenerator([model], d, GenerationConfig(**values))
    with StepCounter() as counter:
        gen.generate([torch.tensor(p) for p in prompts])
    return counter.syncs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_steps_before_min_len_read_nothing_from_the_device(arch):
    model, d = build(arch)
    prompt = [[5, 6, 7, 8]]
    short, long = (syncs(model, d, prompt, beam=1, max_len_b=n, min_len=n) for n in (8, 20))
    assert long == short  # 12 more steps, not one more read: </s> cannot be chosen before min_len


@pytest.mark.parametrize("arch", ARCHS)
def test_a_searching_step_reads_the_device_once(arch):
    model, d = build(arch)
    short, long = (syncs(model, d, PROMPTS, beam=1, max_len_b=n, min_len=6) for n in (8, 20))
    assert long - short <= 12  # the </s> candidates (a step where a row may end)
    short, long = (syncs(model, d, PROMPTS, beam=3, max_len_b=n) for n in (8, 20))
    assert long - short <= 12


class NaNAfter(torch.nn.Module):
    """A model whose outputs turn NaN from its ``n``-th call on (a checkpoint that breaks mid-sequence)."""

    def __init__(self, model, n: int):
        super().__init__()
        self.model, self.n, self.calls = model, n, 0

    def forward(self, tokens, incremental_state=None):
        out = self.model(tokens, incremental_state=incremental_state)
        self.calls += 1
        return out * float("nan") if self.calls > self.n else out

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "values",
    [
        dict(beam=1, max_len_b=20, min_len=20),
        dict(beam=1, max_len_b=20),
        dict(beam=3, max_len_b=20, min_len=10),
        dict(beam=2, sampling=True, max_len_b=20, min_len=10),
    ],
)
def test_probabilities_turning_nan_mid_sequence_still_stop_generation(arch, values):
    model, d = build(arch)
    for incremental in (True, False):
        gen = SequenceGenerator([NaNAfter(model, 3)], d, GenerationConfig(**values), incremental=incremental)
        with pytest.raises(BrokenModelOutput, match="all NaN"):
            gen.generate([torch.tensor(p) for p in PROMPTS])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_beam_with_the_cache_equal_recomputing_the_prefix(arch):
    """Rows of different prompt lengths, min_len, rows finishing at different steps: same tokens."""
    model, d = build(arch)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(8.0)  # a peaked distribution: float noise cannot flip an argmax
    prompts = [torch.tensor(p) for p in PROMPTS]
    for values in (
        dict(beam=1, max_len_b=16, min_len=4),
        dict(beam=1, max_len_b=24),
        dict(beam=3, nbest=3, max_len_b=12, min_len=5),
        dict(beam=2, nbest=2, max_len_b=12),
    ):
        cached, recomputed = (
            SequenceGenerator([model], d, GenerationConfig(**values), incremental=inc).generate(prompts)
            for inc in (True, False)
        )
        for a_hypos, b_hypos in zip(cached, recomputed):
            assert [h["tokens"].tolist() for h in a_hypos] == [h["tokens"].tolist() for h in b_hypos], values


class EosBoost(NaNAfter):
    """A model that ends sequences early: ``boost`` added to </s>'s logit (rows end at different steps)."""

    def __init__(self, model, eos: int, boost: float):
        super().__init__(model, n=1 << 30)
        self.eos, self.boost = eos, boost

    def forward(self, tokens, incremental_state=None):
        out = super().forward(tokens, incremental_state)
        out[..., self.eos] += self.boost
        return out


@pytest.mark.parametrize("arch", ARCHS)
def test_reading_ended_rows_every_n_steps_changes_no_result(arch):
    model, d = build(arch)
    model = EosBoost(model, d.eos(), 2.5)
    prompts = [torch.tensor(p) for p in PROMPTS + [[7, 7], [13, 4, 20, 21], [6]]]
    ended = set()  # tokens generated: rows end at different steps, before and between reads
    for values in (
        dict(beam=1, max_len_b=30),
        dict(beam=1, max_len_b=30, min_len=5, lenpen=0.5),
        dict(beam=1, max_len_b=9, unnormalized=True),
    ):
        results = []
        for interval in (1, 3, 8):
            gen = SequenceGenerator([model], d, GenerationConfig(**values), eos_check_interval=interval)
            results.append(
                [
                    [(h["tokens"].tolist(), h["score"], h["positional_scores"].tolist()) for h in hypos]
                    for hypos in gen.generate(prompts)
                ]
            )
        ended.update(len(hypos[0][0]) - len(p) for hypos, p in zip(results[0], prompts))
        for other in results[1:]:  # ended rows stay in the batch longer: a matmul may round differently
            for a, b in zip(results[0], other):
                assert [h[0] for h in a] == [h[0] for h in b], values
                assert [h[1] for h in a] == pytest.approx([h[1] for h in b], abs=1e-5)
                for ha, hb in zip(a, b):
                    assert ha[2] == pytest.approx(hb[2], abs=1e-5)
    assert len(ended) > 3, ended
    with pytest.raises(ValueError, match="eos_check_interval 0"):
        SequenceGenerator([model], d, GenerationConfig(), eos_check_interval=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_reading_every_n_steps_reads_the_device_n_times_less(arch):
    model, d = build(arch)
    model = EosBoost(model, d.eos(), -1e4)  # </s> never wins: every row runs to max_len

    def reads(max_len: int) -> int:
        gen = SequenceGenerator([model], d, GenerationConfig(beam=1, max_len_b=max_len), eos_check_interval=8)
        with StepCounter() as counter:
            gen.generate([torch.tensor(p) for p in PROMPTS])
        return counter.syncs

    assert reads(50) - reads(10) <= 40 // 8 + 1  # 40 more steps
