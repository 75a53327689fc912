"""toolkit-plan: its byte counts against the trainer's own tensors, its CLI, and toolkit-train --plan.

The model-state counts must match the trainer's tensors (exact shapes: within 1%), the saved
activations the trainer's autograd graph within 25% (the issue's bound; they match closer on the
tiny models here). Figures for larger layouts: benchmarks/plan_check.py.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.dist_helpers import make_lm_data_bin

TINY = [
    "--task",
    "language_modeling",
    "--arch",
    "transformer_lm_gpt3_small",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "64",
    "--decoder-ffn-embed-dim",
    "128",
    "--decoder-attention-heads",
    "2",
    "--dropout",
    "0",
    "--lr",
    "0.001",
    "--batch-size",
    "4",
    "--tokens-per-sample",
    "32",
    "--seed",
    "3",
    "--num-workers",
    "0",
    "--cpu",
    "--log-format",
    "none",
    "--no-save",
    "--disable-validation",
]
ITEMS = {
    "params": "parameters (fp32 master)",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations (saved)",
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lm_data_bin(str(tmp_path_factory.mktemp("plan") / "bin"))


def _measure(data: str, flags, out: str, peak: bool = False, base=TINY):
    """The plan beside the trainer's counts (tests/helpers/plan_measure.py), in a process of its own."""
    return run_cli(
        "tests.helpers.plan_measure",
        [json.dumps([data] + base + list(flags)), out] + (["--peak"] if peak else []),
        timeout=300,
    )


def _check(data: str, tmp_path, flags, tolerance=None, base=TINY):
    run = _measure(data, flags, str(tmp_path / "out.json"), base=base)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    items = result["items"]
    for rank in result["ranks"]:
        for key, name in ITEMS.items():
            name = name if name in items else name.split(" (")[0]
            bound = (tolerance or {}).get(key, 0.01)
            assert rank[key] > 0, (key, rank)
            assert abs(items[name] - rank[key]) <= bound * rank[key], (flags, key, items[name], rank[key])
    return result


def test_one_process_adam_and_checkpointing(data, tmp_path):
    plain = _check(data, tmp_path, ["--optimizer", "adam"], {"activations": 0.25})
    ckpt = _check(data, tmp_path, ["--optimizer", "adam", "--checkpoint-activations"], {"activations": 0.25})
    assert ckpt["ranks"][0]["activations"] < plain["ranks"][0]["activations"] / 2


def test_one_process_muon_bf16_momentum(data, tmp_path):
    """--optimizer muon: one bf16 momentum per matrix and AdamW's moments on the rest, not Adam's everywhere."""
    _check(data, tmp_path, ["--optimizer", "muon", "--muon-momentum-dtype", "bf16"], {"activations": 0.25})


def test_one_process_offload_8bit_moments(data, tmp_path):
    _check(
        data,
        tmp_path,
        ["--ddp-backend", "fully_sharded", "--cpu-offload", "--adam-state-precision", "8bit", "--bf16-host-grads"],
        {"activations": 0.25},
    )


def test_two_ranks_full_shard_bf16(data, tmp_path):
    """Two gloo ranks: each holds its shard, the plan says so per rank."""
    result = _check(
        data,
        tmp_path,
        ["--optimizer", "adam", "--ddp-backend", "fully_sharded", "--bf16", "--distributed-world-size", "2"],
        {"activations": 0.25},
    )
    assert len(result["ranks"]) == 2


def _plan_cli(*args: str, timeout: int = 240):
    return run_cli("toolkit_cli.plan", args, timeout=timeout)


GPT3_13_OFFLOAD = [
    "--arch",
    "transformer_lm_gpt3_13",
    "--cpu-offload",
    "--adam-state-precision",
    "8bit",
    "--bf16-host-grads",
    "--gpu-memory",
    "80GiB",
]


def test_13b_offload_on_one_h100_host_memory_decides():
    """Host bytes per parameter 4 + 2 + ~2 (8-bit moments): 13B fits in 126 GiB, not in 96 GiB."""
    fits = _plan_cli(*GPT3_13_OFFLOAD, "--host-memory", "126GiB")
    assert fits.returncode == 0, fits.stderr
    assert "FITS" in fits.stdout and "cpu_adam 8bit" in fits.stdout
    short = _plan_cli(*GPT3_13_OFFLOAD, "--host-memory", "96GiB")
    assert short.returncode == 3, short.stderr
    assert "DOES NOT FIT (host memory)" in short.stdout


def _with_change(base, change):
    """``base`` (flag, value-or-None pairs) with the flags of ``change`` (a command-line fragment) over it."""
    flags = dict(base)
    words = change.split()
    for i, word in enumerate(words):
        if word.startswith("--"):
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None
            flags[word] = value
    return [x for flag, value in flags.items() for x in ([flag] if value is None else [flag, value])]


