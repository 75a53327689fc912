"""Pairs of features through ``toolkit-train`` against one process: those that used to be refused (TP with
--compile, --fp8, --cpu-offload, --overlap-offload-step, --memory-efficient-fp16; HSDP with TP), then the pairs
that needed no change, several pairs per run (docs/composition.md lists every pair; toolkit/config/composition.py
names these tests and cases).

Four ranks are (2 data-parallel replicas x 2 tensor-parallel ranks); the one process then takes both replicas'
batches per update (``--update-freq 2``). Two ranks (one replica) where a pair changes nothing across replicas
(``--no-sequence-parallel``). Logged losses (3 decimals) are compared: fp32 1e-3
relative, bf16 and float8 2e-2, plus one unit in the last logged place. ``--compile`` uses ``aot_eager``
(dynamo's capture and AOTAutograd, no code generation), as tests/integration/test_compile.py's CLI runs do.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import dist_helpers as H
from toolkit.distributed.compile import BACKEND_ENV

UPDATES = 4
LOGGED_TOL = 1.01e-3
FOUR_RANKS = ["--distributed-world-size", "4", "--model-parallel-size", "2", "--ddp-backend", "fully_sharded"]
TWO_RANKS = ["--distributed-world-size", "2", "--model-parallel-size", "2", "--ddp-backend", "fully_sharded"]
COMPILE = {BACKEND_ENV: "aot_eager"}


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("composition") / "bin"))


def train(data_bin, save_dir, *flags, llama=False, env=None):
    args = H.llama_args(save_dir) if llama else H.model_args(str(save_dir))
    proc = H.run_train(
        [data_bin, *args, "--disable-validation", "--max-update", str(UPDATES), *flags], env=env, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def assert_same_losses(got, want, rel):
    got, want = H.losses(got.stdout), H.losses(want.stdout)
    assert sorted(got) == sorted(want) == list(range(1, UPDATES + 1)), (got, want)
    for u in want:
        assert abs(got[u] - want[u]) <= rel * abs(want[u]) + LOGGED_TOL, (u, got[u], want[u])


def compiled(proc) -> bool:
    return "--compile: torch.compile (aot_eager, fullgraph) on each of the 2 blocks" in proc.stdout


@pytest.mark.parametrize("llama", [False, True], ids=["transformer_lm", "llama"])
def test_tensor_parallel_compiled_matches_one_process(data_bin, tmp_path, llama):
    """--compile under TP (with activation checkpointing): the block's forward is compiled, the per-rank
    random-number hooks on the block run around it."""
    one = train(data_bin, tmp_path / "one", "--update-freq", "2", llama=llama)
    tp = train(
        data_bin, tmp_path / "tp", *FOUR_RANKS, "--compile", "--checkpoint-activations", llama=llama, env=COMPILE
    )
    assert compiled(tp) and "2 data-parallel replicas" in tp.stdout
    assert_same_losses(tp, one, 1e-3)


def test_tensor_parallel_compiled_without_sequence_parallelism(data_bin, tmp_path):
    """--no-sequence-parallel: the dropout hooks sit inside the compiled block; with those dropouts at 0 they
    draw nothing (the resolver refuses them above 0, test_composition in tests/unit)."""
    one = train(data_bin, tmp_path / "one")
    tp = train(data_bin, tmp_path / "tp", *TWO_RANKS, "--compile", "--no-sequence-parallel", env=COMPILE)
    assert compiled(tp)
    assert_same_losses(tp, one, 1e-3)


def model_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def test_tensor_parallel_cpu_offload_matches_one_process(data_bin, tmp_path):
    """cpu_adam steps each rank's DTensor shards (2-D: data-parallel shard of a tensor-parallel shard), serially
    and with --overlap-offload-step; the weights after the run equal one process's."""
    offload = ["--cpu-offload", "--optimizer", "cpu_adam"]
    one = train(data_bin, tmp_path / "one", "--update-freq", "2", "--optimizer", "cpu_adam")
    serial = train(data_bin, tmp_path / "serial", *FOUR_RANKS, *offload)
    overlap = train(data_bin, tmp_path / "overlap", *FOUR_RANKS, *offload, "--overlap-offload-step")
    assert "--overlap-offload-step: CPU Adam steps" in overlap.stdout
    assert_same_losses(serial, one, 1e-3)
    assert_same_losses(overlap, one, 1e-3)
    want = model_state(tmp_path / "one" / "checkpoint_last.pt")
    for run in ("serial", "overlap"):
        got = model_state(tmp_path / run / "checkpoint_last.pt")
        assert got.keys() == want.keys()
        for k in want:
            a, b = got[k], want[k]
            if k.endswith("qkv_proj.bias"):  # the k bias has an exactly-zero gradient: Adam steps on rounding
                C = a.numel() // 3  # noise (as in test_tp_cli)
                a, b = torch.cat([a[:C], a[2 * C :]]), torch.cat([b[:C], b[2 * C :]])
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-4), (run, k)


