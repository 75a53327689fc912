"""Helpers for tests/integration/test_tensor_parallel.py: a tiny model, fixed batches, one training loop for
every layout, and the spawned workers (gloo on CPU).

The loop does what the trainer does for one update: summed loss, backward under
``loss_context``, gradients multiplied by ``dp_size / total_ntokens`` (FSDP2 averages over the
data-parallel ranks), the global norm from ``toolkit.optim.grad_norm.total_norm``, clipping, step.
"""

from __future__ import annotations

import math
import os
import traceback
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

PAD = 1
VOCAB = 64
SEQ = 16
GLOBAL_BATCH = 4
STEPS = 8
CLIP_NORM = 1.0
LR = 3e-3


def model_cfg(**overrides):
    from toolkit.models.transformer_lm import TransformerLMConfig

    values = dict(
        decoder_layers=2,
        decoder_embed_dim=32,
        decoder_ffn_embed_dim=64,
        decoder_attention_heads=4,
        dropout=0.0,
        max_target_positions=SEQ,
        decoder_learned_pos=True,
    )
    values.update(overrides)
    return TransformerLMConfig(**values)


def arch_defaults_cfg(**overrides):
    """``--arch transformer_lm`` as fairseq defines it (post-norm, no final LayerNorm, sinusoidal positions,
    512-wide input/output embeddings, so project_in_dim/project_out_dim exist); only the sizes are small."""
    from toolkit.models.transformer_lm import transformer_lm

    cfg = model_cfg(decoder_learned_pos=False)
    transformer_lm(cfg)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    return cfg


def build(cfg, seed: int = 7, meta: bool = False):
    from toolkit.models.transformer_lm import TransformerLanguageModel

    if meta:
        with torch.device("meta"):
            return TransformerLanguageModel(cfg, VOCAB, PAD)
    return TransformerLanguageModel(cfg, VOCAB, PAD, seed=seed)


def batches(steps: int = STEPS) -> List[Dict[str, torch.Tensor]]:
    """Fixed global batches, right-padded rows of different lengths (the loss ignores padding)."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        tokens = torch.randint(2, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (GLOBAL_BATCH,), generator=g)
        pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
        tokens = tokens.masked_fill(pad, PAD)
        target = torch.cat([tokens[:, 1:], torch.full((GLOBAL_BATCH, 1), PAD)], dim=1)
        out.append({"tokens": tokens, "target": target})
    return out


def criterion():
    from toolkit.criterions.cross_entropy import CrossEntropyCriterion

    return CrossEntropyCriterion(SimpleNamespace(target_dictionary=SimpleNamespace(pad=lambda: PAD)))


def optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list({id(p): p for p in model.parameters()}.values()), lr=LR, weight_decay=0.01)


def train(
    model,
    dp_rank: int = 0,
    dp_size: int = 1,
    loss_parallel: bool = False,
    steps: int = STEPS,
    autocast: Optional[torch.dtype] = None,
    opt: Optional[torch.optim.Optimizer] = None,
    first: int = 0,
) -> Dict[str, List[float]]:
    """Per-update loss (summed NLL / target tokens) and gradient norm, over the same global batches
    (updates ``first`` to ``first + steps - 1``)."""
    from toolkit.distributed.tensor_parallel import loss_context
    from toolkit.optim.grad_norm import total_norm

    crit = criterion()
    opt = opt or optimizer(model)
    params = [p for group in opt.param_groups for p in group["params"]]
    out: Dict[str, List[float]] = {"loss": [], "gnorm": []}
    for batch in batches(first + steps)[first:]:
        rows = slice(dp_rank * GLOBAL_BATCH // dp_size, (dp_rank + 1) * GLOBAL_BATCH // dp_size)
        tokens, target = batch["tokens"][rows], batch["target"][rows]
        ntokens = int((batch["target"] != PAD).sum())
        amp = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
        with loss_context(loss_parallel):
            with amp:
                loss = crit.compute_loss(model(tokens), target)
            loss.backward()
        loss = loss.detach().double()
        if dp_size > 1:
            dist.all_reduce(loss, group=_dp_group(model))
        grads = [p.grad for p in params if p.grad is not None]
        factor = dp_size / ntokens
        norm = float(total_norm(grads)) * factor
        if norm > CLIP_NORM:
            factor *= CLIP_NORM / (norm + 1e-6)
        torch._foreach_mul_(grads, factor)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["loss"].append(float(loss) / ntokens / math.log(2))
        out["gnorm"].append(norm)
    return out


_DP_GROUP = {}


def _dp_group(model):
    return _DP_GROUP[id(model)]


def full_state(model) -> Dict[str, torch.Tensor]:
    """The consolidated (plain, full) state dict: what the default checkpoint file holds."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


# --- building a (dp, mp) model the way parallelize will ----------------------------------------