def test_suggested_layout_makes_it_fit():
    """The fastest layout the verdict names, its flags added to the command, gives a plan that fits."""
    base = [
        ("--arch", "transformer_lm_gpt3_xl"),
        ("--bf16", None),
        ("--batch-size", "64"),
        ("--tokens-per-sample", "2048"),
        ("--gpu", "a100-40"),
        ("--host-memory", "1TiB"),
    ]
    run = _plan_cli(*_with_change(base, ""))
    assert run.returncode == 3, run.stdout + run.stderr
    line = next(x for x in run.stdout.splitlines() if "fastest layout that fits:" in x)
    change = line.split("fastest layout that fits: ")[1]
    fixed = _plan_cli(*_with_change(base, change))
    assert fixed.returncode == 0, (change, fixed.stdout + fixed.stderr)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--gpu-memory", "eighty"], "--gpu-memory 'eighty': expected a size"),
        (["--gpu-tflops", "-1"], "--gpu-tflops: -1: must be greater than 0"),
        (["--gpu-tflops", "nan"], "--gpu-tflops: nan: must be a finite number"),
        (["--compute-efficiency", "5"], "--compute-efficiency: 5: must be in (0, 1]"),
        (["--gpu-memory", "0"], "--gpu-memory 0: must be between 1 byte and 1PiB"),
        (["--gpu-memory", "1e400"], "--gpu-memory 1e400: must be between 1 byte and 1PiB"),
        (
            ["--model-parallel-size", "3", "--distributed-world-size", "8"],
            "--model-parallel-size 3: must divide the world size 8",
        ),
        (["--model-parallel-size", "0"], "--model-parallel-size must be >= 1"),
        (
            ["--arch", "moe_tiny", "--expert-parallel-size", "3", "--distributed-world-size", "3"],
            "--expert-parallel-size 3: each rank keeps an equal share of a layer's 4 experts",
        ),
    ],
)
def test_bad_input_is_one_line(args, needle):
    run = _plan_cli("--arch", "transformer_lm_gpt3_small", *args)
    assert run.returncode == 1
    assert needle in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_train_plan_flag_logs_the_summary(data, tmp_path):
    run = run_cli(
        "toolkit_cli.train",
        [data, *TINY, "--optimizer", "adam", "--max-update", "1", "--plan", "--save-dir", str(tmp_path / "ckpt")],
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [x for x in (run.stdout + run.stderr).splitlines() if "| plan: " in x]
    assert len(lines) == 1 and "FITS" in lines[0], lines
    assert os.path.basename(data) == "bin"


PEAK_2_RANKS = [
    "--optimizer",
    "adam",
    "--ddp-backend",
    "fully_sharded",
    "--distributed-world-size",
    "2",
    "--decoder-layers",
    "4",
    "--decoder-embed-dim",
    "128",
    "--decoder-ffn-embed-dim",
    "512",
    "--tokens-per-sample",
    "128",
    "--checkpoint-activations",
]


def test_two_ranks_checkpointed_update_peak_full_shard_and_shard_grad_op(data, tmp_path):
    """Two gloo ranks, checkpointed: the plan's update peak against each rank's live tensor bytes
    (toolkit.plan.measure.LivePeak) within 25%, the issue's bound (measured -7% to +10% here over runs:
    the ranks' peaks move by about a block with the order of gloo's collectives, too much to compare the
    two strategies' measured peaks at this size); the plan holds every block gathered under shard_grad_op."""
    results = {}
    for strategy in ("full_shard", "shard_grad_op"):
        run = _measure(data, PEAK_2_RANKS + ["--sharding-strategy", strategy], str(tmp_path / "p.json"), True)
        assert run.returncode == 0, run.stderr[-3000:]
        results[strategy] = json.loads(run.stdout.strip().splitlines()[-1])
        for measured in results[strategy]["measured"]:
            predicted = results[strategy]["predicted"]
            assert abs(predicted - measured) <= 0.25 * measured, (strategy, predicted, measured)
    assert results["shard_grad_op"]["predicted"] > results["full_shard"]["predicted"]


def test_tensor_parallel_no_c10d_keeps_whole_tp_shards(data, tmp_path):
    """--model-parallel-size 2 --ddp-backend no_c10d on 4 gloo ranks: no FSDP2, so each rank holds its TP shards of
    every parameter, gradient and moment whole (not 1/2 over the two replicas); the plan counts the same bytes."""
    flags = [
        "--optimizer",
        "adam",
        "--ddp-backend",
        "no_c10d",
        "--model-parallel-size",
        "2",
        "--distributed-world-size",
        "4",
    ]
    result = _check(data, tmp_path, flags, {"activations": 0.25})
    sharded = _check(
        data,
        tmp_path,
        flags[:2] + ["--model-parallel-size", "2", "--distributed-world-size", "4", "--ddp-backend", "fully_sharded"],
        {"activations": 0.25},
    )
    assert result["ranks"][0]["params"] > 1.8 * sharded["ranks"][0]["params"]


def test_expert_parallel_ranks_hold_their_experts_only(data, tmp_path):
    """moe_tiny with --expert-parallel-size 2 under DDP on 2 gloo ranks: each rank keeps 2 of the 4 experts of
    every layer (parameters, gradients, moments) and the whole dense part; the plan counts the same bytes
    (it counted every expert on every rank before)."""
    moe = TINY[: TINY.index("--arch")] + TINY[TINY.index("--lr") :]  # the Llama-shaped family: no --dropout
    _check(
        data,
        tmp_path,
        [
            "--arch",
            "moe_tiny",
            "--optimizer",
            "adam",
            "--ddp-backend",
            "c10d",
            "--expert-parallel-size",
            "2",
            "--distributed-world-size",
            "2",
        ],
        {"activations": 0.25},
        base=moe,
    )
