"""Memory options: activation checkpointing / offloading change no gradient; --cpu-offload with
DeepSpeed CPU Adam, fp16 and activation checkpointing trains on 2 CPU processes and resumes;
``python -m benchmarks.memory`` measures that checkpointing shrinks the saved activations."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from toolkit.distributed.parallelize import parallelize
from toolkit.distributed.utils import DistributedEnv
from toolkit.models.init import canonical_name
from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

VOCAB, T, B = 60, 16, 3


def parallel_args(**kw):
    args = dict(
        ddp_backend="c10d",
        checkpoint_activations=False,
        offload_activations=False,
        cpu_offload=False,
        no_reshard_after_forward=False,
        sharding_strategy="full_shard",
        shard_group_size=0,
        seed=7,
        fp16=False,
        bf16=False,
        memory_efficient_fp16=False,
    )
    args.update(kw)
    from toolkit.config import options
    from toolkit.config import CommonConfig, DistributedConfig

    return options.config_from_args(DistributedConfig, args), options.config_from_args(CommonConfig, args)


def grads_after_one_step(dtype=None, **flags):
    """Build the tiny model through toolkit's parallelize, one forward/backward; {name: full grad}, loss."""
    cfg = TransformerLMConfig(
        decoder_layers=3,
        decoder_embed_dim=32,
        decoder_ffn_embed_dim=64,
        decoder_attention_heads=2,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        max_target_positions=T,
    )
    with torch.device("meta"):
        model = TransformerLanguageModel(cfg, VOCAB, padding_idx=1)
    model, parallel = parallelize(model, *parallel_args(**flags), DistributedEnv())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, VOCAB, (B, T), generator=g)
    target = torch.randint(4, VOCAB, (B, T), generator=g)
    torch.manual_seed(123)  # dropout: checkpointing must replay the same masks in its recomputation
    autocast = (
        torch.autocast("cpu", dtype=dtype)
        if dtype is not None and not parallel.handles_mixed_precision
        else torch.autocast("cpu", enabled=False)
    )
    with parallel.forward_context(), autocast:
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1), reduction="sum")
    (loss * 128.0).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[canonical_name(name)] = grad.detach().clone()
    return grads, float(loss.detach())


def assert_same_grads(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), (name, (a[name] - b[name]).abs().max())


MEMORY_FLAGS = [
    dict(checkpoint_activations=True),
    dict(offload_activations=True),
    dict(checkpoint_activations=True, offload_activations=True),
]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("flags", MEMORY_FLAGS, ids=["checkpoint", "offload", "checkpoint+offload"])
def test_checkpoint_and_offload_activations_give_identical_grads(flags, dtype):
    ref, ref_loss = grads_after_one_step(dtype)
    got, loss = grads_after_one_step(dtype, **flags)
    assert loss == ref_loss
    assert_same_grads(ref, got)
    if flags.get("checkpoint_activations"):
        other, _ = grads_after_one_step(dtype, **dict(flags, seed=8))  # a real comparison: init matters
        assert not torch.equal(other["layers.0.fc1.weight"], ref["layers.0.fc1.weight"])


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    created = False
    if not dist.is_initialized():
        path = tmp_path_factory.mktemp("rdzv") / "store"
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{path}")
        created = True
    yield
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_fully_sharded_checkpoint_and_offload_give_identical_grads(process_group, precision):
    """FSDP2 (one rank) with its mixed-precision policy: checkpoint wrapper applied before fully_shard."""
    mp = dict(fp16=precision == "fp16", bf16=precision == "bf16")
    ref, ref_loss = grads_after_one_step(ddp_backend="fully_sharded", **mp)
    for flags in MEMORY_FLAGS:
        got, loss = grads_after_one_step(ddp_backend="fully_sharded", **mp, **flags)
        assert loss == ref_loss, flags
        assert_same_grads(ref, got)


def test_benchmark_checkpointing_more_than_halves_saved_activations():
    from benchmarks import memory as bench

    shape = dict(layers=12, embed_dim=32, ffn_dim=128, heads=2, tokens=32, batch=2, vocab=64)
    plain = bench.measure(**shape, checkpoint=False)
    ckpt = bench.measure(**shape, checkpoint=True)
    assert ckpt["loss"] == plain["loss"]
    assert ckpt["saved_activation_mb"] < 0.5 * plain["saved_activation_mb"], (plain, ckpt)
