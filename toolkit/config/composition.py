"""Which training features combine: one table, read by the resolver, the docs and the tests.

Every pair of the features below has one entry:

* ``Tested``: the pair trains and a named test compares it, loss for loss to a stated tolerance, with
  one process (or with the same run without one of the two: eager for ``--compile``, the serial
  update for ``--overlap-offload-step``);
* ``Runs``: the two act on separate things (the data side and the model side, a precision and a
  wrapper) and nothing refuses the pair, but no test compares this exact pair with one process;
* ``Refused``: ``toolkit.train.resolve`` stops the run before any worker starts, with the message
  here, which names the physical reason (what the two would have to do at once and cannot);
* ``OneSetting``: not a combination: one feature is a value or a mode of the other.

Context and expert parallelism act inside attention and the expert layers, so whether a family can take them is
its class's declaration (``MODEL`` refuses a family without it); ``CAPABILITIES`` names the test that trains every
family that declares a split through it, against one process.

Every refusal of the toolkit's features lives here: the refused pairs; ``SETTINGS``, the refusals of a
setting under a feature that are not a pair (a backend under TP, an option another option needs); and ``MODEL``,
what the model refuses (an axis its family's class cannot fill, an option its split cannot take).
``refusal(cfg)`` is the resolver's first check (the first refused pair that is on, then the first refused
setting) and ``model_refusal(cfg, model_cls)`` its check once the layout fits the world; ``toolkit-plan``
resolves through the same resolver. ``markdown()`` writes the table of ``docs/composition.md``
(``python -m toolkit.config.composition --markdown > docs/composition.md``), which
``tests/unit/test_composition.py`` keeps current; the same test asks the resolver for every
refused pair and checks that each named test exists.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from toolkit.config import OFFLOAD_OPTIMIZER
from toolkit.core.protocols import supports


@dataclass(frozen=True)
class Feature:
    name: str
    flags: str  # how a user turns it on (the docs' column)
    on: Callable[[Any], bool]  # over a TrainConfig, before implied values are filled in
    argv: Tuple[str, ...] = ()  # turns it on in a test (with what it needs); empty: no flag in this version


@dataclass(frozen=True)
class Tested:
    test: str  # tests/...py::test_name
    note: str = ""


@dataclass(frozen=True)
class Runs:
    why: str


@dataclass(frozen=True)
class Refused:
    message: str  # the UserError the resolver raises: the physical reason and what to do


@dataclass(frozen=True)
class OneSetting:
    why: str


Status = Union[Tested, Runs, Refused, OneSetting]

FSDP = ("--ddp-backend", "fully_sharded")
TP2 = ("--model-parallel-size", "2")
PP2 = ("--pipeline-parallel-size", "2")


def _fsdp(cfg: Any) -> bool:
    dist = cfg.distributed
    return dist.ddp_backend == "fully_sharded" and not dist.sharding_strategy.startswith("hybrid")


def _hsdp(cfg: Any) -> bool:
    return cfg.distributed.ddp_backend == "fully_sharded" and cfg.distributed.sharding_strategy.startswith("hybrid")


def _size(cfg: Any, name: str) -> int:
    """A parallel size the distributed section may not have in this version (context / expert parallelism)."""
    return int(vars(cfg.distributed).get(name, 1) or 1)


def _task(cfg: Any, name: str) -> Any:
    return vars(cfg.task).get(name) if cfg.task is not None else None


FEATURES: Tuple[Feature, ...] = (
    Feature("FSDP", "--ddp-backend fully_sharded (full_shard, shard_grad_op, no_shard)", _fsdp, FSDP),
    Feature(
        "HSDP",
        "--sharding-strategy hybrid_shard / hybrid_shard_zero2",
        _hsdp,
        FSDP + ("--sharding-strategy", "hybrid_shard"),
    ),
    Feature("TP", "--model-parallel-size M > 1", lambda c: c.distributed.model_parallel_size > 1, TP2),
    Feature(
        "SP",
        "sequence parallelism (on under TP unless --no-sequence-parallel)",
        lambda c: c.distributed.model_parallel_size > 1 and not c.distributed.no_sequence_parallel,
        TP2,
    ),
    Feature("CP", "--context-parallel-size > 1", lambda c: _size(c, "context_parallel_size") > 1),
    Feature("EP", "--expert-parallel-size > 1", lambda c: _size(c, "expert_parallel_size") > 1),
    Feature(
        "PP",
        "--pipeline-parallel-size > 1",
        lambda c: _size(c, "pipeline_parallel_size") > 1,
        PP2 + FSDP + ("--arch", "llama_tiny"),
    ),
    Feature("compile", "--compile", lambda c: c.distributed.compile, ("--compile",)),
    Feature("fp8", "--fp8", lambda c: c.distributed.fp8, ("--fp8",)),
    Feature(
        "AC", "--checkpoint-activations", lambda c: c.distributed.checkpoint_activations, ("--checkpoint-activations",)
    ),
    Feature("muon", "--optimizer muon", lambda c: c.components.optimizer == "muon", ("--optimizer", "muon")),
    Feature(
        "cpu-offload",
        "--cpu-offload",
        lambda c: c.distributed.cpu_offload,
        FSDP + ("--cpu-offload", "--optimizer", "cpu_adam"),
    ),
    Feature(
        "overlap-offload",
        "--overlap-offload-step",
        lambda c: c.distributed.overlap_offload_step,
        FSDP + ("--cpu-offload", "--optimizer", "cpu_adam", "--overlap-offload-step"),
    ),
    Feature("fp16", "--fp16", lambda c: c.common.fp16 and not c.common.memory_efficient_fp16, ("--fp16",)),
    Feature("bf16", "--bf16", lambda c: c.common.bf16, ("--bf16",)),
    Feature(
        "memory-efficient fp16",
        "--memory-efficient-fp16",
        lambda c: c.common.memory_efficient_fp16,
        ("--memory-efficient-fp16",),
    ),
    Feature(
        "document mask",
        "--document-attention-mask",
        lambda c: bool(_task(c, "document_attention_mask")),
        ("--document-attention-mask",),
    ),
    Feature("data mixture", "--data-mixture", lambda c: bool(_task(c, "data_mixture")), ("--data-mixture", "a=.:1")),
    Feature("EMA", "--store-ema", lambda c: c.ema.store_ema, ("--store-ema",)),
    Feature("LoRA", "--lora-rank R > 0", lambda c: c.lora.lora_rank > 0, ("--lora-rank", "4")),
)
NAMES = tuple(f.name for f in FEATURES)

# --- the tests that compare a pair with one process -------------------------------------------------------
COMPOSITION = "tests/integration/test_composition.py::"
COMPILE_1 = "tests/integration/test_compile.py::test_one_process_compiled_matches_eager"
COMPILE_2 = "tests/integration/test_compile.py::test_two_ranks_compiled_matches_eager"
STRATEGIES = "tests/integration/test_distributed.py::test_every_sharding_strategy_trains_the_same"
TP_FP16_AC = "tests/integration/test_tensor_parallel.py::test_fsdp2_with_checkpointing_and_fp16_compute"
TP_DP = "tests/integration/test_tp_cli.py::test_two_replicas_of_two_ranks_match_one_process_with_update_freq_2"
OVERLAP_2 = "tests/integration/test_overlap.py::test_two_ranks_bit_identical_with_clipping_and_update_freq_2"
MASK = "tests/integration/test_document_mask.py::"
FP8 = "tests/integration/test_fp8.py::"
OVERLAP = "tests/integration/test_overlap.py::"
MUON = "tests/integration/test_muon.py::"
MUON_HSDP_OFFLOAD = MUON + "test_hybrid_shard_and_cpu_offload_equal_one_process"

# --- the refusals: each names what the two would have to do at once ----------------------------------------
HALF_FORMATS = (
    "--fp16 and --bf16 conflict: a run computes in one 16-bit format, fp16 (with loss scaling) or "
    "bf16 (without); choose one"
)
MEFP16_BF16 = (
    "--memory-efficient-fp16 and --bf16 conflict: it keeps the weights themselves in fp16 (with fp16's "
    "loss scaling), which bf16 training does not; use --bf16 alone, or --memory-efficient-fp16 alone"
)
FP8_FP16 = (
    "--fp8 with --fp16: float8 training keeps its high-precision side in bf16 (or fp32), without loss "
    "scaling; use --bf16"
)
FP8_MEFP16 = (
    "--fp8 with --memory-efficient-fp16: float8 training keeps its high-precision side in bf16 (or fp32), "
    "without fp16 weights or loss scaling; use --bf16"
)
TP_NO_C10D_MEFP16 = (
    "--memory-efficient-fp16 with --model-parallel-size > 1 and --ddp-backend no_c10d: it turns the "
    "weights themselves into fp16 and keeps their fp32 copies beside them, one plain tensor per "
    "weight, while without FSDP2 each weight here is a tensor-parallel shard (a DTensor) that only "
    "FSDP2's mixed-precision policy casts shard by shard; use --ddp-backend fully_sharded or c10d "
    "(FSDP2 under TP), or --fp16"
)
EP_TP_NO_C10D = (
    "--expert-parallel-size with --model-parallel-size > 1 and --ddp-backend no_c10d: the experts stay "
    "whole on every tp rank (plain tensors beside the tp shards) and only FSDP2 reduces their gradients, "
    "over the ranks holding the same experts; use --ddp-backend c10d or fully_sharded"
)
MUON_OVERLAP = (
    "--overlap-offload-step with --optimizer muon: the overlapped step updates each block on a background "
    "thread while the next forward gathers the following blocks, and Muon's update of a sharded matrix "
    "is itself a collective (the whole matrix gathered to its owner and scattered back) that would "
    "interleave with those all-gathers in a different order on each rank; drop --overlap-offload-step "
    "(the offloaded Muon step overlaps its own GPU transfers) or use --optimizer cpu_adam"
)
LORA_FP8 = (
    "--lora-rank with --fp8: float8 training replaces the blocks' Linear layers by its own class, whose forward "
    "has no adapters, and casts weights that LoRA keeps frozen in their dtype; drop --fp8 (--bf16 keeps the "
    "base's compute in bf16)"
)
LORA_OVERLAP = (
    "--lora-rank with --overlap-offload-step: the overlapped step hands each FSDP2 block's parameters, all of them, "
    "to CPU Adam on a background thread as the block's gradients arrive, and a LoRA run's blocks are mostly frozen "
    "parameters with no gradient and no optimizer state; drop --overlap-offload-step (--cpu-offload with "
    "--optimizer cpu_adam trains the adapters)"
)
CAPABILITIES = Tested(
    "tests/integration/test_parallel_capabilities.py::test_each_declared_capability_trains_as_one_process",
    "each registered family's class, through each split it declares (context parallelism, expert parallelism, a "
    "tensor-parallel plan), on 2 ranks with one tiny --arch (cp 2 and ep 2 in one run); every tiny --arch "
    "accepted or refused by the resolver (MODEL)",
)

INDEPENDENT = Runs(
    "separate mechanisms (one wraps or places the model, the other sets how it computes); no parity test of this pair"
)

_PAIRS: Dict[Tuple[str, str], Status] = {
    ("FSDP", "HSDP"): OneSetting("both are values of --sharding-strategy: a run has one"),
    ("FSDP", "TP"): Tested(TP_DP),
    ("FSDP", "SP"): Tested(TP_DP),
    ("FSDP", "compile"): Tested(COMPILE_2),
    ("FSDP", "fp8"): Tested(FP8 + "test_float8_all_gather_on_two_fsdp2_ranks_follows_one_process"),
    ("FSDP", "AC"): Tested(STRATEGIES),
    ("FSDP", "cpu-offload"): Tested(STRATEGIES),
    ("FSDP", "overlap-offload"): Tested(OVERLAP_2),
    ("FSDP", "bf16"): Tested(STRATEGIES),
    ("FSDP", "document mask"): Tested(MASK + "test_two_fsdp_ranks_with_the_mask_equal_one_process"),
    ("HSDP", "TP"): Tested(COMPOSITION + "test_hsdp_with_tensor_parallel_matches_one_process"),
    ("HSDP", "SP"): Tested(COMPOSITION + "test_hsdp_with_tensor_parallel_matches_one_process"),
    ("TP", "SP"): OneSetting(
        "sequence parallelism is how TP splits the norm and dropout activations (on unless --no-sequence-parallel)"
    ),
    ("TP", "compile"): Tested(
        COMPOSITION + "test_tensor_parallel_compiled_matches_one_process",
        "transformer_lm and llama; with --no-sequence-parallel only where the attention and "
        "activation dropouts are 0, refused otherwise with the reason",
    ),
    ("TP", "fp8"): Tested(COMPOSITION + "test_tensor_parallel_fp8_matches_one_process"),
    ("TP", "AC"): Tested(TP_FP16_AC),
    ("TP", "fp16"): Tested(TP_FP16_AC),
    ("TP", "cpu-offload"): Tested(COMPOSITION + "test_tensor_parallel_cpu_offload_matches_one_process"),
    ("TP", "overlap-offload"): Tested(COMPOSITION + "test_tensor_parallel_cpu_offload_matches_one_process"),
    ("TP", "bf16"): Tested(COMPOSITION + "test_tensor_parallel_fp8_matches_one_process"),
    ("TP", "memory-efficient fp16"): Tested(
        COMPOSITION + "test_tensor_parallel_memory_efficient_fp16_matches_one_process"
    ),
    ("TP", "document mask"): Tested(MASK + "test_tensor_parallel_with_the_mask_equals_one_process"),
    ("compile", "AC"): Tested(COMPILE_1),
    ("compile", "fp16"): Tested(COMPILE_1),
    ("compile", "bf16"): Tested(COMPILE_1),
    ("compile", "cpu-offload"): Tested(COMPILE_2),
    ("compile", "overlap-offload"): Tested(OVERLAP + "test_one_process_compiled_blocks_bit_identical"),
    ("compile", "document mask"): Tested(
        MASK + "test_compiled_blocks_with_the_mask_equal_eager",
        "on CPU (the dense mask); a GPU run's flex_attention block mask is not compared here",
    ),
    ("fp8", "fp16"): Refused(FP8_FP16),
    ("fp8", "memory-efficient fp16"): Refused(FP8_MEFP16),
    ("fp8", "bf16"): Tested(FP8 + "test_fp8_training_follows_fp32_and_its_checkpoint_loads_without_fp8"),
    ("AC", "cpu-offload"): Tested(COMPILE_2),
    ("AC", "document mask"): Tested(MASK + "test_compiled_blocks_with_the_mask_equal_eager"),
    ("cpu-offload", "overlap-offload"): Tested(OVERLAP_2),
    ("overlap-offload", "fp16"): Tested(OVERLAP + "test_one_process_fp16_overflow_skips_bit_identical"),
    ("fp16", "bf16"): Refused(HALF_FORMATS),
    ("fp16", "memory-efficient fp16"): OneSetting(
        "--memory-efficient-fp16 is fp16 training with fp16 weights; it turns --fp16 on"
    ),
    ("bf16", "memory-efficient fp16"): Refused(MEFP16_BF16),
    ("FSDP", "muon"): Tested(
        MUON + "test_fully_sharded_two_ranks_equal_one_process_and_resume_in_one",
        "each sharded matrix orthogonalized whole by one owner rank",
    ),
    ("HSDP", "muon"): Tested(MUON_HSDP_OFFLOAD, "the replicate axis owns the orthogonalization"),
    ("TP", "muon"): Tested(MUON + "test_four_ranks_with_model_parallel_2_equal_one_process"),
    ("muon", "cpu-offload"): Tested(
        MUON_HSDP_OFFLOAD,
        "host-memory momentum; Newton-Schulz on the CPU there, on "
        "the GPU through pinned, overlapped copies where one exists",
    ),
    ("muon", "overlap-offload"): Refused(MUON_OVERLAP),
}


def _fill(a: str, b: str, entry: Status) -> None:
    """Give the pair (either order) this entry unless the table above already has one."""
    if (a, b) not in _PAIRS and (b, a) not in _PAIRS:
        _PAIRS[(a, b)] = entry


RUN_PAIRS = COMPOSITION + "test_pairs_that_run_match_one_process"
for _case, _names in {  # the parametrized cases of RUN_PAIRS (tests/integration/test_composition.py RUNS)
    "hsdp_compile": [("HSDP", "compile")],
    "hsdp_ac": [("HSDP", "AC")],
    "hsdp_offload_overlap": [("HSDP", "cpu-offload"), ("HSDP", "overlap-offload")],
    "hsdp_bf16": [("HSDP", "bf16")],
    "hsdp_fp16": [("HSDP", "fp16")],
    "hsdp_mefp16": [("HSDP", "memory-efficient fp16")],
    "hsdp_mask": [("HSDP", "document mask")],
    "hsdp_fp8": [("HSDP", "fp8")],
    "fsdp_fp16": [("FSDP", "fp16")],
    "fsdp_mefp16": [("FSDP", "memory-efficient fp16")],
    "offload_bf16_ac": [("cpu-offload", "bf16"), ("AC", "bf16")],
    "offload_fp16": [("cpu-offload", "fp16")],
    "overlap_bf16": [("overlap-offload", "bf16")],
    "offload_mask": [("cpu-offload", "document mask")],
    "offload_fp8_ac": [("fp8", "cpu-offload"), ("fp8", "AC")],
    "compile_fp8": [("compile", "fp8")],
    "compile_mefp16": [("compile", "memory-efficient fp16")],
    "ac_fp16_mask": [("AC", "fp16"), ("fp16", "document mask")],
    "overlap_fp8_ac_mask": [
        ("fp8", "overlap-offload"),
        ("AC", "overlap-offload"),
        ("overlap-offload", "document mask"),
        ("fp8", "document mask"),
        ("bf16", "document mask"),
    ],
    "overlap_mefp16_ac_mask": [
        ("cpu-offload", "memory-efficient fp16"),
        ("overlap-offload", "memory-efficient fp16"),
        ("AC", "memory-efficient fp16"),
        ("memory-efficient fp16", "document mask"),
    ],
    "ema_compile_ac_fp16_mask": [("compile", "EMA"), ("AC", "EMA"), ("fp16", "EMA"), ("document mask", "EMA")],
    "ema_fp8": [("fp8", "EMA"), ("bf16", "EMA")],
    "ema_mefp16": [("memory-efficient fp16", "EMA")],
}.items():
    for _pair in _names:
        _fill(*_pair, Tested(RUN_PAIRS, f"case {_case}"))
MIXTURE_PAIRS = COMPOSITION + "test_data_mixture_pairs_match_one_process"
for _case, _others in {  # the cases of MIXTURE_PAIRS (tests/integration/test_composition.py MIXTURE_RUNS)
    "tp_compile_ac": ("FSDP", "TP", "SP", "compile", "AC"),
    "hsdp_offload_overlap_mask": ("HSDP", "cpu-offload", "overlap-offload", "document mask"),
    "ema_fp8": ("EMA", "fp8", "bf16"),
    "fsdp_fp16": ("fp16",),
    "fsdp_mefp16": ("memory-efficient fp16",),
}.items():
    for _other in _others:
        _PAIRS[(_other, "data mixture")] = Tested(MIXTURE_PAIRS, f"case {_case}")
for _other in (
    "compile",
    "fp8",
    "AC",
    "muon",
    "cpu-offload",
    "overlap-offload",
    "fp16",
    "bf16",
    "memory-efficient fp16",
    "document mask",
):  # sequence parallelism is TP's default mode: the TP tests run it
    _PAIRS[("SP", _other)] = _PAIRS[("TP", _other)]
EMA_SHARDED = "tests/integration/test_ema_sharded.py::test_sharded_moving_average_equals_one_process"
_PAIRS[("FSDP", "EMA")] = Tested(
    EMA_SHARDED,
    "case fsdp: each rank averages its shards; the checkpoint's whole "
    "average, resumed at 2 ranks, equals one process's",
)
_PAIRS[("HSDP", "EMA")] = Tested(EMA_SHARDED, "case hsdp: 4 ranks, 2 replicas of 2 shards")
for _tp in ("TP", "SP"):
    _PAIRS[(_tp, "EMA")] = Tested(EMA_SHARDED, "case tp")
_PAIRS[("cpu-offload", "EMA")] = Tested(EMA_SHARDED, "case offload: the shards in host memory")
_PAIRS[("overlap-offload", "EMA")] = Tested(
    EMA_SHARDED, "case offload_overlap (each update waits for the whole step: the average reads every weight)"
)
CONTEXT = "tests/integration/test_context_parallel.py::"
CP_DP = CONTEXT + "test_dp2_cp2_equals_one_process_with_update_freq_2_plain_and_with_documents"
_PAIRS[("FSDP", "CP")] = Tested(CP_DP, "the Llama family: FSDP2 shards over dp_shard x cp")
_PAIRS[("CP", "document mask")] = Tested(CP_DP, "the Llama family, with --reset-position-ids")
CP_TP_AC = CONTEXT + "test_tp2_cp2_and_cp2_with_checkpointing_in_bf16_equal_one_process"
for _other in ("TP", "SP", "AC", "bf16"):
    _PAIRS[(_other, "CP")] = Tested(CP_TP_AC, "the Llama family")
_PAIRS[("CP", "compile")] = Tested(
    CONTEXT + "test_cp2_compiled_equals_eager_plain_and_with_documents",
    "2 ranks, cp 2, c10d, and FSDP2 with documents and --checkpoint-activations; the "
    "attention over the gathered keys/values runs eagerly between two graphs of each "
    "block",
)
EXPERTS = "tests/integration/test_moe_train.py::"
_PAIRS[("FSDP", "EP")] = Tested(
    EXPERTS + "test_expert_parallel_with_fsdp2_equals_one_process",
    "2 ranks (ep 2) and 4 ranks (ep 2, the experts sharded over 2); full_shard",
)
_PAIRS[("HSDP", "EP")] = Tested(
    EXPERTS + "test_expert_parallel_with_hsdp_equals_one_process",
    "4 ranks, hybrid_shard 2 x 2, ep 2: the experts on a (replicate, shard) mesh of "
    "their own; the consolidated checkpoint resumed in one process; no_shard x EP too",
)
_PAIRS[("TP", "EP")] = Tested(
    EXPERTS + "test_expert_parallel_2_with_tensor_parallel_2_equals_one_process",
    "4 ranks: attention tensor-parallel over tp 2, each expert whole (replicated over tp) "
    "and the experts spread over ep 2 of the data-parallel ranks; c10d (FSDP2 replicate) and "
    "fully_sharded",
)
_PAIRS[("SP", "EP")] = Tested(
    EXPERTS + "test_expert_parallel_2_with_tensor_parallel_2_equals_one_process",
    "case sequence_parallel: each tp rank routes its positions, the router statistics and "
    "the MoE gradients summed over tp",
)
_PAIRS[("cpu-offload", "EP")] = Tested(
    EXPERTS + "test_expert_parallel_with_fsdp2_cpu_offload_equals_one_process",
    "2 ranks, ep 2, cpu_adam, clipped; on CPU (FSDP2's offload policy acts on a GPU)",
)
_PAIRS[("overlap-offload", "EP")] = Tested(
    EXPERTS + "test_expert_parallel_overlap_offload_step_equals_the_serial_step",
    "2 ranks, ep 2, clipped: the experts' squares added over the ep ranks "
    "before the clip factor; equal to the serial step and to one process",
)
_PAIRS[("EP", "compile")] = Tested(
    EXPERTS + "test_expert_parallel_compiled_equals_one_process",
    "2 ranks, ep 2, c10d and fully_sharded; the token exchange runs eagerly between two graphs of each block",
)
_PAIRS[("EP", "data mixture")] = Tested(
    EXPERTS + "test_expert_parallel_with_a_data_mixture_equals_one_process", "2 ranks, ep 2, DDP"
)
_PAIRS[("CP", "EP")] = Tested(
    EXPERTS + "test_expert_parallel_2_with_context_parallel_2_equals_one_process",
    "4 ranks, dp_shard 2 x cp 2 under FSDP2, ep 2 carved from them; the routers' statistics summed over the cp "
    "ranks, so the balance and z losses are the whole sequences' (MoE with cp 2 alone: "
    "test_context_parallel_2_equals_one_process)",
)
SPLIT_PAIRS = (
    "tests/integration/test_model_split_pairs.py::test_context_and_expert_parallel_with_each_feature_equal_one_process"
)
TWO_RANKS_SPLIT = "the MoE family on 2 ranks, cp 2 and ep 2 over the same ranks"
for _case, (_others, _layout) in {  # the cases of SPLIT_PAIRS (tests/integration/test_model_split_pairs.py CASES)
    "fp8_bf16_ac": (("fp8", "bf16", "AC"), TWO_RANKS_SPLIT),
    "fp16": (("fp16",), TWO_RANKS_SPLIT),
    "mefp16": (("memory-efficient fp16",), TWO_RANKS_SPLIT),
    "mask_muon": (("document mask", "muon"), TWO_RANKS_SPLIT),
    "offload_overlap": (("cpu-offload", "overlap-offload"), TWO_RANKS_SPLIT + ", FSDP2"),
    "hsdp_mixture_ema": (
        ("HSDP", "data mixture", "EMA"),
        "the MoE family on 4 ranks: 2 replicas of a cp 2 / ep 2 pair",
    ),
}.items():
    for _model_split in ("CP", "EP"):
        for _other in _others:
            _fill(_model_split, _other, Tested(SPLIT_PAIRS, f"case {_case}: {_layout}"))
MUON_PAIRS = "tests/integration/test_muon_pairs.py::test_muon_with_each_feature_equals_one_process"
for _case, _others in {  # the cases of MUON_PAIRS (tests/integration/test_muon_pairs.py CASES): 2 FSDP2 ranks
    "compile_ac_ema_mask": ("compile", "AC", "EMA", "document mask"),  # against one eager process
    "mefp16": ("memory-efficient fp16",),
    "fp16_mixture": ("fp16", "data mixture"),
    "fp8_bf16": ("fp8", "bf16"),
}.items():
    for _other in _others:
        _fill("muon", _other, Tested(MUON_PAIRS, f"case {_case}"))

LORA = "tests/integration/test_lora.py::"
LORA_FSDP = LORA + "test_two_fsdp_ranks_equal_one_process"
_PAIRS[("FSDP", "LoRA")] = Tested(LORA_FSDP, "case plain: 2 ranks against one process with --update-freq 2")
for _case, _others in {  # the cases of LORA_FSDP (tests/integration/test_lora.py CASES), against one process
    "compile_ac_mask": ("compile", "AC", "document mask"),
    "hsdp_muon_ema": ("HSDP", "muon", "EMA"),
    "offload_fp16": ("cpu-offload", "fp16"),
    "mefp16": ("memory-efficient fp16",),
    "bf16": ("bf16",),
}.items():
    for _other in _others:
        _PAIRS[(_other, "LoRA")] = Tested(LORA_FSDP, f"case {_case}")
LORA_TP = LORA + "test_tensor_parallel_ranks_equal_one_process"
_PAIRS[("TP", "LoRA")] = Tested(LORA_TP, "2 ranks tp 2 against one process: column and row-parallel adapters")
_PAIRS[("SP", "LoRA")] = Tested(LORA_TP, "sequence parallel (the default under tp)")
for _other in ("CP", "data mixture"):
    _PAIRS[(_other, "LoRA")] = Tested(SPLIT_PAIRS, "case lora_cp_mixture: the MoE family on 2 ranks, cp 2")
_PAIRS[("EP", "LoRA")] = Tested(SPLIT_PAIRS, "case lora_ep: the MoE family on 2 FSDP2 ranks, ep 2 (two replicas)")
_PAIRS[("fp8", "LoRA")] = Refused(LORA_FP8)
_PAIRS[("overlap-offload", "LoRA")] = Refused(LORA_OVERLAP)

PIPELINE = "tests/integration/test_pipeline_parallel.py::test_pipelined_run_logs_one_process_losses"
_PAIRS[("FSDP", "PP")] = Tested(PIPELINE, "case dp2_pp2_fsdp: 4 ranks, FSDP2 over each stage's 2 data ranks")
_PAIRS[("AC", "PP")] = Tested(PIPELINE, "case pp2: 2 ranks, each stage's blocks recomputed in backward")
_PAIRS[("bf16", "PP")] = Tested(
    PIPELINE, "case pp2_bf16: 2 ranks, interleaved_1f1b, against one process in bf16 (2e-2)"
)
_PAIRS[("EP", "PP")] = Tested(
    PIPELINE,
    "case pp2_ep2_moe: the MoE family on 4 ranks, FSDP2 and ep 2 over each stage's 2 data ranks, the routers' terms "
    "through the schedule",
)
_PAIRS[("fp16", "PP")] = Tested(
    PIPELINE,
    "case pp2_fp16: 2 ranks, a loss scale that overflows: each micro-batch's loss scaled inside the schedule, the "
    "overflow decided on the norm summed over the stages, one process's loss scales and skipped updates (1e-2)",
)
_PAIRS[("memory-efficient fp16", "PP")] = Tested(
    PIPELINE,
    "case pp2_mefp16: 2 ranks, fp16 weights and hidden states, the loss scale of case pp2_fp16, one process's loss "
    "scales and skipped updates (1e-2)",
)
_PAIRS[("compile", "PP")] = Tested(
    PIPELINE,
    "case pp2_compile_fp8: 2 ranks, 1f1b, each stage's blocks compiled (aot_eager), float8 Linear layers, against one "
    "eager float8 process (2e-2); zero_bubble and dualpipev refused (below)",
)
_PAIRS[("fp8", "PP")] = Tested(
    PIPELINE, "case pp2_compile_fp8: 2 ranks, each stage's blocks' Linear layers in float8 (rowwise), compiled"
)
_PAIRS[("TP", "PP")] = Tested(
    PIPELINE, "case pp2_tp2: 4 ranks, each stage split over its 2 tp ranks, the head vocabulary-parallel"
)
_PAIRS[("CP", "PP")] = Tested(
    PIPELINE, "case pp2_cp2: 4 ranks, each stage's sequences cut over its 2 cp ranks, FSDP2 over them"
)
_PAIRS[("SP", "PP")] = Tested(PIPELINE, "case pp2_tp2: sequence parallel (the default), T/2 positions between stages")
_PAIRS[("document mask", "PP")] = Tested(
    PIPELINE,
    "case pp2_mask_mixture: 2 ranks, every stage given its micro-batch's document ids and reset positions; "
    "pp2_cp2_mask_mixture: 4 ranks, cp 2 too, the documents read through each micro-batch's shard",
)
_PAIRS[("data mixture", "PP")] = Tested(
    PIPELINE, "case pp2_mask_mixture: 2 ranks, both stages reading their data rank's mixture batch"
)
_PAIRS[("muon", "PP")] = Tested(
    PIPELINE,
    "case dp2_pp2_muon_ema: 4 ranks, each stage's matrices gathered to owners among its 2 data ranks; the "
    "stages' Muon/AdamW groups saved as one process's",
)
_PAIRS[("EMA", "PP")] = Tested(
    "tests/integration/test_pipeline_parallel.py::test_pipelined_moving_average_is_one_process_average",
    "case dp2_pp2_muon_ema: each stage averages its layers; the sharded save consolidates to one process's "
    "average, restored at pp 2, whose .pt holds it whole",
)
_PAIRS[("LoRA", "PP")] = Tested(
    PIPELINE,
    "case pp2_lora: 2 ranks, zero_bubble (a layer a stage), each stage's adapters beside its frozen weights; "
    "the save is one process's (test_pipelined_lora_save_is_one_process_save)",
)
_PAIRS[("HSDP", "PP")] = Tested(
    PIPELINE, "case pp2_hsdp_overlap: 4 ranks, each stage's 2 data ranks a (replicate 2, shard 1) mesh"
)
_PAIRS[("cpu-offload", "PP")] = Tested(
    PIPELINE, "case pp2_offload: 2 ranks, CPU Adam steps each stage's shards, clipped by the norm over the stages"
)
_PAIRS[("overlap-offload", "PP")] = Tested(
    PIPELINE,
    "case pp2_hsdp_overlap: each stage's squares taken in backward after its last micro-batch, summed over pp",
)

# The data-parallel backend under TP is not a feature pair (every run has one backend): each value, tested.
TP_BACKENDS: Dict[str, Status] = {
    "fully_sharded": Tested(TP_DP, "FSDP2 shards over the data-parallel ranks of each tensor-parallel slice"),
    "c10d": Tested(
        "tests/integration/test_tp_cli.py::test_consolidated_checkpoint_is_the_plain_layout",
        "FSDP2 replicates over the data-parallel ranks (DDP does not take DTensor parameters)",
    ),
    "no_c10d": Tested(
        "tests/integration/test_tp_no_c10d.py::test_tensor_parallel_with_no_c10d_matches_one_process",
        "no FSDP2: each rank all-reduces its own shards' gradients with the ranks holding the same "
        "ones, after backward; 2 and 4 ranks, and --fp16; --memory-efficient-fp16 refused: " + TP_NO_C10D_MEFP16,
    ),
}


def _in_order(table: Dict[Tuple[str, str], Status]) -> Dict[Tuple[str, str], Status]:
    """The table keyed in FEATURES' order; a pair given in both orders with two entries is a mistake here."""
    out: Dict[Tuple[str, str], Status] = {}
    for (a, b), entry in table.items():
        key = (a, b) if NAMES.index(a) < NAMES.index(b) else (b, a)
        if out.get(key, entry) != entry:
            raise ValueError(f"composition table: {a} x {b} has two entries")
        out[key] = entry
    return out


