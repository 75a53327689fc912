"""``--compile`` (torch.compile per block, toolkit/distributed/compile.py) against eager training.

Each comparison trains the same tiny model (2 layers, dim 32, dropout 0: inductor draws its own
random numbers) on the same batches, eager and compiled, and compares the full-precision losses
of ``UPDATES`` updates (worker: tests/helpers/compile_helpers.py). Tolerances: fp32 1e-5 relative,
bf16 1e-2 and fp16 1e-3 (about one unit of their rounding).

The default backend (inductor, C++ code generation) runs once, on fp32; the other comparisons
use ``TOOLKIT_COMPILE_BACKEND=aot_eager`` (the same dynamo capture and AOTAutograd joint graph,
without code generation), since inductor's compile of each variant would take most of a
minute on two cores. Every compiled run must have captured a graph, so none is eager in disguise.

Checkpoints: a compiled run's state-dict keys are the eager model's (no ``_orig_mod.``), and
``checkpoint_last.pt`` written by one mode resumes in the other.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from tests.helpers import dist_helpers as H
from toolkit.distributed.compile import BACKEND_ENV

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")

TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-3}  # inductor measured 1e-7 / 7e-5 / 1.3e-5
LOGGED_TOL = 1.01e-3  # the CLI logs losses rounded to 3 decimals
AOT = "aot_eager"

SINGLE = [  # [name, flags, backend]; null backend: the default (inductor)
    ["eager", [], None],
    ["compile", ["--compile"], None],
    ["compile_ac", ["--compile", "--checkpoint-activations"], AOT],  # checkpointing alone changes no value
    ["eager_bf16", ["--bf16"], None],
    ["compile_bf16", ["--compile", "--bf16"], AOT],
    ["eager_fp16", ["--fp16"], None],
    ["compile_fp16", ["--compile", "--fp16"], AOT],
]
FSDP_BF16 = ["--ddp-backend", "fully_sharded", "--bf16"]
OFFLOAD = ["--ddp-backend", "fully_sharded", "--cpu-offload", "--checkpoint-activations", "--optimizer", "cpu_adam"]
TWO_RANKS = [
    ["ddp", ["--ddp-backend", "c10d"], None],
    ["compile_ddp", ["--ddp-backend", "c10d", "--compile"], AOT],
    ["fsdp_bf16", FSDP_BF16, None],
    ["compile_fsdp_bf16", FSDP_BF16 + ["--compile"], AOT],
    ["offload", OFFLOAD, None],
    ["compile_offload", OFFLOAD + ["--compile"], AOT],
]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("compile") / "bin"))


def run_worker(data_bin: str, out_dir, world_size: int, configs) -> dict:
    out = str(out_dir / "results.json")
    proc = H.run_cli(
        "tests.helpers.compile_helpers",
        [data_bin, out, str(world_size), json.dumps(configs)],
        env={BACKEND_ENV: ""},
        timeout=400,
    )  # empty: the default backend, whatever the shell set
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def single(data_bin, tmp_path_factory):
    return run_worker(data_bin, tmp_path_factory.mktemp("single"), 1, SINGLE)


@pytest.fixture(scope="module")
def two_ranks(data_bin, tmp_path_factory):
    return run_worker(data_bin, tmp_path_factory.mktemp("two"), 2, TWO_RANKS)


def assert_compiled_matches(results: dict, eager: str, compiled: str, tol: float) -> None:
    ref, got = results[eager], results[compiled]
    assert ref["graphs"] == 0 and got["graphs"] >= 1, (ref["graphs"], got["graphs"])
    assert len(got["losses"]) == len(ref["losses"]) == 3
    for u, (a, b) in enumerate(zip(got["losses"], ref["losses"]), start=1):
        assert abs(a - b) <= tol * abs(b), (compiled, u, a, b)
    assert got["keys"] == ref["keys"]
    assert not any("_orig_mod" in k for k in got["keys"])


@pytest.mark.parametrize(
    "eager,compiled,precision",
    [
        ("eager", "compile", "fp32"),  # inductor
        ("eager", "compile_ac", "fp32"),
        ("eager_bf16", "compile_bf16", "bf16"),
        ("eager_fp16", "compile_fp16", "fp16"),
    ],
)
def test_one_process_compiled_matches_eager(single, eager, compiled, precision):
    assert_compiled_matches(single, eager, compiled, TOL[precision])


@pytest.mark.parametrize(
    "eager,compiled,precision",
    [
        ("ddp", "compile_ddp", "fp32"),
        ("fsdp_bf16", "compile_fsdp_bf16", "bf16"),
        ("offload", "compile_offload", "fp32"),
    ],
)
def test_two_ranks_compiled_matches_eager(two_ranks, eager, compiled, precision):
    assert_compiled_matches(two_ranks, eager, compiled, TOL[precision])


def train(data_bin: str, save_dir, updates: int, *flags: str):
    argv = (
        [data_bin]
        + H.model_args(str(save_dir))
        + ["--max-update", str(updates), "--disable-validation", "--no-epoch-checkpoints", *flags]
    )
    proc = H.run_train(argv, env={BACKEND_ENV: AOT})
    assert proc.returncode == 0, (
        f"toolkit-train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return H.losses(proc.stdout), proc.stdout


def test_checkpoints_move_between_compiled_and_eager_runs(data_bin, tmp_path):
    """Eager to 2 updates, resumed compiled to 5, resumed eager to 6: the losses of an eager run resumed at 2."""
    run, reference = tmp_path / "run", tmp_path / "reference"
    train(data_bin, run, 2)
    shutil.copytree(run, reference)
    expected, _ = train(data_bin, reference, 6)
    compiled, log = train(data_bin, run, 5, "--compile")
    assert "loaded checkpoint" in log and "--compile: torch.compile (aot_eager, fullgraph)" in log
    assert re.search(r"--compile: the first training pass took [\d.]+ s, the second [\d.]+ s", log)
    saved = torch.load(os.path.join(run, "checkpoint_last.pt"), weights_only=True)["model"]
    assert list(saved) == list(torch.load(os.path.join(reference, "checkpoint_last.pt"), weights_only=True)["model"])
    eager, log = train(data_bin, run, 6)
    assert "loaded checkpoint" in log
    assert sorted(compiled) == [3, 4, 5] and sorted(eager) == [6] and sorted(expected) == [3, 4, 5, 6]
    for u, loss in {**compiled, **eager}.items():
        assert abs(loss - expected[u]) <= LOGGED_TOL, (u, loss, expected[u])