def test_tensor_parallel_fp8_matches_one_process(data_bin, tmp_path):
    """float8 Linear layers in the blocks under TP (column-parallel ones compute their shard in float8), against
    one float8 process; and TP in bf16 against one bf16 process."""
    one = train(data_bin, tmp_path / "one", "--fp8", "--bf16", "--update-freq", "2")
    tp = train(data_bin, tmp_path / "tp", *FOUR_RANKS, "--fp8", "--bf16")
    assert "float8 Linear layers after the split: 8 (4 column-parallel)" in tp.stdout
    assert_same_losses(tp, one, 2e-2)
    one_bf16 = train(data_bin, tmp_path / "one_bf16", "--bf16", "--update-freq", "2")
    tp_bf16 = train(data_bin, tmp_path / "tp_bf16", *FOUR_RANKS, "--bf16")
    assert_same_losses(tp_bf16, one_bf16, 2e-2)
    assert H.losses(tp.stdout) != H.losses(tp_bf16.stdout), "float8 changes what is computed"


def test_tensor_parallel_memory_efficient_fp16_matches_one_process(data_bin, tmp_path):
    one = train(data_bin, tmp_path / "one", "--memory-efficient-fp16", "--update-freq", "2")
    tp = train(data_bin, tmp_path / "tp", *FOUR_RANKS, "--memory-efficient-fp16")
    assert_same_losses(tp, one, 1e-3)


def test_hsdp_with_tensor_parallel_matches_one_process(data_bin, tmp_path):
    """hybrid_shard under TP: a (2 replicate, 1 shard, 2 tp) mesh on four ranks."""
    one = train(data_bin, tmp_path / "one", "--update-freq", "2")
    hsdp = train(
        data_bin, tmp_path / "hsdp", *FOUR_RANKS, "--sharding-strategy", "hybrid_shard", "--shard-group-size", "1"
    )
    assert "mesh (2, 1, 2) ('dp_replicate', 'dp_shard', 'tp')" in hsdp.stdout
    assert_same_losses(hsdp, one, 1e-3)


# --- pairs with nothing to change in the code: each run against one process (docs/composition.md's T) --------
HSDP = [
    "--distributed-world-size",
    "2",
    "--ddp-backend",
    "fully_sharded",
    "--sharding-strategy",
    "hybrid_shard",
    "--shard-group-size",
    "1",
]  # (2 replicas, 1 shard)
FSDP2 = ["--distributed-world-size", "2", "--ddp-backend", "fully_sharded"]
OFFLOAD = ["--cpu-offload", "--optimizer", "cpu_adam"]
C10D = ["--distributed-world-size", "2", "--ddp-backend", "c10d"]
REFERENCES = {  # one process, the batches of two ranks per update
    "fp32": [],
    "bf16": ["--bf16"],
    "fp16": ["--fp16"],
    "mefp16": ["--memory-efficient-fp16"],
    "fp8": ["--fp8", "--bf16"],
    "mask": ["--document-attention-mask"],
}
BF16_TOL, FP16_TOL = 2e-2, 1e-2
RUNS = {  # name: (flags, reference, relative tolerance)
    "hsdp_compile": (HSDP + ["--compile"], "fp32", 1e-3),
    "hsdp_ac": (HSDP + ["--checkpoint-activations"], "fp32", 1e-3),
    "hsdp_offload_overlap": (HSDP + OFFLOAD + ["--overlap-offload-step"], "fp32", 1e-3),
    "hsdp_bf16": (HSDP + ["--bf16"], "bf16", BF16_TOL),
    "hsdp_fp16": (HSDP + ["--fp16"], "fp16", FP16_TOL),
    "hsdp_mefp16": (HSDP + ["--memory-efficient-fp16"], "mefp16", FP16_TOL),
    "hsdp_mask": (HSDP + ["--document-attention-mask"], "mask", 1e-3),
    "hsdp_fp8": (HSDP + ["--fp8", "--bf16"], "fp8", BF16_TOL),
    "fsdp_fp16": (FSDP2 + ["--fp16"], "fp16", FP16_TOL),
    "fsdp_mefp16": (FSDP2 + ["--memory-efficient-fp16"], "mefp16", FP16_TOL),
    "offload_bf16_ac": (FSDP2 + OFFLOAD + ["--bf16", "--checkpoint-activations"], "bf16", BF16_TOL),
    "offload_fp16": (FSDP2 + OFFLOAD + ["--fp16"], "fp16", FP16_TOL),
    "overlap_bf16": (FSDP2 + OFFLOAD + ["--overlap-offload-step", "--bf16"], "bf16", BF16_TOL),
    "offload_mask": (FSDP2 + OFFLOAD + ["--document-attention-mask"], "mask", 1e-3),
    "offload_fp8_ac": (FSDP2 + OFFLOAD + ["--fp8", "--bf16", "--checkpoint-activations"], "fp8", BF16_TOL),
    "compile_fp8": (FSDP2 + ["--compile", "--fp8", "--bf16"], "fp8", BF16_TOL),
    "compile_mefp16": (FSDP2 + ["--compile", "--memory-efficient-fp16"], "mefp16", FP16_TOL),
    "ac_fp16_mask": (
        FSDP2 + ["--checkpoint-activations", "--fp16", "--document-attention-mask"],
        "fp16+mask",
        FP16_TOL,
    ),
    "overlap_fp8_ac_mask": (
        FSDP2
        + OFFLOAD
        + ["--overlap-offload-step", "--fp8", "--bf16", "--checkpoint-activations", "--document-attention-mask"],
        "fp8+mask",
        BF16_TOL,
    ),
    "overlap_mefp16_ac_mask": (
        FSDP2
        + OFFLOAD
        + [
            "--overlap-offload-step",
            "--memory-efficient-fp16",
            "--checkpoint-activations",
            "--document-attention-mask",
        ],
        "mefp16+mask",
        FP16_TOL,
    ),
    "ema_compile_ac_fp16_mask": (
        C10D + ["--store-ema", "--compile", "--checkpoint-activations", "--fp16", "--document-attention-mask"],
        "fp16+mask",
        FP16_TOL,
    ),
    "ema_fp8": (C10D + ["--store-ema", "--fp8", "--bf16"], "fp8", BF16_TOL),
    "ema_mefp16": (C10D + ["--store-ema", "--memory-efficient-fp16"], "mefp16", FP16_TOL),
}


