"""Context and expert parallelism with each feature that changes how the forward and backward compute, what data
they see or what the step keeps (docs/composition.md's CP and EP rows), against one process.

Every case trains the MoE family (``moe_tiny_sigmoid`` with the balance and z losses on) with
``--context-parallel-size 2`` and ``--expert-parallel-size 2`` carved from the same ranks: each rank holds a chunk of
every sequence (keys and values gathered from the other) and half of each layer's experts (tokens exchanged with
the other), so one run puts both exchanges under the features of its case. Two ranks are one data-parallel replica:
they and the one process both take ``--update-freq 2``. The HSDP case is four ranks, two replicas (``--update-freq
1``) of a cp pair that FSDP2 shards over. The one process runs the same features but neither activation
checkpointing nor CPU offload (compared with none), in the same precision.

Features that compose share a case (and so a run and a reference): the document mask with Muon, EMA with HSDP and
the data mixture; LoRA (adapters on the blocks' Linear layers, the rest frozen) with the data mixture on a cp pair,
and alone on an ep pair (two replicas: --update-freq 1 against the one process's 2), its weights compared as EMA's on
the cp pair. On the ep pair the losses only: lora_A's gradient is 0 at the first update (lora_B starts at 0) and
tiny at the second, where Adam's normalized step turns the exchange's summation order into whole steps of a few
elements (10 of 256 by 3e-3), as Muon's step does. Logged losses (3 decimals) of 2 updates: fp32 1e-3 relative, fp16 1e-2, bf16 and float8 2e-2
(test_composition's bounds), plus one unit in the last logged place. With ``--store-ema`` the saved moving averages
(decay 0.5, so not the last weights: checked) and the weights are compared too, rtol 1e-3 / atol 1e-4
(test_ema_sharded's bound). The Muon case compares losses only: its orthogonalized step magnifies the layouts'
rounding to a few 1e-3 of weight (test_muon_pairs keeps its weight comparisons to fp32 FSDP2 runs for the same
reason).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.mixture import MIXTURE, data_and_flags, make_sources, mixture_flags

UPDATES = 2
ARCH = ["--arch", "moe_tiny_sigmoid", "--moe-aux-loss-coef", "0.01", "--moe-z-loss-coef", "0.001"]
CP_EP = ["--context-parallel-size", "2", "--expert-parallel-size", "2"]
TWO = ["--distributed-world-size", "2", *CP_EP]
FSDP2 = ["--ddp-backend", "fully_sharded"]
HSDP = [  # 4 ranks: 2 replicas (dp_replicate) of a cp pair that FSDP2 shards over, the experts over that pair
    "--distributed-world-size",
    "4",
    *CP_EP,
    *FSDP2,
    "--sharding-strategy",
    "hybrid_shard",
    "--shard-group-size",
    "1",
]
MUON = ["--optimizer", "muon", "--lr", "0.05", "--muon-adamw-lr", "0.01", "--weight-decay", "0.01"]  # test_muon's
EMA = ["--store-ema", "--ema-decay", "0.5"]
DOCUMENTS = ["--document-attention-mask", "--reset-position-ids", "--sample-break-mode", "none"]
FP16_TOL, BF16_TOL = 1e-2, 2e-2
# name: (the features, on the ranks and the one process; the ranks' layout and what only they add; tolerance).
# toolkit/config/composition.py names these cases for the pairs they test.
CASES = {
    "fp8_bf16_ac": (["--fp8", "--bf16"], TWO + ["--checkpoint-activations"], BF16_TOL),
    "fp16": (["--fp16"], TWO, FP16_TOL),
    "mefp16": (["--memory-efficient-fp16"], TWO, FP16_TOL),
    "mask_muon": (DOCUMENTS + MUON, TWO, 1e-3),
    "offload_overlap": (["--optimizer", "cpu_adam"], TWO + FSDP2 + ["--cpu-offload", "--overlap-offload-step"], 1e-3),
    "hsdp_mixture_ema": ([MIXTURE, *EMA], HSDP, 1e-3),
    "lora_ep": (["--lora-rank", "4"], ["--distributed-world-size", "2", "--expert-parallel-size", "2", *FSDP2], 1e-3),
    "lora_cp_mixture": (
        ["--lora-rank", "4", MIXTURE],
        ["--distributed-world-size", "2", "--context-parallel-size", "2"],
        1e-3,
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("model_split_pairs")
    bin_dir, mixture = H.make_lm_data_bin(str(root / "bin")), mixture_flags(make_sources(root / "mixture"))
    return {"bin": bin_dir, MIXTURE: mixture, "root": root, "one": {}}


def train(runs, save_dir, *flags):
    data_bin, expanded = data_and_flags(runs["bin"], flags, runs[MIXTURE])
    args = H.llama_args(save_dir)
    args[args.index("--arch") : args.index("--arch") + 2] = ARCH
    proc = H.run_train([data_bin, *args, "--disable-validation", "--max-update", str(UPDATES), *expanded], timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def one_process(runs, shared):
    """The one-process run of these features with the two ranks' batches per update, trained once per module."""
    key = " ".join(shared)
    if key not in runs["one"]:
        save_dir = runs["root"] / f"one{len(runs['one'])}"
        runs["one"][key] = (train(runs, save_dir, *shared, "--update-freq", "2"), save_dir)
    return runs["one"][key]


def saved(save_dir):
    ckpt = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    return ckpt["model"], ckpt["extra_state"].get("ema")


def assert_close_states(got, want, what):
    assert got.keys() == want.keys(), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-3, atol=1e-4, msg=lambda m, k=k: f"{what}: {k}: {m}")


def context_parallel_size(ranks) -> int:
    return int(ranks[ranks.index("--context-parallel-size") + 1]) if "--context-parallel-size" in ranks else 1


@pytest.mark.parametrize("case", list(CASES))
def test_context_and_expert_parallel_with_each_feature_equal_one_process(runs, tmp_path, case):
    shared, ranks, rel = CASES[case]
    one, one_dir = one_process(runs, shared)
    replicas = int(ranks[ranks.index("--distributed-world-size") + 1]) // context_parallel_size(ranks)
    split = train(runs, tmp_path, *shared, *ranks, "--update-freq", str(2 // replicas))
    if "--expert-parallel-size" in ranks:
        assert "expert parallel: 2 MoE layers' experts over 2 ranks" in split.stdout + split.stderr
    got, want = H.losses(split.stdout), H.losses(one.stdout)
    assert sorted(got) == sorted(want) == list(range(1, UPDATES + 1)), (got, want)
    for u in want:
        assert abs(got[u] - want[u]) <= rel * abs(want[u]) + H.LOGGED_TOL, (u, got[u], want[u])
    if "--lora-rank" in shared and "--expert-parallel-size" not in ranks:  # the ep pair: losses (docstring)
        assert_close_states(saved(tmp_path)[0], saved(one_dir)[0], "weights")
    if "--store-ema" in shared:
        (weights, average), (one_weights, one_average) = saved(tmp_path), saved(one_dir)
        assert_close_states(weights, one_weights, "weights")
        assert_close_states(average, one_average, "moving average")
        key = next(k for k in average if k.endswith("self_attn.q_proj.weight"))
        assert not torch.allclose(average[key], weights[key], atol=1e-3), "the average is not the last weights"
