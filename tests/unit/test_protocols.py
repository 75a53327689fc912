"""The Protocols of toolkit.core.protocols: both families, the task and the criterions satisfy them, and code
that used to probe with hasattr now tells a conforming object from one that is not."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from toolkit.core import protocols as P
from toolkit.criterions.adaptive_loss import AdaptiveLoss
from toolkit.criterions.cross_entropy import CrossEntropyCriterion
from toolkit.data.dictionary import Dictionary
from toolkit.models import build_on_meta
from toolkit.models.init import init_weights
from toolkit.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

FAMILY_ARCHS = ["transformer_lm_gpt2_tiny", "transformer_lm", "llama_tiny", "llama_tiny_gqa", "gemma3_tiny"]


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_every_family_is_a_language_model_initializable_flops_counted_and_splittable(arch):
    model = build_on_meta(arch, vocab_size=40, tokens_per_sample=16)
    for protocol in (P.LanguageModel, P.Initializable, P.FlopsCounted, P.Bounded, P.TensorParallelizable):
        assert isinstance(model, protocol), protocol.__name__
    plan = model.tensor_parallel_plan()
    from toolkit.distributed.tensor_parallel import TP_STYLES

    assert set(plan.kinds()) <= set(TP_STYLES)
    names = {name for name, _ in model.named_modules()}
    assert all(path in names for path in plan.top if path != "layers.0") and plan.hidden in names
    block = {name for name, _ in model.layers[0].named_modules()}
    assert set(plan.block) <= block, set(plan.block) - block
    assert plan.positions == 16


def test_olmo2s_plan_gives_fsdp2_its_units():
    """OLMo 2's plan (its whole-projection QK-norm split as ``projection_norm``) gives FSDP2 its units."""
    from toolkit.distributed.tensor_parallel import fsdp_units

    model = build_on_meta("olmo2_tiny", vocab_size=40, tokens_per_sample=16)
    assert len(fsdp_units(model)) == 2


def test_a_module_without_the_protocol_is_refused_by_name():
    assert not isinstance(torch.nn.Linear(2, 2), P.LanguageModel)
    assert not isinstance(torch.nn.Linear(2, 2), P.TensorParallelizable)
    with pytest.raises(TypeError, match="Linear has no initial_value"):
        init_weights(torch.nn.Linear(2, 2), 0)


def test_task_criterions_and_config_sections():
    d = Dictionary()
    for sym in "abc":
        d.add_symbol(sym)
    task = LanguageModelingTask(LanguageModelingConfig(tokens_per_sample=8), d)
    assert isinstance(task, P.Task) and isinstance(task, P.Bounded)
    assert isinstance(task.target_dictionary, P.Dictionary)
    assert isinstance(CrossEntropyCriterion(task), P.Criterion) and isinstance(AdaptiveLoss(task), P.Criterion)
    assert isinstance(LanguageModelingConfig(), P.ConfigSection)
    assert not isinstance({"tokens_per_sample": 8}, P.ConfigSection)
    assert dataclasses.is_dataclass(P.TensorParallelPlan)


def test_tensor_parallelism_refuses_a_model_without_a_plan_in_one_line():
    from toolkit.distributed.tensor_parallel import _check_divisible, model_plan
    from toolkit.core.errors import UserError

    with pytest.raises(UserError, match=r"^--model-parallel-size 2: Linear gives no tensor_parallel_plan\(\)"):
        model_plan(torch.nn.Linear(2, 2), 2)
    llama = build_on_meta("llama_tiny_gqa", vocab_size=40, tokens_per_sample=16)
    with pytest.raises(UserError, match="^--decoder-kv-heads"):
        _check_divisible(llama, 3)
    _check_divisible(llama, 2)
