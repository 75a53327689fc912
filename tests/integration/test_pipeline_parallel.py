"""Pipeline parallelism (``--pipeline-parallel-size``) against one process.

Every schedule on 2 gloo ranks (one forked run: tests/helpers/tp_helpers.spawn), a tiny 4-layer Llama cut into 2
stages (gpipe) or 4 (interleaved_1f1b, zero_bubble, dualpipev: 2 per rank): the summed loss of a batch of 4
rows and every parameter's gradient equal one process's (fp32, rtol 1e-4), each rank holding only its stages'
parameters under their one-process names, whose Muon (and its AdamW side), given one process's gradients, takes one
process's steps bitwise. The same for 4-layer MoE and DeepSeek-V3 models (``ROUTED``: 1f1b,
zero_bubble, dualpipev; 1f1b) against one process over the same micro-batches, each router term weighed by its
micro-batch's share of the sample size: the gradients, the logged router terms summed over the stages and each
layer's token counts (what moves the bias); DeepSeek-V3 with one multi-token prediction depth too (on the last stage
with a copy of the embedding, whose gradient is summed with the first stage's; ``mtp_loss`` logged); so too gpt-oss
(its sliding and global layers alternating, split 1 and 3 so a stage counting its layers from 0 would swap their
kinds), GLM-4.5 (the first layer dense) and Qwen3-Next (the last layer full attention, the others gated DeltaNet,
each row 2 documents: a mask for the one, starts for the others); with fp16's loss scale (``SCALED``: the MoE
family's, and fp16 weights), one process's gradients of the scaled losses. Then ``toolkit-train`` (``CASES``),
clipped: 2 ranks pp 2 (the default
schedule, 1f1b, ``--update-freq 2``, activation checkpointing), 4 ranks dp 2 x pp 2 (FSDP2 over each stage's 2 data
ranks), 2 ranks pp 2 in bf16 (interleaved_1f1b), in fp16 from a loss scale that overflows (the same loss scales and
updates skipped as one process: the overflow decided across the stages; 1e-2) and 4 ranks pp 2 x ep 2 of the MoE family (FSDP2 and the experts
over each stage's 2 data ranks; gpipe with one micro-batch a batch, so its routing statistics are one process's
sample's) log one process's losses and gradient norms (and the MoE run its router terms) with ``--update-freq 2``
(fp32 1e-3, bf16 2e-2, plus a unit of the last logged place), the norm summed over the stages and the shards; the
dp 2 x pp 2 run's validation losses too (its data ranks hold 3 and 2 batches, one of 2 rows: padded to theirs).
4 ranks pp 2 x tp 2 (each stage split over its tp ranks, sequence parallel, the head vocabulary-parallel) and pp 2 x
cp 2 (each stage's sequences cut over its cp ranks) log the same, validation included; so do 2 ranks pp 2 and 4 ranks
pp 2 x cp 2 with ``--document-attention-mask --reset-position-ids`` over a ``--data-mixture`` of two sources,
against one process with the three, and 4 ranks dp 2 x pp 2 with ``--optimizer muon --store-ema`` against one process
with both, whose moving average it saves (sharded) and restores (at pp 2); 2 ranks pp 2 with ``--compile``
(aot_eager: each rank compiles its stage's 2 blocks) and ``--fp8`` (8 tokens a sample) log one eager float8
process's losses (2e-2); 2 ranks pp 2 with LoRA (zero_bubble, a layer a stage: the frozen weights take no
gradient) logs one process's LoRA losses, and its save is one process's (names, values, the adapters' optimizer
state). 4 ranks pp 2 under hybrid_shard (each stage's 2 data ranks a (replicate 2, shard 1) mesh) with
``--overlap-offload-step`` (CPU Adam beside the forward, each stage's squares of the norm taken in backward) and 2
ranks pp 2 with the serial ``--cpu-offload`` step log the losses and norms of one process's torch Adam (DeepSpeed's
AdamW is its update up to rounding). Their sharded checkpoints consolidate to one process's file and resume in one
process, and one process's file resumes at pp 2, each continuing as the uninterrupted run.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import dist_helpers as H
from tests.helpers.cli import run_train
from tests.helpers.mixture import MIXTURE, data_and_flags, make_sources, mixture_flags
from tests.helpers.tp_helpers import spawn
from toolkit.distributed.compile import BACKEND_ENV

SCHEDULES = ("gpipe", "interleaved_1f1b", "zero_bubble", "dualpipev")  # 1f1b: the toolkit-train runs below
# the families with routers and their schedules (zero_bubble: the weight gradients apart from the inputs')
ROUTED = [("moe", "1f1b"), ("moe", "zero_bubble"), ("moe", "dualpipev"), ("deepseek_v3", "1f1b")]
# one multi-token prediction depth: on the last stage with a copy of the embedding (V: on rank 0, beside the first)
ROUTED += [("deepseek_v3_mtp", "1f1b"), ("deepseek_v3_mtp", "dualpipev")]
ROUTED += [("gpt_oss", "1f1b"), ("glm4_moe", "1f1b"), ("qwen3_next", "1f1b")]
# gpt-oss's local and global layers alternate: 1 and 3 layers a stage, so the second's layers 1, 2, 3 are of the
# kinds of 0, 1, 2 had it counted them from 0
BALANCE = {"gpt_oss": "1,3"}
# Qwen3-Next packed: its full layers take the documents' mask, its gated DeltaNet ones their starts (state restarts)
PACKED = {"qwen3_next": (torch.arange(16)[None] >= torch.tensor([[3], [6], [9], [12]])).long()}
UPDATES = 3
# Muon's groups on a rank's stages: layers 0 and 2 beside the embedding, 1 and 3 beside the head (interleaved); the
# embedding and the head on one rank, the other holding only blocks (dualpipev)
MUON_SCHEDULES = ("interleaved_1f1b", "dualpipev")
FAMILY_OPTIONS = {  # beside 4 layers: gpt-oss's alternate; GLM-4.5's first is dense, Qwen3-Next's last full attention
    "gpt_oss": dict(layer_types=",".join(["sliding_attention", "full_attention"] * 2), moe_bias_update_rate=0.0),
    "glm4_moe": {},
    "qwen3_next": {},
}


def _tiny_model(family: str, device: str = "cpu"):
    """A 4-layer Llama, MoE or DeepSeek-V3 (its first layer dense, so the stages hold 1 and 2 MoE layers) model,
    the routers' terms weighing enough to move the gradients (load balance, z-loss, DeepSeek's sequence-wise
    balance: 0.1 each), the bias moving by the token counts."""
    from toolkit import models
    from toolkit.core import registry
    from toolkit.models.deepseek_v3.model import DeepSeekV3LanguageModel
    from toolkit.models.llama.config import LlamaConfig
    from toolkit.models.llama.model import LlamaLanguageModel
    from toolkit.models.moe.config import MoEConfig
    from toolkit.models.moe.model import MoELanguageModel

    shape = dict(decoder_layers=4, decoder_embed_dim=32, decoder_attention_heads=4, max_target_positions=16)
    router = dict(moe_aux_loss_coef=0.1, moe_z_loss_coef=0.1, moe_bias_update_rate=0.01)
    if family == "moe":
        cfg, cls = MoEConfig(**shape, moe_ffn_embed_dim=16, **router), MoELanguageModel
    elif family.startswith("deepseek_v3"):
        options = dict(decoder_layers=4, max_target_positions=16, moe_seq_aux_loss_coef=0.1, **router)
        options.update(dict(mtp_depth=1, mtp_loss_coef=0.3) if family == "deepseek_v3_mtp" else {})
        cfg, cls = models.model_config("deepseek_v3_tiny", **options), DeepSeekV3LanguageModel
    elif family in FAMILY_OPTIONS:  # gpt-oss (sinks, a window of 4 every other layer), GLM-4.5, Qwen3-Next
        options = dict(decoder_layers=4, max_target_positions=16, **{**router, **FAMILY_OPTIONS[family]})
        cfg, cls = models.model_config(f"{family}_tiny", **options), registry.resolve_arch(f"{family}_tiny").cls
    else:
        cfg, cls = LlamaConfig(**shape, decoder_ffn_embed_dim=64), LlamaLanguageModel
    with torch.device(device):
        return cls(cfg, 37, 1, seed=5)


def _one_process_batch(
    family: str,
    tokens,
    target,
    loss_fn,
    microbatches: int,
    sample_size: float,
    scale: float = 1.0,
    dtype=None,
    documents=None,
):
    """One process's gradients, summed loss and logged router terms over the pipeline's micro-batches (each router
    term weighed by the micro-batch's share of ``sample_size``, as the trainer weighs a sample's), and its MoE
    layers' token counts; each micro-batch's loss times ``scale`` before its backward (fp16's loss scale), the
    model's weights cast to ``dtype`` (``--memory-efficient-fp16``'s fp16 weights); ``documents``: the rows'
    document ids."""
    from toolkit.models.init import init_weights
    from toolkit.models.outputs import aux_losses_of, metrics_of

    reference = _tiny_model(family)
    init_weights(reference, 5)
    reference.to(dtype or torch.float32)
    total, logged, share = 0.0, {}, sample_size / microbatches
    documents = [None] * microbatches if documents is None else documents.chunk(microbatches)
    for rows, targets, document_ids in zip(tokens.chunk(microbatches), target.chunk(microbatches), documents):
        extra = {"target": targets} if family == "deepseek_v3_mtp" else {}
        out = reference(rows, document_ids=document_ids, **extra)
        loss = loss_fn(out[0] if isinstance(out, tuple) else out, targets)
        total = total + loss.detach()
        for name, (value, coefficient) in aux_losses_of(out).items():
            loss = loss + coefficient * value * share
            logged[name] = logged.get(name, 0.0) + float(value.detach()) * share
        for name, value in metrics_of(out).items():
            logged[name] = logged.get(name, 0.0) + float(value) * share
        (loss * scale).backward()
    counts = {m.name: m.tokens_per_expert.clone() for m in reference.modules() if hasattr(m, "tokens_per_expert")}
    return {name: p.grad for name, p in reference.named_parameters()}, total, logged, counts


def worker_every_schedule(rank: int, world_size: int, out_dir: str) -> dict:
    from types import SimpleNamespace

    from toolkit.distributed.parallel_dims import ParallelDims, parallel_shape
    from toolkit.distributed.pipeline import Pipeline, build_pipeline, default_microbatches
    from toolkit.models.init import init_weights

    tokens = torch.randint(2, 37, (4, 16), generator=torch.Generator().manual_seed(0))
    target = torch.roll(tokens, -1, dims=1)
    loss_fn = lambda logits, t: F.cross_entropy(logits.reshape(-1, 37), t.reshape(-1), reduction="sum")  # noqa: E731
    dims = ParallelDims(parallel_shape(world_size, pp=2), rank)
    dims.mesh("world")
    held = {}
    for family, schedule in [("llama", s) for s in SCHEDULES] + ROUTED:
        M = default_microbatches(2, schedule)
        packed = {"document_ids": PACKED[family]} if family in PACKED else {}
        reference = _one_process_batch(family, tokens, target, loss_fn, M, 64.0, documents=PACKED.get(family))
        want, want_loss, want_logged, want_counts = reference
        model = _tiny_model(family, "meta")
        cfg = SimpleNamespace(pipeline_schedule=schedule, pipeline_balance=BALANCE.get(family))
        pipeline = Pipeline(model, build_pipeline(model, cfg, dims), dims, schedule, 0)
        model.to_empty(device="cpu")
        init_weights(model, 5)
        loss = pipeline.step(tokens, target, loss_fn, pad=1, sample_size=64.0, **packed)
        pipeline.sum_shared_gradients()
        if pipeline.is_last:
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4, msg=schedule)
        names = [name for name, _ in model.named_parameters()]
        assert names and set(names) < set(want), (schedule, names)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=f"{family} {schedule}: {name}")
        for m in model.modules():
            if hasattr(m, "tokens_per_expert"):
                torch.testing.assert_close(m.tokens_per_expert, want_counts[m.name], msg=f"{schedule}: {m.name}")
        logged = pipeline.from_every_stage({**pipeline.router_logged(), **pipeline.prediction_logged()})
        assert logged.keys() == want_logged.keys() and (family == "llama") == (not logged), (logged, want_logged)
        for name, value in logged.items():
            assert value == pytest.approx(want_logged[name], rel=1e-5), (family, schedule, name)
        evaluated = pipeline.evaluate(tokens, target, loss_fn, pad=1, **packed)  # forward only, the weights unchanged
        if pipeline.is_last:
            torch.testing.assert_close(evaluated, want_loss, rtol=1e-5, atol=1e-4, msg=f"{schedule} evaluate")
        everyone = [None] * world_size
        dist.all_gather_object(everyone, sorted(names))
        held[f"{schedule}{'' if family == 'llama' else '_' + family}"] = everyone
        if family == "llama" and schedule in MUON_SCHEDULES:
            _muon_steps_as_one_process(model, want)
    for family, schedule, dtype in SCALED:
        _scaled_step_equals_one_process(dims, family, schedule, dtype, tokens, target)
    return held


def _muon_steps_as_one_process(stage, grads) -> None:
    """``--optimizer muon`` on a rank's stages (the groups of the roles they hold: their matrices; the embedding, the
    head, the norms on AdamW's side), given one process's gradients, takes one process's two steps (momentum, Adam's
    moments, decay) on those parameters bitwise: nothing in the update counts the whole model (each matrix's learning
    rate is adjusted by its own shape), so a pipelined Muon run's weights differ from one process's only by what its
    gradients' rounding becomes through Newton-Schulz (test_pipelined_moving_average_is_one_process_average)."""
    from toolkit.models.init import init_weights
    from toolkit.optim.muon import Muon
    from toolkit.optim.param_groups import parameter_groups

    whole = _tiny_model("llama")
    init_weights(whole, 5)
    optimizers = []
    for model in (whole, stage):
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        groups = parameter_groups(model, True, False, "--optimizer muon")
        optimizers.append(Muon(groups, 0.02, adamw_lr_ratio=0.15, weight_decay=0.1))
    for _ in range(2):
        for optimizer in optimizers:
            optimizer.step()
    want = dict(whole.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, want[name]), name