def layout(world_size: int, tp: int, strategy: str = "full_shard"):
    """The run's ParallelDims for ``world_size`` ranks with ``tp`` tensor-parallel ones (FSDP2 ``strategy``)."""
    from toolkit.distributed.parallel_dims import ParallelDims, parallel_shape

    return ParallelDims(parallel_shape(world_size, "fully_sharded", strategy, tp=tp), dist.get_rank())


def parallel_model(
    cfg,
    dims,
    fsdp: bool,
    checkpoint_activations: bool = False,
    seed: int = 7,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    mp_dtype=None,
):
    """Meta build -> tensor parallel -> activation checkpointing -> FSDP2 on dp -> to_empty -> init_weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from toolkit.distributed.parallelize import apply_activation_checkpointing
    from toolkit.distributed.tensor_parallel import apply_tensor_parallel
    from toolkit.models.init import init_weights

    model = build(cfg, meta=True)
    apply_tensor_parallel(model, dims.mesh("tp"), sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if checkpoint_activations:
        apply_activation_checkpointing(model)
    if fsdp:
        dp = dims.mesh("dp_replicate", "dp_shard", "cp")
        policy = (
            MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32)
            if mp_dtype
            else MixedPrecisionPolicy()
        )
        for block in model.layers:
            fully_shard(block, mesh=dp, mp_policy=policy)
        fully_shard(model, mesh=dp, mp_policy=policy)
    model.to_empty(device="cpu")
    init_weights(model, seed)
    _DP_GROUP[id(model)] = dims.group("dp_replicate", "dp_shard", "cp") if fsdp else None
    return model


# --- spawned workers ---------------------------------------------------------------------------


def spawn(fn, world_size: int, out_dir: str, timeout: float = 600) -> None:
    """``fn(rank, world_size, out_dir)`` on ``world_size`` gloo ranks (forked: tests/helpers/ranks.py); rank 0's
    result in ``out_dir/result.pt``, a rank's traceback in ``out_dir/error<rank>.txt``."""
    from tests.helpers import free_port, ranks

    try:
        ranks.spawn(
            _entry, world_size, f"{fn.__module__}:{fn.__name__}", world_size, free_port(), out_dir, timeout=timeout
        )
    finally:
        errors = sorted(f for f in os.listdir(out_dir) if f.startswith("error"))
        if errors:
            raise AssertionError(open(os.path.join(out_dir, errors[0])).read())


def _entry(rank: int, target: str, world_size: int, port: int, out_dir: str) -> None:
    """One rank: gloo up, ``target`` (``module:function``) run, rank 0's result saved, any error written out."""
    import importlib

    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, out_dir)
        if rank == 0:
            torch.save(result, os.path.join(out_dir, "result.pt"))
    except Exception:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def worker_tp2(rank: int, world_size: int, out_dir: str) -> Dict:
    """2 ranks, M=2: untied + sequence parallel; tied + no sequence parallel + sinusoidal positions +
    activation checkpointing; dropout streams."""
    mesh = layout(world_size, 2)
    result = {}
    model = parallel_model(model_cfg(), mesh, fsdp=False)
    result["init_state"] = full_state(model)
    result["sp_untied"] = train(model, loss_parallel=True)
    tied = model_cfg(share_decoder_input_output_embed=True, decoder_learned_pos=False)
    model = parallel_model(tied, mesh, fsdp=False, sequence_parallel=False, checkpoint_activations=True)
    result["tied_no_sp_ac"] = train(model, loss_parallel=True)
    result["arch_defaults"] = train(parallel_model(arch_defaults_cfg(), mesh, fsdp=False), loss_parallel=True)
    tied = arch_defaults_cfg(share_decoder_input_output_embed=True)
    result["arch_defaults_tied_no_sp"] = train(
        parallel_model(tied, mesh, fsdp=False, sequence_parallel=False), loss_parallel=True
    )
    result["dropout"] = dropout_probes(mesh)
    result["short_batch_loss"] = short_batch_loss(parallel_model(model_cfg(), mesh, fsdp=False), True)
    return result


def short_batch_loss(model, loss_parallel: bool = False, length: int = SEQ - 3) -> float:
    """The summed loss of a batch shorter than the model's positions and not a multiple of M."""
    from toolkit.distributed.tensor_parallel import loss_context

    batch = batches(1)[0]
    with torch.no_grad(), loss_context(loss_parallel):
        return float(criterion().compute_loss(model(batch["tokens"][:, :length]), batch["target"][:, :length]))