_PAIRS = _in_order(_PAIRS)


def status(a: str, b: str) -> Status:
    """The entry of the pair (a, b), in either order."""
    return _PAIRS.get((a, b) if NAMES.index(a) < NAMES.index(b) else (b, a), INDEPENDENT)


def pairs() -> List[Tuple[Feature, Feature, Status]]:
    """Every unordered pair of features once, in the table's order."""
    return [(a, b, status(a.name, b.name)) for a, b in itertools.combinations(FEATURES, 2)]


# --- refusals that are not a pair of the table: a setting under a feature, or the model ---------------------------


@dataclass(frozen=True)
class Condition:
    """A refusal the pairs above do not name: ``on(cfg, model_cls)`` (the model's class: its capabilities; None for
    the settings, checked before the model is known), ``when`` in words for the docs, ``message`` the one-line
    UserError (or a function of the config giving it: the sizes and names the user typed)."""

    label: str  # what it narrows: a pair or a feature of the table, or a flag
    when: str
    on: Callable[[Any, Any], bool]
    message: Union[str, Callable[[Any], str]]
    argv: Tuple[str, ...] = ()  # turns it on in a test (tests/unit/test_composition.py)

    def text(self, cfg: Any) -> str:
        return self.message(cfg) if callable(self.message) else self.message