# fp16's loss scale through the schedule: the MoE routers' terms too (fp32), and --memory-efficient-fp16's fp16
# weights (the hidden states between the stages fp16)
SCALED = [("moe", "1f1b", torch.float32), ("llama", "interleaved_1f1b", torch.float16)]


def _scaled_step_equals_one_process(dims, family: str, schedule: str, dtype, tokens, target) -> None:
    """A step with a loss scale (2**10): each micro-batch's loss scaled before the schedule's backward, so every
    stage's gradients are one process's of the scaled losses (the routers' terms scaled too); the summed loss
    returned unscaled."""
    from types import SimpleNamespace

    from toolkit.distributed.pipeline import Pipeline, build_pipeline, default_microbatches
    from toolkit.models.init import init_weights

    def loss_fn(logits, t):  # in fp32, as the criterion takes fp16 logits
        return F.cross_entropy(logits.float().reshape(-1, 37), t.reshape(-1), reduction="sum")

    scale, microbatches = 2.0**10, default_microbatches(2, schedule)
    want, want_loss, _, _ = _one_process_batch(family, tokens, target, loss_fn, microbatches, 64.0, scale, dtype)
    model = _tiny_model(family, "meta")
    cfg = SimpleNamespace(pipeline_schedule=schedule, pipeline_balance=None)
    pipeline = Pipeline(model, build_pipeline(model, cfg, dims), dims, schedule, 0)
    model.to_empty(device="cpu")
    init_weights(model, 5)
    model.to(dtype)
    loss = pipeline.step(tokens, target, loss_fn, pad=1, sample_size=64.0, loss_scale=scale)
    if pipeline.is_last:
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4, msg=schedule)
    tolerance = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=scale * 1e-4)
    for name, p in model.named_parameters():
        assert p.grad.dtype == dtype, name
        torch.testing.assert_close(p.grad, want[name], **tolerance, msg=f"{family} {schedule} x{scale}: {name}")


