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
@pytest.mark.parametrize("values", [dict(beam=1, max_len_b=20, min_len=20), dict(beam=1, max_len_b=20),
                                    dict(beam=3, max_len_b=20, min_len=10),
                                    dict(beam=2, sampling=True, max_len_b=20, min_len=10)])
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
    for values in (dict(beam=1, max_len_b=16, min_len=4), dict(beam=1, max_len_b=24),
                   dict(beam=3, nbest=3, max_len_b=12, min_len=5), dict(beam=2, nbest=2, max_len_b=12)):
        cached, recomputed = (SequenceGenerator([model], d, GenerationConfig(**values), incremental=inc)
                              .generate(prompts) for inc in (True, False))
        for a_hypos, b_hypos in zip(cached, recomputed):
            assert [h["tokens"].tolist() for h in a_hypos] == [h["tokens"].tolist() for h in b_hypos], values