# TP x compile depends on the model in one case: without sequence parallelism the dropouts on a rank's own heads
# and hidden units draw from a per-rank generator reseeded between layers inside a block (toolkit.distributed.
# tensor_parallel), which a compiled block cannot do; with sequence parallelism the whole block draws per rank.
COMPILE_TP_SHARDED_DROPOUT = (
    "--compile with --model-parallel-size > 1 and --no-sequence-parallel: the attention and activation dropouts act "
    "on this rank's heads and hidden units and draw from a per-rank generator that is reseeded between layers inside "
    "a block, and a compiled block draws from one generator; drop --no-sequence-parallel (then the whole block draws "
    "per rank) or set --attention-dropout and --activation-dropout to 0"
)
# The zero-bubble schedules take a stage's input gradients first and its weight gradients later, from the retained
# graph; a compiled block's backward is one graph that computes both (and frees its saved tensors as it goes).
SPLIT_BACKWARD_SCHEDULES = ("zero_bubble", "dualpipev")
PP_COMPILE_SPLIT_BACKWARD = (
    "--compile with --pipeline-schedule zero_bubble or dualpipev: these schedules split each stage's backward into "
    "the input gradients and, later, the weight gradients, and a compiled block's backward is one graph computing "
    "both, which the weight pass would run again; use --pipeline-schedule 1f1b or interleaved_1f1b, or drop --compile"
)
BF16_HOST_GRADS = "--bf16-host-grads requires --cpu-offload (it keeps the offloaded gradients in bf16)"
HOST_MEMORY_OPTIMIZERS = (OFFLOAD_OPTIMIZER, "muon")  # update host-memory shards in place
QUANT_NOISE_TP = (
    "--quant-noise-pq with --model-parallel-size > 1: the noise masks whole weights, which "
    "tensor parallelism splits; train with data parallelism (fully_sharded or c10d)"
)
TP_NO_C10D = TP2 + ("--ddp-backend", "no_c10d")


