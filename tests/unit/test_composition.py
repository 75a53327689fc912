"""The composition table (toolkit/config/composition.py): the resolver refuses exactly its refused pairs, with its
messages; every refusal names a reason; every tested pair names a test that exists; docs/composition.md is current."""

from __future__ import annotations

import ast
import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import REPO_ROOT
from toolkit.config import composition as C
from toolkit.core.errors import UserError

SWITCHABLE = [f for f in C.FEATURES if f.argv]
PAIRS = [(a, b, entry) for a, b, entry in C.pairs() if a.argv and b.argv]


def resolve(*argv: str):
    from toolkit.train.resolve import parse_train_config

    # 4 ranks: every layout in the table fits them (the resolver checks the layout against the world size)
    return parse_train_config(
        [
            "data",
            "--arch",
            "transformer_lm",
            "--batch-size",
            "2",
            "--max-update",
            "1",
            "--distributed-world-size",
            "4",
            *argv,
        ]
    )


def both(a: C.Feature, b: C.Feature) -> list:
    """The flags of both features; a flag pair both need (--ddp-backend X) is given once."""
    argv = list(a.argv)
    rest = list(b.argv)
    while rest:
        flag, value = (rest[0], rest[1]) if len(rest) > 1 and not rest[1].startswith("--") else (rest[0], None)
        rest = rest[2:] if value is not None else rest[1:]
        if flag in argv and flag != "--data-mixture":
            continue
        argv += [flag] + ([value] if value is not None else [])
    return argv


def test_the_docs_table_is_current():
    with open(os.path.join(REPO_ROOT, "docs", "composition.md")) as f:
        assert f.read() == C.markdown(), "run: python -m toolkit.config.composition --markdown > docs/composition.md"


def test_every_pair_has_one_entry_and_every_refusal_a_reason():
    entries = C.pairs()
    assert len(entries) == len(C.FEATURES) * (len(C.FEATURES) - 1) // 2
    messages = [e.message for _, _, e in entries if isinstance(e, C.Refused)] + [C.COMPILE_TP_SHARDED_DROPOUT]
    assert messages
    for message in messages:
        assert "yet" not in message.split() and "not supported" not in message, message
        assert ":" in message and ";" in message, f"no reason or no remedy: {message}"


def _defined_tests(path: str) -> set:
    with open(os.path.join(REPO_ROOT, path)) as f:
        tree = ast.parse(f.read())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def test_every_tested_pair_names_a_test_that_exists():
    tested = {e.test for _, _, e in C.pairs() if isinstance(e, C.Tested)}
    tested |= {e.test for e in C.TP_BACKENDS.values()}
    tested.add(C.CAPABILITIES.test)
    assert tested
    for test in tested:
        path, name = test.split("::")
        assert name in _defined_tests(path), test


@pytest.mark.parametrize("feature", SWITCHABLE, ids=lambda f: f.name)
def test_each_features_flags_turn_it_on(feature):
    argv = list(feature.argv)
    if feature.name == "HSDP":
        argv += ["--shard-group-size", "1"]
    assert feature.on(resolve(*argv))


@pytest.mark.parametrize(
    "a,b,entry", [p for p in PAIRS if isinstance(p[2], C.Refused)], ids=lambda x: getattr(x, "name", "")
)
def test_the_resolver_refuses_each_refused_pair_with_its_reason(a, b, entry):
    with pytest.raises(UserError) as e:
        resolve(*both(a, b))
    assert str(e.value) == entry.message


@pytest.mark.parametrize(
    "a,b,entry", [p for p in PAIRS if isinstance(p[2], (C.Tested, C.Runs))], ids=lambda x: getattr(x, "name", "")
)
def test_the_resolver_lets_every_other_pair_through(a, b, entry):
    cfg = resolve(*both(a, b))
    assert C.refusal(cfg) is None


def _typed(argv, flag: str, default):
    """The last value given for ``flag`` in ``argv`` (what the message repeats), else ``default``."""
    values = [argv[i + 1] for i, each in enumerate(argv[:-1]) if each == flag]
    return values[-1] if values else default


@pytest.mark.parametrize("condition", C.SETTINGS + C.MODEL, ids=lambda c: f"{c.label} {c.when}")
def test_the_resolver_refuses_each_setting_and_model_condition_with_its_message(condition):
    """Every refusal that is not a pair (SETTINGS, MODEL) turned on by its flags: the resolver stops with exactly its
    one-line message, the sizes and names repeated as typed."""
    argv = list(condition.argv)
    typed = SimpleNamespace(
        distributed=SimpleNamespace(
            model_parallel_size=_typed(argv, "--model-parallel-size", "1"),
            expert_parallel_size=_typed(argv, "--expert-parallel-size", "1"),
            context_parallel_size=_typed(argv, "--context-parallel-size", "1"),
        ),
        components=SimpleNamespace(
            arch=_typed(argv, "--arch", "transformer_lm"), optimizer=_typed(argv, "--optimizer", "")
        ),
    )
    with pytest.raises(UserError) as e:
        resolve(*argv)
    assert str(e.value) == condition.text(typed) and "\n" not in str(e.value)


def test_model_conditions_let_the_families_that_can_split_through():
    """The same flags on a family that has the split: a MoE family places experts, Llama's QK-norm per head splits."""
    assert C.refusal(resolve("--arch", "moe_tiny", "--expert-parallel-size", "2")) is None
    assert resolve("--arch", "qwen3_tiny", "--model-parallel-size", "2").distributed.model_parallel_size == 2
    assert resolve("--model-parallel-size", "2", "--quant-noise-pq", "0").distributed.model_parallel_size == 2