@pytest.fixture(scope="module")
def references(data_bin, tmp_path_factory):
    out = {}
    for name in {reference for _, reference, _ in RUNS.values()}:
        flags = [f for part in name.split("+") for f in REFERENCES[part]]
        out[name] = train(data_bin, tmp_path_factory.mktemp(name.replace("+", "_")), *flags, "--update-freq", "2")
    return out


@pytest.mark.parametrize("name", sorted(RUNS))
def test_pairs_that_run_match_one_process(data_bin, tmp_path, references, name):
    flags, reference, rel = RUNS[name]
    proc = train(data_bin, tmp_path, *flags, env=COMPILE if "--compile" in flags else None)
    assert_same_losses(proc, references[reference], rel)


# --- --data-mixture with every other feature: the mixture is drawn per data-parallel rank ---------------------
MIXTURE_RUNS = {  # name: (flags, reference, relative tolerance)
    "tp_compile_ac": (FOUR_RANKS + ["--compile", "--checkpoint-activations"], "fp32", 1e-3),
    "hsdp_offload_overlap_mask": (
        HSDP + OFFLOAD + ["--overlap-offload-step", "--document-attention-mask"],
        "mask",
        1e-3,
    ),
    "ema_fp8": (C10D + ["--store-ema", "--fp8", "--bf16"], "fp8", BF16_TOL),
    "fsdp_fp16": (FSDP2 + ["--fp16"], "fp16", FP16_TOL),
    "fsdp_mefp16": (FSDP2 + ["--memory-efficient-fp16"], "mefp16", FP16_TOL),
}


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    from tests.helpers.mixture import make_sources

    root = make_sources(tmp_path_factory.mktemp("mixture"))
    return ["--data-mixture", f"web={root}/web:0.7,code={root}/code:0.3"]


@pytest.fixture(scope="module")
def mixture_references(mixture, tmp_path_factory):
    return {
        name: train("", tmp_path_factory.mktemp(f"mixture_{name}"), *mixture, *REFERENCES[name], "--update-freq", "2")
        for name in {reference for _, reference, _ in MIXTURE_RUNS.values()}
    }


@pytest.mark.parametrize("name", sorted(MIXTURE_RUNS))
def test_data_mixture_pairs_match_one_process(mixture, mixture_references, tmp_path, name):
    flags, reference, rel = MIXTURE_RUNS[name]
    proc = train("", tmp_path, *mixture, *flags, env=COMPILE if "--compile" in flags else None)
    assert_same_losses(proc, mixture_references[reference], rel)