def _model(cfg: Any, name: str) -> Any:
    """A model option (None where the family has no such option)."""
    return vars(cfg.model).get(name) if cfg.model is not None else None


def _sharded_dropout(cfg: Any) -> bool:
    return any((_model(cfg, name) or 0) > 0 for name in ("attention_dropout", "activation_dropout", "relu_dropout"))


def _qk_clip(cfg: Any) -> bool:
    return cfg.components.optimizer == "muon" and getattr(cfg.optimizer, "qk_clip_threshold", None) is not None


def _tp_no_c10d(cfg: Any) -> bool:
    return cfg.distributed.model_parallel_size > 1 and cfg.distributed.ddp_backend == "no_c10d"


def _requires_fsdp(label: str, flag: str) -> Condition:
    name = flag[2:].replace("-", "_")
    return Condition(
        label,
        "without --ddp-backend fully_sharded",
        lambda c, _cls: getattr(c.distributed, name) and c.distributed.ddp_backend != "fully_sharded",
        f"{flag} requires --ddp-backend fully_sharded",
        (flag,),
    )


SETTINGS: Tuple[Condition, ...] = (
    Condition(
        "TP x compile",
        "under --no-sequence-parallel with attention or activation dropout",
        lambda c, _cls: (
            c.distributed.compile
            and c.distributed.model_parallel_size > 1
            and c.distributed.no_sequence_parallel
            and _sharded_dropout(c)
        ),
        COMPILE_TP_SHARDED_DROPOUT,
        TP2 + ("--compile", "--no-sequence-parallel", "--attention-dropout", "0.1"),
    ),
    Condition(
        "TP x memory-efficient fp16",
        "under --ddp-backend no_c10d",
        lambda c, _cls: _tp_no_c10d(c) and c.common.memory_efficient_fp16,
        TP_NO_C10D_MEFP16,
        TP_NO_C10D + ("--memory-efficient-fp16",),
    ),
    Condition(
        "TP x EP",
        "under --ddp-backend no_c10d",
        lambda c, _cls: _tp_no_c10d(c) and _size(c, "expert_parallel_size") > 1,
        EP_TP_NO_C10D,
        TP_NO_C10D + ("--arch", "moe_tiny", "--expert-parallel-size", "2"),
    ),
    Condition(
        "PP",
        "with data-parallel ranks under --ddp-backend c10d or no_c10d",
        lambda c, _cls: (
            _size(c, "pipeline_parallel_size") > 1
            and c.distributed.ddp_backend != "fully_sharded"
            and c.distributed.distributed_world_size
            > _size(c, "pipeline_parallel_size") * _size(c, "model_parallel_size")  # the stages' tp ranks: no data
        ),
        "--pipeline-parallel-size with data-parallel ranks: DDP's wrapper runs the whole model's forward, which a "
        "stage does not; use --ddp-backend fully_sharded (FSDP2 over each stage's data ranks)",
        PP2 + ("--distributed-world-size", "4"),
    ),
    Condition(
        "PP x compile",
        "under --pipeline-schedule zero_bubble or dualpipev",
        lambda c, _cls: (
            c.distributed.compile
            and _size(c, "pipeline_parallel_size") > 1
            and c.distributed.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
        ),
        PP_COMPILE_SPLIT_BACKWARD,
        PP2 + FSDP + ("--compile", "--pipeline-schedule", "zero_bubble"),
    ),
    _requires_fsdp("cpu-offload", "--cpu-offload"),
    _requires_fsdp("--no-reshard-after-forward", "--no-reshard-after-forward"),
    Condition(
        "--bf16-host-grads",
        "without --cpu-offload",
        lambda c, _cls: c.distributed.bf16_host_grads and not c.distributed.cpu_offload,
        BF16_HOST_GRADS,
        ("--bf16-host-grads",),
    ),
    Condition(
        "--qk-clip-threshold",
        "with tensor or context parallelism or --compile",
        lambda c, _cls: (
            _qk_clip(c)
            and (
                c.distributed.model_parallel_size > 1 or _size(c, "context_parallel_size") > 1 or c.distributed.compile
            )
        ),
        "--qk-clip-threshold: each head's largest logit is recorded from the whole heads and sequence of a plain "
        "(uncompiled) forward; train it with FSDP2/HSDP and --expert-parallel-size, without "
        "--model-parallel-size, --context-parallel-size and --compile",
        ("--optimizer", "muon", "--qk-clip-threshold", "100") + TP2,
    ),
    Condition(
        "cpu-offload",
        "with an --optimizer that does not update host-memory shards",
        lambda c, _cls: c.distributed.cpu_offload and c.components.optimizer not in HOST_MEMORY_OPTIMIZERS,
        lambda c: (
            "--cpu-offload requires --optimizer cpu_adam or muon (the offloaded shards are updated in host memory by "
            "DeepSpeed's CPU Adam or Muon's host-memory momentum), got --optimizer "
            f"{c.components.optimizer}; drop --optimizer or use --optimizer cpu_adam"
        ),
        FSDP + ("--cpu-offload", "--optimizer", "adam"),
    ),
)


