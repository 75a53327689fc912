"""Per-rank memory under tensor parallelism: (dp, mp) layouts of one transformer_lm step (CPU, gloo).

    python -m benchmarks.tensor_parallel [--layouts 2x1,1x2,2x2] [--layers 4] [--embed-dim 1024]
        [--ffn-dim 4096] [--heads 16] [--tokens-per-sample 256] [--batch-size 2] [--vocab 8192]
        [--dropout 0.1] [--no-sequence-parallel] [--json]

Each layout spawns dp x mp processes (gloo). Every rank builds the model as toolkit does
(meta device -> ``apply_tensor_parallel`` on the "tp" mesh when mp > 1 -> FSDP2 ``fully_shard`` on
the data-parallel mesh when dp > 1 -> ``to_empty`` -> ``init_weights``) and runs one update on
its own batch of ``--batch-size`` rows (the same per-rank batch in every layout): forward, the
summed cross-entropy (under ``loss_parallel`` with mp > 1), backward, AdamW step.

Per rank (the largest over the ranks) it reports bytes of:

* parameters: the local parameter tensors (FSDP2 shards, TP shards) between steps;
* gradients: the local gradients after backward (FSDP2: the reduce-scattered shards);
* optimizer: AdamW's state after the step;
* activations: what autograd keeps from the forward for the backward at the end of the forward
  (``saved_tensors_hooks`` over unique storages of the local tensors; parameters, and FSDP2's
  unsharded parameters, excluded): the peak of activation memory in a step.

The default model has a block that is large relative to the batch (C=1024, FFN 4096, 16 heads;
B x T = 2 x 256 per rank), the case where one block no longer fits and tensor parallelism helps.
The table and one JSON line (the last line) are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Dict, List

from benchmarks.timing import Report, add_results_flag


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = _local(t)
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def build(ns, mesh, dp: int, mp: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    from toolkit.distributed.tensor_parallel import apply_tensor_parallel
    from toolkit.models.init import init_weights
    from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

    cfg = TransformerLMConfig(
        decoder_layers=ns.layers,
        decoder_embed_dim=ns.embed_dim,
        decoder_ffn_embed_dim=ns.ffn_dim,
        decoder_attention_heads=ns.heads,
        dropout=ns.dropout,
        max_target_positions=ns.tokens_per_sample,
        decoder_learned_pos=True,
    )
    with torch.device("meta"):
        model = TransformerLanguageModel(cfg, ns.vocab, padding_idx=1)
    if mp > 1:
        apply_tensor_parallel(model, mesh.mesh("tp"), sequence_parallel=not ns.no_sequence_parallel)
    if dp > 1:
        dp_mesh = mesh.mesh("dp_replicate", "dp_shard", "cp")
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    model.to_empty(device="cpu")
    init_weights(model, 1)
    return model


def measure(rank: int, ns, dp: int, mp: int) -> Dict[str, float]:
    """One update on this rank; its memory figures."""
    import torch
    import torch.nn.functional as F

    from toolkit.distributed.parallel_dims import ParallelDims, parallel_shape
    from toolkit.distributed.tensor_parallel import loss_context

    mesh = ParallelDims(parallel_shape(dp * mp, "fully_sharded", tp=mp), rank)
    dp_rank = mesh.data_rank
    model = build(ns, mesh, dp, mp)
    model.train()
    params = list({id(p): p for p in model.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(100 + dp_rank)  # TP ranks of one dp group share the batch
    tokens = torch.randint(4, ns.vocab, (ns.batch_size, ns.tokens_per_sample), generator=g)
    target = torch.randint(4, ns.vocab, (ns.batch_size, ns.tokens_per_sample), generator=g)

    saved: Dict[int, int] = {}

    def pack(t):
        local = _local(t)
        if not (t.is_leaf and t.requires_grad):  # parameters (sharded or FSDP2's unsharded) are not activations
            storage = local.untyped_storage()
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    torch.manual_seed(1)
    with loss_context(mp > 1):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(tokens)
            loss = F.cross_entropy(logits.reshape(-1, ns.vocab).float(), target.reshape(-1), reduction="sum")
        loss.backward()
    grads = _bytes(p.grad for p in params if p.grad is not None)
    opt.step()
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {
        "param_bytes": _bytes(params),
        "grad_bytes": grads,
        "optimizer_bytes": _bytes(state),
        "activation_bytes": sum(saved.values()),
    }


def _entry(rank: int, ns, dp: int, mp: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=dp * mp)
    try:
        figures = measure(rank, ns, dp, mp)
        keys = sorted(figures)
        t = torch.tensor([float(figures[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(dict(zip(keys, t.tolist())), f)
    finally:
        dist.destroy_process_group()


def run_layout(ns, dp: int, mp: int) -> Dict[str, float]:
    import torch.multiprocessing as mp_

    from toolkit.distributed.utils import find_free_port

    out = os.path.join(tempfile.mkdtemp(), "figures.json")
    mp_.start_processes(_entry, args=(ns, dp, mp, find_free_port(), out), nprocs=dp * mp, start_method="spawn")
    with open(out) as f:
        return json.load(f)


def main(argv: List[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="2x1,1x2,2x2", help="comma-separated DPxMP")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embed-dim", type=int, default=1024)
    p.add_argument("--ffn-dim", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--tokens-per-sample", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--no-sequence-parallel", action="store_true")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    add_results_flag(p)
    ns = p.parse_args(argv)
    report = Report("tensor_parallel_memory", argv=argv)

    results = {}
    for layout in ns.layouts.split(","):
        dp, mp = (int(x) for x in layout.split("x"))
        results[layout] = run_layout(ns, dp, mp)
        if not ns.json:
            print(f"measured {layout}", flush=True)
    mb = 2**20
    if not ns.json:
        print(
            f"transformer_lm {ns.layers} layers, C={ns.embed_dim}, FFN={ns.ffn_dim}, H={ns.heads}, V={ns.vocab}; "
            f"per rank B={ns.batch_size} x T={ns.tokens_per_sample}; sequence parallel: "
            f"{not ns.no_sequence_parallel}; per-rank MB (largest rank)"
        )
        print(f"{'dp x mp':<9}{'params':>10}{'grads':>10}{'optimizer':>11}{'activations':>13}")
        for layout, r in results.items():
            print(
                f"{layout:<9}{r['param_bytes'] / mb:>10.1f}{r['grad_bytes'] / mb:>10.1f}"
                f"{r['optimizer_bytes'] / mb:>11.1f}{r['activation_bytes'] / mb:>13.1f}"
            )
    ratios = {}
    for base, tp in (("2x1", "2x2"), ("1x1", "1x2")):
        if base in results and tp in results:
            ratios[f"activations {tp}/{base}"] = results[tp]["activation_bytes"] / results[base]["activation_bytes"]
    if "2x1" in results and "1x2" in results:
        ratios["activations 1x2/2x1"] = results["1x2"]["activation_bytes"] / results["2x1"]["activation_bytes"]
    if not ns.json:
        for name, value in ratios.items():
            print(f"{name}: {value:.3f}")
    shape = {k: v for k, v in vars(ns).items() if k not in ("json", "results")}
    report.emit(results=ns.results, shape=shape, rows=results, activation_ratios=ratios)


if __name__ == "__main__":
    main()