def _gather(t: torch.Tensor, group) -> List[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def dropout_probes(mesh) -> Dict[str, bool]:
    """What the TP ranks draw: the replicated embedding output (after its dropout) and a draw inside a
    block (a sharded region); and whether activation checkpointing recomputes the same masks."""
    cfg = model_cfg(dropout=0.3, attention_dropout=0.2, activation_dropout=0.2)
    model = parallel_model(cfg, mesh, fsdp=False)
    model.train()
    tokens = batches(1)[0]["tokens"]
    probes: Dict[str, torch.Tensor] = {}
    model.layers[0].register_forward_pre_hook(
        lambda _m, args: probes.__setitem__("embedded", args[0].detach().clone()), prepend=True
    )
    model.layers[0].self_attn.register_forward_hook(lambda *_: probes.__setitem__("block_draw", torch.rand(8)))

    def run(seed: int) -> Dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        with torch.no_grad():
            model(tokens)
        return dict(probes)

    first, again, other = run(5), run(5), run(6)
    group = mesh.group("tp")
    embedded = _gather(first["embedded"], group)
    draws = _gather(first["block_draw"], group)
    out = {
        "embedded_same_on_tp_ranks": torch.equal(embedded[0], embedded[1]),
        "embedding_dropout_active": bool((first["embedded"] == 0).any()),
        "block_draws_differ_on_tp_ranks": not torch.equal(draws[0], draws[1]),
        "same_seed_same_draws": all(torch.equal(first[k], again[k]) for k in first),
        "other_seed_other_draws": not torch.equal(first["block_draw"], other["block_draw"]),
    }
    out["checkpointing_recomputes_same_masks"] = _checkpointing_same_gradients(cfg, mesh, tokens)
    return out


def _checkpointing_same_gradients(cfg, mesh, tokens) -> bool:
    from toolkit.distributed.tensor_parallel import loss_context

    grads = []
    for ac in (False, True):
        model = parallel_model(cfg, mesh, fsdp=False, checkpoint_activations=ac)
        model.train()
        torch.manual_seed(5)
        with loss_context(True):
            loss = criterion().compute_loss(model(tokens), batches(1)[0]["target"])
            loss.backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads))


def worker_2x2(rank: int, world_size: int, out_dir: str) -> Dict:
    """4 ranks as (dp 2 x mp 2) under FSDP2: fp32, then with activation checkpointing and fp16
    compute (FSDP2's mixed-precision policy); a DCP checkpoint (model and optimizer) saved at (2 x 2) is
    loaded at (1 x 4), which trains on."""
    mesh = layout(world_size, 2)
    dp_rank, dp_size = mesh.data_rank, mesh.data_world
    result = {"dp": (dp_rank, dp_size)}
    model = parallel_model(model_cfg(), mesh, fsdp=True)
    result["init_state"] = full_state(model)
    opt = optimizer(model)
    result["fsdp"] = train(model, dp_rank, dp_size, loss_parallel=True, opt=opt)
    result["trained_state"] = full_state(model)
    save_checkpoint(model, opt, os.path.join(out_dir, "dcp"))

    model = parallel_model(model_cfg(), mesh, fsdp=True, checkpoint_activations=True, mp_dtype=torch.float16)
    result["fsdp_ac_fp16"] = train(model, dp_rank, dp_size, loss_parallel=True)

    # no_shard's (replicate, shard) data-parallel mesh (W/M, 1) x mp: DDP-like replication with TP
    mesh3 = layout(world_size, 2, "no_shard")
    model = parallel_model(model_cfg(), mesh3, fsdp=True)
    result["replicate"] = train(model, mesh3.data_rank, mesh3.data_world, loss_parallel=True, steps=4)

    result["consolidated_loads"] = consolidated_loads_into(parallel_model(model_cfg(), mesh, fsdp=True, seed=99))

    mesh4 = layout(world_size, 4)
    model = parallel_model(model_cfg(), mesh4, fsdp=False, seed=99)  # other values, overwritten by the load
    opt = load_checkpoint(model, os.path.join(out_dir, "dcp"))
    result["loaded_1x4"] = full_state(model)
    result["resumed_1x4"] = train(model, loss_parallel=True, opt=opt, first=STEPS, steps=RESUMED_STEPS)
    return result


RESUMED_STEPS = 2


def consolidated_loads_into(model) -> bool:
    """A plain (consolidated) state dict loads into a sharded model: each rank keeps its part."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    plain = build(model_cfg(), seed=7).state_dict()
    # set_model_state_dict replaces the values of the dict it is given: hand it a copy
    set_model_state_dict(model, dict(plain), options=StateDictOptions(full_state_dict=True))
    loaded = full_state(model)
    return list(loaded) == list(plain) and all(torch.equal(loaded[k], plain[k]) for k in plain)


def save_checkpoint(model, opt, path: str) -> None:
    """Model and optimizer state as DCP shards (each rank writes what it holds)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)


def load_checkpoint(model, path: str) -> torch.optim.Optimizer:
    """Into any layout (or one plain process): model state, and an optimizer with the saved state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opt = optimizer(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return opt