def test_every_schedule_equals_one_process(tmp_path):
    spawn(worker_every_schedule, 2, str(tmp_path))
    held = torch.load(tmp_path / "result.pt", weights_only=True)
    embed, head = "embed_tokens.weight", "output_projection.weight"
    for schedule, (first, second) in held.items():
        shared = {embed} if schedule == "1f1b_deepseek_v3_mtp" else set()  # the depths' copy on the last stage
        assert set(first) & set(second) == shared, schedule  # each other parameter on one rank
        assert embed in first and (head in second) == (not schedule.startswith("dualpipev")), schedule  # V: rank 0
    assert "layers.3.mlp.up_proj.weight" in held["dualpipev"][0] and "layers.2.mlp.up_proj.weight" in held["gpipe"][1]


def _logged(stdout: str) -> dict:
    """{update: (loss, gnorm, the MoE routers' logged terms by name, under fp16 the loss scale and the updates skipped
    so far)} of the ``train_inner`` lines; ``"valid"``: the validation losses logged."""
    out, skipped = {}, 0
    for line in stdout.splitlines():
        m = re.search(r"\| (train_inner|valid) \| (\{.*\})\s*$", line)
        skipped += "NOTE: gradient overflow detected, ignoring gradient" in line
        if m and m.group(1) == "valid":
            out.setdefault("valid", []).append(float(json.loads(m.group(2))["valid_loss"]))
        elif m:
            stats = json.loads(m.group(2))
            router = [float(stats[k]) for k in sorted(stats) if k.startswith("moe_")]
            scaler = [float(stats["loss_scale"]), skipped] if "loss_scale" in stats else []
            out[int(stats["num_updates"])] = (float(stats["loss"]), float(stats["gnorm"]), *router, *scaler)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    return {"bin": H.make_lm_data_bin(str(root / "bin")), "root": root}


