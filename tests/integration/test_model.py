"""transformer_lm: shapes, causality, tying, named architectures, deterministic (meta/sharded) init."""

import os

import torch

from tests.helpers import free_port, ranks
from tests.helpers.models import PAD, VOCAB, tiny_cfg, tiny_model, tokens
from toolkit.models.init import init_weights
from toolkit.models.transformer_lm import TransformerLanguageModel


def test_dropout_only_in_training():
    model = tiny_model(dropout=0.3, attention_dropout=0.2, activation_dropout=0.2)
    x = tokens()
    model.eval()
    torch.testing.assert_close(model(x), model(x), rtol=0, atol=0)
    model.train()
    assert not torch.allclose(model(x), model(x))


def _fsdp_worker(rank: int, world_size: int, port: int, result_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        cfg = tiny_cfg(decoder_learned_pos=True, share_decoder_input_output_embed=True)
        with torch.device("meta"):
            model = TransformerLanguageModel(cfg, VOCAB, PAD)
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        init_weights(model, 7, threads=3)  # the DTensor shards filled from the thread pool
        sharded = all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in model.parameters())
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        reference = TransformerLanguageModel(cfg, VOCAB, PAD, seed=7)
        same = all(torch.equal(full[n], p) for n, p in reference.named_parameters())
        torch.save({"sharded": sharded, "same": same}, os.path.join(result_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_sharded_init_equals_plain_build(tmp_path):
    """FSDP2 on 2 CPU ranks: each rank initializes only its shard, and the gathered values are a plain build's."""
    ranks.spawn(_fsdp_worker, 2, 2, free_port(), str(tmp_path))
    for rank in range(2):
        result = torch.load(tmp_path / f"{rank}.pt", weights_only=True)
        assert result == {"sharded": True, "same": True}, rank