def _no_split(option: str, on: Callable[[Any], bool], reason: str, argv: Tuple[str, ...]) -> Condition:
    """A model option with no tensor-parallel split: the family's modules it builds have no kind in its plan."""
    return Condition(
        "TP",
        f"with {option}",
        lambda c, _cls: c.distributed.model_parallel_size > 1 and on(c),
        lambda c: f"--model-parallel-size {c.distributed.model_parallel_size}: {reason}",
        TP2 + argv,
    )


MODEL: Tuple[Condition, ...] = (
    Condition(
        "PP",
        "with an --arch whose forward the pipeline cannot cut into stages",
        lambda c, cls: _size(c, "pipeline_parallel_size") > 1 and not supports(cls, "supports_pipeline_parallel"),
        lambda c: (
            f"--pipeline-parallel-size: --arch {c.components.arch} does not "
            "declare a forward the pipeline can cut into stages (the Llama family and the MoE ones, DeepSeek-V3, gpt-oss, GLM-4.5 and "
            "Qwen3-Next do); drop the flag"
        ),
        PP2 + FSDP + ("--arch", "transformer_lm"),
    ),
    Condition(
        "EP",
        "with an --arch without expert (MoE) layers",
        lambda c, cls: _size(c, "expert_parallel_size") > 1 and not supports(cls, "supports_expert_parallel"),
        lambda c: (
            f"--expert-parallel-size {c.distributed.expert_parallel_size}: --arch {c.components.arch} has no expert "
            "(MoE) layers to place; use a MoE architecture or drop the flag"
        ),
        ("--expert-parallel-size", "2"),
    ),
    Condition(
        "CP",
        "with an --arch without context-parallel attention",
        lambda c, cls: _size(c, "context_parallel_size") > 1 and not supports(cls, "supports_context_parallel"),
        lambda c: (
            f"--context-parallel-size {c.distributed.context_parallel_size}: --arch {c.components.arch}'s attention "
            "does not exchange keys/values across ranks (it has no context-parallel attention), so each rank would "
            "see only its chunk of the sequence; drop the flag"
        ),
        ("--context-parallel-size", "2"),
    ),
    Condition(
        "TP",
        "with an --arch with MoE layers, under --ddp-backend no_c10d",
        lambda c, cls: _tp_no_c10d(c) and supports(cls, "supports_expert_parallel"),
        lambda c: (
            f"--ddp-backend no_c10d with --model-parallel-size {c.distributed.model_parallel_size}: the MoE layers "
            "stay whole on every tp rank (plain tensors beside the tp shards), and only FSDP2 reduces their "
            "gradients, over meshes of their own; use --ddp-backend c10d or fully_sharded"
        ),
        TP_NO_C10D + ("--arch", "moe_tiny"),
    ),
    Condition(
        "TP",
        "with --quant-noise-pq",
        lambda c, _cls: c.distributed.model_parallel_size > 1 and (_model(c, "quant_noise_pq") or 0) > 0,
        QUANT_NOISE_TP,
        TP2 + ("--quant-noise-pq", "0.1"),
    ),
    _no_split(
        "--adaptive-softmax-cutoff",
        lambda c: _model(c, "adaptive_softmax_cutoff") is not None,
        "the adaptive softmax (--adaptive-softmax-cutoff, e.g. --arch transformer_lm_wiki103) has no "
        "tensor-parallel split; use a plain output projection or --model-parallel-size 1",
        ("--adaptive-softmax-cutoff", "16,32", "--criterion", "adaptive_loss"),
    ),
    _no_split(
        "--layernorm-embedding",
        lambda c: bool(_model(c, "layernorm_embedding")),
        "--layernorm-embedding has no tensor-parallel split; leave it out or use --model-parallel-size 1",
        ("--layernorm-embedding",),
    ),
    _no_split(
        "--adaptive-input",
        lambda c: bool(_model(c, "adaptive_input")),
        "the adaptive input (--adaptive-input) has no tensor-parallel split; leave out --adaptive-input or "
        "use --model-parallel-size 1",
        ("--adaptive-input", "--adaptive-input-cutoff", "16,32"),
    ),
    _no_split(
        "--qk-norm-full-width",
        lambda c: bool(_model(c, "qk_norm")) and bool(_model(c, "qk_norm_full_width")),
        "--qk-norm-full-width (OLMoE) normalizes q and k over all heads, which a split by heads puts on different "
        "ranks; train it with FSDP (--model-parallel-size 1)",
        ("--arch", "olmoe_tiny"),
    ),
    _no_split(
        "--linear-split-projections",
        lambda c: bool(_model(c, "linear_split_projections")),
        "the gated DeltaNet layers' split projections (--linear-split-projections: Qwen3.5's in_proj_qkv holds all "
        "of q, then k, then v) have no tensor-parallel split by heads; train them with FSDP, --expert-parallel-size "
        "and --context-parallel-size (--model-parallel-size 1)",
        ("--arch", "qwen3_5_moe_tiny"),
    ),
)