def _train(runs, name, *flags, updates=UPDATES):
    if "--fp8" in flags:
        pytest.importorskip("torchao.float8", reason="--fp8 needs torchao (pip install torchao)")
    if MIXTURE in flags and "mixture" not in runs:  # the two sources of --data-mixture, written once per module
        runs["mixture"] = mixture_flags(make_sources(runs["root"] / "sources"))
    data, flags = data_and_flags(runs["bin"], flags, runs.get("mixture", []))
    env = {BACKEND_ENV: "aot_eager"} if "--compile" in flags else None  # dynamo's capture, not inductor's codegen
    args = [data, *H.llama_args(runs["root"] / name), "--decoder-layers", "4", "--clip-norm", "1.0"]
    proc = run_train(args + ["--max-update", str(updates), "--save-interval-updates", "2", *flags], env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    pipelined = "--pipeline-parallel-size" in flags  # a stage: 2 of the 4 blocks
    for flag, applied in (
        ("--compile", f"(aot_eager, fullgraph) on each of the {2 if pipelined else 4} blocks"),
        ("--fp8", f"{14 if pipelined else 28} Linear layers of the blocks train in float8"),
    ):
        assert flag not in flags or applied in proc.stdout, (flag, proc.stdout[-3000:])
    return _logged(proc.stdout)


def _assert_close(got, want, tolerance, updates):
    assert sorted(k for k in got if k != "valid") == list(updates), got
    for update in updates:
        assert len(got[update]) == len(want[update]), (update, got, want)
        for value, expected in zip(got[update], want[update]):
            assert abs(value - expected) <= tolerance * abs(expected) + H.LOGGED_TOL, (update, got, want)


def _one_process(runs, precision):
    """The one-process reference of a precision (``--update-freq 2``), run once per module."""
    if precision not in runs:
        quiet = QUIET if precision not in ("fp32", "mask_mixture") else []
        runs[precision] = _train(runs, f"one_{precision}", "--update-freq", "2", *PRECISION[precision][0], *quiet)
    return runs[precision]


# the MoE family, 4 layers (2 a stage), its routers' terms weighing enough to move the gradients, the bias moving
MOE = [
    "--arch",
    "moe_tiny",
    "--moe-aux-loss-coef",
    "0.1",
    "--moe-z-loss-coef",
    "0.01",
    "--moe-bias-update-rate",
    "0.01",
]
# float8: 8 tokens a sample (CPU emulates the float8 matmuls, slowly); 2e-2, as float8 under TP (the rowwise scales of
# the weights' gradients are taken over a micro-batch's tokens: the pipelined gnorm moved 0.7% from one process's)
FP8 = ["--fp8", "--tokens-per-sample", "8"]
# documents packed back to back, each attending and positioned as if alone, drawn from two weighted sources
MASK_MIXTURE = [MIXTURE, "--document-attention-mask", "--reset-position-ids"]
# fp16 from a loss scale that overflows: updates skipped before update 1, the scale doubled after 2 clean updates,
# then overflowing twice more (one process: 8192 at update 1, 16384 at 2, 4096 at 3)
FP16 = ["--fp16", "--fp16-init-scale", "16384", "--fp16-scale-window", "2"]
# Muon on the blocks' matrices (AdamW on the rest), clipped (its gradients' norm is below 1), and the weights' moving
# average (a copy of update 1's weights, then decay 0.5: the average differs from the weights and moves each update)
MUON_EMA = ["--optimizer", "muon", "--lr", "0.02", "--muon-adamw-lr", "0.003", "--clip-norm", "0.5"]
MUON_EMA += ["--store-ema", "--ema-decay", "0.5", "--ema-start-update", "2"]
# LoRA on every Linear of the blocks, every other weight frozen; alpha 64 so the clip acts on the adapters' norm
LORA = ["--lora-rank", "4", "--lora-alpha", "64"]
PRECISION = {  # the one-process references: flags, relative tolerance
    "fp32": ([], 1e-3),
    "bf16": (["--bf16"], 2e-2),
    "moe": (MOE, 1e-3),
    "mask_mixture": (MASK_MIXTURE, 1e-3),
    "fp16": (FP16, 1e-2),
    "mefp16": (["--memory-efficient-fp16", *FP16[1:]], 1e-2),
    "muon_ema": (MUON_EMA, 1e-3),
    "fp8": (FP8, 2e-2),
    "lora": (LORA, 1e-3),
}
PP2 = ["--distributed-world-size", "2", "--pipeline-parallel-size", "2", "--update-freq", "2"]
QUIET = ["--disable-validation"]
OFFLOAD = ["--cpu-offload", "--optimizer", "cpu_adam"]  # DeepSpeed's AdamW: torch's adam's update up to rounding
CASES = {  # name: (flags of the pipelined run, its precision); the cases without QUIET validate
    "pp2": (PP2 + ["--checkpoint-activations", *QUIET], "fp32"),
    "dp2_pp2_fsdp": (
        ["--distributed-world-size", "4", "--pipeline-parallel-size", "2", "--ddp-backend", "fully_sharded"]
        + ["--use-sharded-state"],
        "fp32",
    ),
    "pp2_interleaved": (PP2 + ["--pipeline-schedule", "interleaved_1f1b", *QUIET], "fp32"),
    "pp2_bf16": (PP2 + ["--bf16", "--pipeline-schedule", "interleaved_1f1b", *QUIET], "bf16"),
    "pp2_fp16": (PP2 + FP16 + QUIET, "fp16"),  # the same loss scales and skipped updates: overflows across stages
    "pp2_mefp16": (PP2 + ["--memory-efficient-fp16", *FP16[1:], *QUIET], "mefp16"),  # fp16 weights, no fp32 copy
    "pp2_tp2": (  # each stage split over its 2 tp ranks, sequence parallel: T/2 positions between the stages
        ["--distributed-world-size", "4", "--pipeline-parallel-size", "2", "--model-parallel-size", "2"]
        + ["--update-freq", "2", "--use-sharded-state"],
        "fp32",
    ),
    "pp2_cp2": (  # each stage's sequences cut over its 2 cp ranks (FSDP2 over them): the chunks between the stages
        ["--distributed-world-size", "4", "--pipeline-parallel-size", "2", "--context-parallel-size", "2"]
        + ["--ddp-backend", "fully_sharded", "--update-freq", "2"],
        "fp32",
    ),
    "pp2_ep2_moe": (  # the routers' terms logged too (moe_aux_loss, moe_z_loss, moe_max_load_<layer>, moe_dropped)
        ["--distributed-world-size", "4", "--pipeline-parallel-size", "2", "--ddp-backend", "fully_sharded"]
        + ["--expert-parallel-size", "2", "--pipeline-schedule", "gpipe", "--pipeline-microbatches", "1", *MOE, *QUIET],
        "moe",
    ),
    "pp2_mask_mixture": (PP2 + MASK_MIXTURE, "mask_mixture"),  # each stage given the micro-batch's documents
    "pp2_cp2_mask_mixture": (  # the documents of the micro-batch's whole rows, the positions of the cp rank's chunks
        ["--distributed-world-size", "4", "--pipeline-parallel-size", "2", "--context-parallel-size", "2"]
        + ["--ddp-backend", "fully_sharded", "--update-freq", "2", *MASK_MIXTURE],
        "mask_mixture",
    ),
    "dp2_pp2_muon_ema": (  # each stage's matrices orthogonalized by owners among its 2 data ranks; its average
        ["--distributed-world-size", "4", "--pipeline-parallel-size", "2", "--ddp-backend", "fully_sharded"]
        + ["--use-sharded-state", *MUON_EMA, *QUIET],
        "muon_ema",
    ),
    "pp2_compile_fp8": (PP2 + ["--compile", *FP8, *QUIET], "fp8"),  # against one eager process in float8
    "pp2_lora": (  # a layer a stage, each stage's adapters beside its frozen weights; their gradients split apart
        PP2 + ["--pipeline-schedule", "zero_bubble", *LORA, *QUIET],
        "lora",
    ),
    "pp2_hsdp_overlap": (  # each stage's 2 data ranks a (replicate 2, shard 1) mesh; CPU Adam beside the forward
        ["--distributed-world-size", "4", "--pipeline-parallel-size", "2", "--ddp-backend", "fully_sharded"]
        + ["--sharding-strategy", "hybrid_shard", "--shard-group-size", "1", "--overlap-offload-step", *OFFLOAD]
        + QUIET,
        "fp32",
    ),
    "pp2_offload": (PP2 + ["--ddp-backend", "fully_sharded", *OFFLOAD, *QUIET], "fp32"),  # the serial CPU Adam step
}
SHARDED = ("dp2_pp2_fsdp", "pp2_tp2")  # the cases saving sharded checkpoints


@pytest.mark.parametrize("case", CASES)
def test_pipelined_run_logs_one_process_losses(runs, case):
    flags, precision = CASES[case]
    want, tolerance = _one_process(runs, precision), PRECISION[precision][1]
    got = _train(runs, case, *flags)
    clip = float(flags[flags.index("--clip-norm") + 1]) if "--clip-norm" in flags else 1.0
    assert any(logged[1] > clip for key, logged in want.items() if key != "valid")  # the clip acts
    if precision == "fp16":  # the loss scale overflowed before update 1 and again before update 3
        assert 0 < want[1][-1] < want[UPDATES][-1], want
    _assert_close(got, want, tolerance, range(1, UPDATES + 1))
    if QUIET[0] not in flags:
        assert len(got["valid"]) == 2 and got["valid"] == pytest.approx(want["valid"], rel=1e-4, abs=H.LOGGED_TOL)


def test_pipelined_lora_save_is_one_process_save(runs):
    """The pp 2 LoRA run's save at update 2 (merged from its 4 stages, 2 a rank) is one process's: the names in its
    order, the values (the frozen weights and the adapters), the optimizer's groups and state (the adapters')."""
    _one_process(runs, "lora")
    if not (runs["root"] / "pp2_lora" / "checkpoint_1_2.pt").exists():
        test_pipelined_run_logs_one_process_losses(runs, "pp2_lora")
    ours, theirs = (
        torch.load(runs["root"] / n / "checkpoint_1_2.pt", weights_only=True) for n in ("pp2_lora", "one_lora")
    )
    assert list(ours["model"]) == list(theirs["model"])
    torch.testing.assert_close(ours["model"], theirs["model"], rtol=1e-4, atol=1e-6)
    ours, theirs = ours["last_optimizer_state"], theirs["last_optimizer_state"]
    assert ours["param_groups"] == theirs["param_groups"] and list(ours["state"]) == list(theirs["state"])
    assert ours["state"] and all(".lora_" in name for name in ours["state"]), list(ours["state"])
    torch.testing.assert_close(ours["state"], theirs["state"], rtol=1e-3, atol=1e-6)


def _resumed(runs, name, checkpoint, *flags):
    """A run resumed from ``checkpoint`` (a ``.pt`` or a DCP folder) at update 2: its logged update 3."""
    target = runs["root"] / name / ("checkpoint_last" + (".pt" if str(checkpoint).endswith(".pt") else ""))
    target.parent.mkdir()
    (shutil.copy if target.suffix else shutil.copytree)(checkpoint, target)
    return _train(runs, name, "--update-freq", "2", *QUIET, *flags)


@pytest.mark.parametrize("case", SHARDED)
def test_pipelined_checkpoints_are_one_process_checkpoints(runs, case):
    """A pipelined run's sharded save at update 2 (dp 2 x pp 2, pp 2 x tp 2) consolidates to one process's file
    (names, parameter groups, values) and resumes in one process (and dp 2 x pp 2's at pp 4); one process's file
    resumes at pp 2: update 3 as the uninterrupted one."""
    from toolkit.checkpoint.sharded import consolidate

    want = _one_process(runs, "fp32")
    if not (runs["root"] / case / "checkpoint_1_2").exists():
        test_pipelined_run_logs_one_process_losses(runs, case)
    reference = torch.load(runs["root"] / "one_fp32" / "checkpoint_1_2.pt", weights_only=True)
    consolidate(str(runs["root"] / case / "checkpoint_1_2"), str(runs["root"] / f"{case}.pt"))
    merged = torch.load(runs["root"] / f"{case}.pt", weights_only=True)
    names = list if case == "dp2_pp2_fsdp" else sorted  # DCP lists tp-replicated tensors last, as for tp alone
    assert names(merged["model"]) == names(reference["model"])
    torch.testing.assert_close(merged["model"], reference["model"], rtol=1e-4, atol=1e-5)
    ours, theirs = merged["last_optimizer_state"], reference["last_optimizer_state"]
    assert ours["param_groups"] == theirs["param_groups"]
    torch.testing.assert_close(ours["state"], theirs["state"], rtol=1e-3, atol=1e-6)
    resumed = [_resumed(runs, f"resume_one_{case}", runs["root"] / case / "checkpoint_1_2")]
    if case == "dp2_pp2_fsdp":  # one process's file at pp 2, and the pipelined save at pp 4 (a layer a stage)
        resumed.append(_resumed(runs, "resume_pp2", runs["root"] / "one_fp32" / "checkpoint_1_2.pt", *PP2[:4]))
        pp4 = ["--distributed-world-size", "4", "--pipeline-parallel-size", "4"]
        resumed.append(_resumed(runs, "resume_pp4", runs["root"] / case / "checkpoint_1_2", *pp4))
    for got in resumed:
        _assert_close(got, want, 1e-3, [UPDATES])


def test_pipelined_moving_average_is_one_process_average(runs):
    """dp 2 x pp 2 with Muon and --store-ema: its sharded save at update 2 consolidates to one process's parameter
    groups (Muon's matrices, AdamW's embeddings, head and norms) and moving average (its names; its values as close as
    the weights are, 2e-3). The weights differ by rounding, not by the optimizer: the stages' gradients are one
    process's to fp32 rounding (the micro-batches' sums: 5e-7 of the largest, 1f1b in-process), and given one process's
    gradients a stage's Muon takes one process's steps bitwise (``_muon_steps_as_one_process``); torch's Newton-Schulz
    casts the update to bf16 and iterates there, where an element rounded the other way moves a whole matrix's small
    singular directions, which the iteration multiplies by up to 3.4445**5. Measured after 2 updates (this case, and 2
    ranks pp 2 without FSDP2 alike): up to 1.5e-3 on an attention output matrix, 8.8e-4 on an embedding row (Adam's
    normalized step on the second update's gradients, taken at weights already apart), 8.2e-4 on the average; with the
    same iteration in fp32 every weight and the average are one process's to 1.5e-7. Resumed at pp 2 (a stage a rank,
    consolidated saves), update 3 logs one process's, and its file holds the restored average moved once: 0.5 x update
    2's average + 0.5 x update 3's weights (a restarted one would hold update 2's weights), to fp32 rounding."""
    from toolkit.checkpoint.sharded import consolidate

    case, root = "dp2_pp2_muon_ema", runs["root"]
    want = _one_process(runs, "muon_ema")
    if not (root / case / "checkpoint_1_2").exists():
        test_pipelined_run_logs_one_process_losses(runs, case)
    consolidate(str(root / case / "checkpoint_1_2"), str(root / f"{case}.pt"))
    saved = torch.load(root / f"{case}.pt", weights_only=True)
    reference = torch.load(root / "one_muon_ema" / "checkpoint_1_2.pt", weights_only=True)
    assert saved["last_optimizer_state"]["param_groups"] == reference["last_optimizer_state"]["param_groups"]
    average = saved["extra_state"]["ema"]
    assert list(average) == list(reference["extra_state"]["ema"]) == list(reference["model"])
    torch.testing.assert_close(average, reference["extra_state"]["ema"], rtol=0, atol=2e-3)
    torch.testing.assert_close(saved["model"], reference["model"], rtol=0, atol=2e-3)
    resumed = _resumed(runs, "resume_muon_ema_pp2", root / case / "checkpoint_1_2", *PP2[:4], *MUON_EMA)
    _assert_close(resumed, want, 1e-3, [UPDATES])
    last = torch.load(root / "resume_muon_ema_pp2" / "checkpoint_last.pt", weights_only=True)
    assert list(last["extra_state"]["ema"]) == list(average)
    moved = {name: 0.5 * average[name] + 0.5 * weight for name, weight in last["model"].items()}
    torch.testing.assert_close(last["extra_state"]["ema"], moved, rtol=1e-6, atol=1e-7)