def test_the_planner_refuses_a_split_the_model_refuses_with_the_resolvers_line():
    """toolkit-plan reads the MODEL conditions: OLMoE (QK-norm over all heads, no split) at --model-parallel-size 2
    is refused with toolkit-train's message, and the layout search's limits offer no tensor-parallel size for it."""
    from toolkit.plan import PRESETS, make_plan
    from toolkit.plan.model_stats import model_stats

    olmoe = ("--arch", "olmoe_tiny", "--tokens-per-sample", "16")
    cfg = resolve(*olmoe)
    with pytest.raises(UserError) as trained:
        resolve(*olmoe, "--model-parallel-size", "2")
    tp = dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, model_parallel_size=2))
    with pytest.raises(UserError) as planned:
        make_plan(tp, PRESETS["h100"], vocab_size=64)
    assert str(planned.value) == str(trained.value)
    splits = model_stats(cfg, torch.float32, 64).splits
    assert splits.tp_refused == str(trained.value) and splits.context_parallel and splits.expert_parallel


def test_compile_under_tensor_parallelism_without_sequence_parallelism_depends_on_the_dropouts():
    flags = ["--model-parallel-size", "2", "--compile", "--no-sequence-parallel"]
    resolve(*flags, "--dropout", "0.1")  # replicated regions: the default generator, inside the compiled block
    with pytest.raises(UserError) as e:
        resolve(*flags, "--attention-dropout", "0.1")
    assert str(e.value) == C.COMPILE_TP_SHARDED_DROPOUT
    resolve("--model-parallel-size", "2", "--compile", "--attention-dropout", "0.1")  # sequence parallel


def test_settings_that_are_not_features_refused_with_their_reason():
    """--ddp-backend under TP and --use-sharded-state are settings, not rows of the table: their refusals
    (--store-ema with --use-sharded-state composes: each rank's shards of the average are DCP entries)."""
    tp_no_c10d = ["--model-parallel-size", "2", "--ddp-backend", "no_c10d"]
    assert resolve(*tp_no_c10d, "--fp16").distributed.ddp_backend == "no_c10d"
    with pytest.raises(UserError) as e:
        resolve(*tp_no_c10d, "--memory-efficient-fp16")
    assert str(e.value) == C.TP_NO_C10D_MEFP16
    for sharded in ([], ["--ddp-backend", "fully_sharded"], ["--model-parallel-size", "2"]):  # EMA shards in DCP
        assert resolve("--store-ema", "--use-sharded-state", *sharded).ema.store_ema


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--dropout", "0.1"],
            "--dropout: --arch llama_tiny has no such option (the Llama family has no dropout); drop the flag",
        ),
        (
            ["--adaptive-input"],
            "--adaptive-input: --arch llama_tiny has no such option (it is an option of transformer_lm); drop the flag",
        ),
        (
            ["--gemma-norms"],
            "--gemma-norms: --arch llama_tiny has no such option (Gemma's norms, score scale, soft-caps and local "
            "rotary base are the gemma3 family's (--arch gemma3)); drop the flag",
        ),
        (
            ["--qk-norm-over", "projection"],
            "--qk-norm-over: --arch llama_tiny has no such option (norms after the sublayers and QK-norm over the "
            "projections are the olmo2 family's (--arch olmo2)); drop the flag",
        ),
    ],
)
def test_an_option_of_another_family_is_one_line_naming_it(flags, message):
    from toolkit.train.resolve import parse_train_config

    with pytest.raises(UserError) as e:
        parse_train_config(["data", "--arch", "llama_tiny", "--max-update", "1", *flags])
    assert str(e.value) == message
    with pytest.raises(SystemExit):  # a flag no family has: argparse's own error, as before
        parse_train_config(["data", "--arch", "llama_tiny", "--max-update", "1", "--no-such-option"])


def test_expert_parallelism_composes_with_every_sharding_strategy_and_compile():
    """FSDP x EP, HSDP x EP (the experts on a (replicate, shard) mesh of their own; no_shard is not a feature of the
    table, a replicate mesh as hybrid sharding's groups), EP x compile and EP with --use-sharded-state pass the
    resolver."""
    ep = ["--arch", "moe_tiny", "--expert-parallel-size", "2", "--ddp-backend", "fully_sharded"]
    assert C.refusal(resolve(*ep, "--compile")) is None
    for strategy in ("shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"):
        assert C.refusal(resolve(*ep, "--sharding-strategy", strategy)) is None, strategy
    # sharded checkpoints name the whole expert stacks (tests/integration/test_expert_parallel_sharded_resume.py)
    assert C.refusal(resolve(*ep, "--use-sharded-state")) is None


def test_expert_parallelism_composes_with_tensor_parallelism_through_fsdp2_only():
    """TP x EP (and SP x EP) pass the resolver under c10d (FSDP2 replicate) and fully_sharded; no_c10d has no FSDP2
    to reduce the experts, whole on every tp rank, and is refused with that reason."""
    tp_ep = ["--arch", "moe_tiny", "--expert-parallel-size", "2", "--model-parallel-size", "2"]
    assert C.refusal(resolve(*tp_ep)) is None
    assert C.refusal(resolve(*tp_ep, "--no-sequence-parallel", "--ddp-backend", "fully_sharded")) is None
    with pytest.raises(UserError) as e:
        resolve(*tp_ep, "--ddp-backend", "no_c10d")
    assert str(e.value) == C.EP_TP_NO_C10D