def refusal(cfg: Any) -> Optional[str]:
    """The message of the first refused pair that ``cfg`` turns on, then of the first refused setting (None: every
    pair and setting composes). The resolver's first check, before implied values are filled in."""
    on = [f for f in FEATURES if f.on(cfg)]
    for a, b in itertools.combinations(on, 2):
        entry = status(a.name, b.name)
        if isinstance(entry, Refused):
            return entry.message
    return _first(SETTINGS, cfg, None)


def model_refusal(cfg: Any, model_cls: Any) -> Optional[str]:
    """What the model refuses (None: nothing): an axis its family cannot fill (its class's capabilities), an option
    the split cannot take. The resolver asks once the layout fits the world."""
    return _first(MODEL, cfg, model_cls)


def _first(conditions: Tuple[Condition, ...], cfg: Any, model_cls: Any) -> Optional[str]:
    return next((each.text(cfg) for each in conditions if each.on(cfg, model_cls)), None)


# --- the docs' table --------------------------------------------------------------------------------------

SYMBOL = {Tested: "T", Runs: "r", Refused: "X", OneSetting: "="}
# what the docs print for the sizes and names a message repeats from the command line
_DOCS_CFG = SimpleNamespace(
    distributed=SimpleNamespace(model_parallel_size="M", expert_parallel_size="P", context_parallel_size="C"),
    components=SimpleNamespace(arch="ARCH", optimizer="OPTIMIZER"),
)


