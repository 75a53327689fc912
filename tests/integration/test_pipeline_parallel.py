"""Pipeline parallelism (``--pipeline-parallel-size``) against one process.

Every schedule on 2 gloo ranks (one forked run: tests/helpers/tp_helpers.spawn), a tiny 4-layer Llama cut into 2
stages (gpipe, 1f1b) or 4 (interleaved_1f1b, zero_bubble, dualpipev: 2 per rank): the summed loss of a batch of 4
rows and every parameter's gradient equal one process's (fp32, rtol 1e-4), each rank holding only its stages'
parameters under their one-process names. Then ``toolkit-train`` (``CASES``), clipped: 2 ranks pp 2 (the default
schedule, 1f1b, ``--update-freq 2``, activation checkpointing), 4 ranks dp 2 x pp 2 (FSDP2 over each stage's 2 data
ranks) and 2 ranks pp 2 in bf16 (interleaved_1f1b) log one process's losses and gradient norms with ``--update-freq
2`` (fp32 1e-3, bf16 2e-2, plus a unit of the last logged place), the norm summed over the stages and the shards.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import dist_helpers as H
from tests.helpers.cli import run_train
from tests.helpers.tp_helpers import spawn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "dualpipev")
UPDATES = 3


def _tiny_llama(device: str = "cpu"):
    from toolkit.models.llama.config import LlamaConfig
    from toolkit.models.llama.model import LlamaLanguageModel

    cfg = LlamaConfig(
        decoder_layers=4,
        decoder_embed_dim=32,
        decoder_attention_heads=4,
        decoder_ffn_embed_dim=64,
        max_target_positions=16,
    )
    with torch.device(device):
        return LlamaLanguageModel(cfg, 37, 1, seed=5)


def worker_every_schedule(rank: int, world_size: int, out_dir: str) -> dict:
    from types import SimpleNamespace

    from toolkit.distributed.parallel_dims import ParallelDims, parallel_shape
    from toolkit.distributed.pipeline import Pipeline, build_pipeline
    from toolkit.models.init import init_weights

    tokens = torch.randint(2, 37, (4, 16), generator=torch.Generator().manual_seed(0))
    target = torch.roll(tokens, -1, dims=1)
    reference = _tiny_llama()
    init_weights(reference, 5)
    loss_fn = lambda logits, t: F.cross_entropy(logits.reshape(-1, 37), t.reshape(-1), reduction="sum")  # noqa: E731
    want_loss = loss_fn(reference(tokens), target)
    want_loss.backward()
    want = {name: p.grad for name, p in reference.named_parameters()}
    dims = ParallelDims(parallel_shape(world_size, pp=2), rank)
    dims.mesh("world")
    held = {}
    for schedule in SCHEDULES:
        model = _tiny_llama("meta")
        cfg = SimpleNamespace(pipeline_schedule=schedule, pipeline_balance=None)
        pipeline = Pipeline(model, build_pipeline(model, cfg, dims), dims, schedule, 0)
        model.to_empty(device="cpu")
        init_weights(model, 5)
        loss = pipeline.step(tokens, target, loss_fn)
        if pipeline.is_last:
            torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-4, msg=schedule)
        names = [name for name, _ in model.named_parameters()]
        assert names and set(names) < set(want), (schedule, names)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=f"{schedule}: {name}")
        everyone = [None] * world_size
        dist.all_gather_object(everyone, sorted(names))
        held[schedule] = everyone
    return held


def test_every_schedule_equals_one_process(tmp_path):
    spawn(worker_every_schedule, 2, str(tmp_path))
    held = torch.load(tmp_path / "result.pt", weights_only=True)
    embed, head = "embed_tokens.weight", "output_projection.weight"
    for schedule, (first, second) in held.items():
        assert not set(first) & set(second), schedule  # each parameter on one rank
        assert embed in first and (head in second) == (schedule != "dualpipev"), schedule  # V: head on rank 0
    assert "layers.3.mlp.up_proj.weight" in held["dualpipev"][0] and "layers.2.mlp.up_proj.weight" in held["1f1b"][1]


def _logged(stdout: str) -> dict:
    """{update: (loss, gnorm)} of the ``train_inner`` lines."""
    out = {}
    for line in stdout.splitlines():
        m = re.search(r"\| train_inner \| (\{.*\})\s*$", line)
        if m:
            stats = json.loads(m.group(1))
            out[int(stats["num_updates"])] = (float(stats["loss"]), float(stats["gnorm"]))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    return {"bin": H.make_lm_data_bin(str(root / "bin")), "root": root}


def _train(runs, name, *flags):
    args = [runs["bin"], *H.llama_args(runs["root"] / name), "--decoder-layers", "4", "--clip-norm", "1.0"]
    proc = run_train(args + ["--max-update", str(UPDATES), "--no-save", "--disable-validation", *flags])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return _logged(proc.stdout)


def _one_process(runs, precision):
    """The one-process reference of a precision (``--update-freq 2``), run once per module."""
    if precision not in runs:
        runs[precision] = _train(runs, f"one_{precision}", "--update-freq", "2", *PRECISION[precision][0])
    return runs[precision]


PRECISION = {"fp32": ([], 1e-3), "bf16": (["--bf16"], 2e-2)}  # flags, relative tolerance
PP2 = ["--distributed-world-size", "2", "--pipeline-parallel-size", "2", "--update-freq", "2"]
CASES = {  # name: (flags of the pipelined run, its precision)
    "pp2": (PP2 + ["--checkpoint-activations"], "fp32"),
    "dp2_pp2_fsdp": (
        ["--distributed-world-size", "4", "--pipeline-parallel-size", "2", "--ddp-backend", "fully_sharded"],
        "fp32",
    ),
    "pp2_bf16": (PP2 + ["--bf16", "--pipeline-schedule", "interleaved_1f1b"], "bf16"),
}


@pytest.mark.parametrize("case", CASES)
def test_pipelined_run_logs_one_process_losses(runs, case):
    flags, precision = CASES[case]
    want, tolerance = _one_process(runs, precision), PRECISION[precision][1]
    got = _train(runs, case, *flags)
    assert sorted(got) == list(range(1, UPDATES + 1)), got
    assert any(norm > 1.0 for _, norm in want.values())  # the clip acts
    for update, (loss, norm) in want.items():
        for value, expected in zip(got[update], (loss, norm)):
            assert abs(value - expected) <= tolerance * abs(expected) + H.LOGGED_TOL, (update, got, want)