def markdown() -> str:
    """``docs/composition.md``: the matrix, then every refusal and tested pair in words."""
    lines = [
        "# Which features combine",
        "",
        "Generated from `toolkit/config/composition.py` (`python -m toolkit.config.composition --markdown "
        "> docs/composition.md`); `tests/unit/test_composition.py` fails when this file is not current.",
        "",
        "T: trains and a test compares it, loss for loss, with one process (or with the same run without "
        "one of the two: eager for compile, serial for overlap-offload); r: runs (separate mechanisms), "
        "no parity test of this pair; X: refused before any worker starts, for the reason below; "
        "=: not a combination (one is a mode of the other).",
        "",
        "| | " + " | ".join(NAMES) + " |",
        "| --- |" + " --- |" * len(NAMES),
    ]
    for a in NAMES:
        cells = ["" if a == b else SYMBOL[type(status(a, b))] for b in NAMES]
        lines.append(f"| **{a}** | " + " | ".join(cells) + " |")
    lines += ["", "## Features", ""] + [f"- **{f.name}**: {f.flags}" for f in FEATURES]
    sections: Dict[type, List[str]] = {Refused: [], Tested: [], OneSetting: []}
    for a, b, entry in pairs():
        pair = f"**{a.name} x {b.name}**"
        if isinstance(entry, Refused):
            sections[Refused].append(f"- {pair}: `{entry.message}`")
        elif isinstance(entry, Tested):
            sections[Tested].append(f"- {pair}: `{entry.test}`" + (f" ({entry.note})" if entry.note else ""))
        elif isinstance(entry, OneSetting):
            sections[OneSetting].append(f"- {pair}: {entry.why}")
    for title, kind in (
        ("Refused (the message the run stops with)", Refused),
        ("Tested equal to one process", Tested),
        ("Not a combination", OneSetting),
    ):
        lines += ["", f"## {title}", ""] + sections[kind]
    for title, conditions in (
        ("Refused in some settings (a cell above narrowed, or an option another needs)", SETTINGS),
        ("Refused by the model (its family's capabilities and options)", MODEL),
    ):
        lines += ["", f"## {title}", ""]
        lines += [f"- **{c.label}**, {c.when}: `{c.text(_DOCS_CFG)}`" for c in conditions]
    lines += ["", "## --ddp-backend under TP (--model-parallel-size > 1)", ""]
    lines += [f"- **{backend}**: `{entry.test}` ({entry.note})" for backend, entry in TP_BACKENDS.items()]
    lines += ["", "## Each family's splits (CP, EP, TP)", ""]
    lines += [f"- `{CAPABILITIES.test}` ({CAPABILITIES.note})"]
    runs: Dict[str, List[str]] = {}
    for a, b, entry in pairs():
        if isinstance(entry, Runs):
            runs.setdefault(entry.why, []).append(f"{a.name} x {b.name}")
    lines += ["", "## Runs, no parity test of the pair", ""]
    lines += [f"- {', '.join(names)}: {why}" for why, names in runs.items()] or ["- none"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m toolkit.config.composition --markdown > docs/composition.md")
    sys.stdout.write(markdown())
