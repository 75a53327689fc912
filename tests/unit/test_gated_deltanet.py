"""The gated DeltaNet layer (``common/attention/gated_deltanet.py``): the chunked rule equals transformers'
``torch_chunk_gated_delta_rule`` and the recurrent form (fp32, 1e-5) from a given state; document starts restart the
state (each document as if alone); the layer equals transformers' ``Qwen3NextGatedDeltaNet`` and decodes through its
recurrent state as its full forward; the context-parallel path (chunks run from [0 | I], composed) equals the
plain forward, with documents, in one process (cp 1's two chunks) and its gradients too; the shares of a
tensor-parallel split by key heads sum to the layer's output."""

import pytest
import torch

from toolkit.distributed.context_parallel import ContextShard
from toolkit.models.common.attention.gated_deltanet import (
    GatedDeltaNet,
    RecurrentState,
    chunk_gated_delta_rule,
    l2_normalized,
    recurrent_gated_delta_rule,
)

B, T, HK, HV, DK, DV = 2, 75, 2, 4, 8, 6


def inputs(seed=0, T=T):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, HK, DK, generator=g) for _ in range(2))
    v = torch.randn(B, T, HV, DV, generator=g)
    decay = -torch.rand(B, T, HV, generator=g) * 0.5
    beta = torch.rand(B, T, HV, generator=g)
    state = torch.randn(B, HV, DK, DV, generator=g)
    return q, k, v, decay, beta, state


def per_value_head(x):
    return l2_normalized(x).repeat_interleave(HV // HK, dim=2)


def test_chunked_equals_transformers_and_the_recurrent_form():
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, state = inputs()
    theirs, their_state = qn.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    ours, our_state = chunk_gated_delta_rule(per_value_head(q), per_value_head(k), v, g, beta, state)
    step, step_state = recurrent_gated_delta_rule(per_value_head(q), per_value_head(k), v, g, beta, state)
    for a, b in ((ours, theirs), (our_state, their_state), (ours, step), (our_state, step_state)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_document_starts_restart_the_state():
    q, k, v, g, beta, _ = inputs(1)
    q, k = per_value_head(q), per_value_head(k)
    cuts = [0, 20, 64, 70, T]  # a document starting on a chunk's first position (64) included
    starts = torch.zeros(B, T, dtype=torch.bool)
    starts[:, cuts[1:-1]] = True
    ours, _ = chunk_gated_delta_rule(q, k, v, g, beta, starts=starts)
    alone = [recurrent_gated_delta_rule(*(x[:, s:e] for x in (q, k, v, g, beta)))[0] for s, e in zip(cuts, cuts[1:])]
    torch.testing.assert_close(ours, torch.cat(alone, dim=1), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def layers():
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=32,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    theirs = qn.Qwen3NextGatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        theirs.dt_bias.normal_()
        theirs.norm.weight.normal_(1.0, 0.2)
    ours = GatedDeltaNet(32, HK, HV, DK, DV, conv_kernel=4, eps=config.rms_norm_eps)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def hidden(T=T, seed=2):
    return torch.randn(B, T, 32, generator=torch.Generator().manual_seed(seed))


def test_layer_equals_transformers_and_decodes_through_its_state(layers):
    ours, theirs = layers
    x = hidden()
    with torch.no_grad():
        full = ours(x)
        torch.testing.assert_close(full, theirs(x), rtol=1e-5, atol=1e-5)
        cache = RecurrentState()
        steps = [ours(x[:, :5], kv_cache=cache)] + [ours(x[:, t : t + 1], kv_cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, :12], rtol=1e-5, atol=1e-5)
    assert cache.state.shape == (B, HV, DK, DV) and cache.conv.shape == (B, 3, ours.conv_width)


@pytest.mark.parametrize("documents", [False, True])
def test_context_parallel_path_equals_the_plain_forward(layers, documents):
    ours, _ = layers
    T = 40  # two chunks of 20 (cp 1's layout), each longer than the convolution's tail
    x = hidden(T, seed=3).requires_grad_(True)
    starts = doc_ids = None
    if documents:
        doc_ids = torch.tensor([[0] * 7 + [1] * 13 + [2] * 20, [0] * 21 + [1] * 19])  # a start at the chunk boundary
        starts = torch.zeros(B, T, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    plain = ours(x, attn_mask=starts)
    (plain_grad,) = torch.autograd.grad(plain.square().sum(), x)
    shard = ContextShard(T, 1, 0, document_ids=doc_ids)
    sharded = ours(x, context_parallel=shard)
    (sharded_grad,) = torch.autograd.grad(sharded.square().sum(), x)
    torch.testing.assert_close(sharded, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sharded_grad, plain_grad, rtol=1e-4, atol=1e-4)


def tensor_parallel_share(layer: GatedDeltaNet, rank: int, ranks: int) -> GatedDeltaNet:
    """Rank ``rank``'s share of ``layer`` as ``linear_attention_heads`` and the column/row kinds split it: the rows of
    its key-head groups in ``in_proj_qkvz`` and ``in_proj_ba`` (Shard(0)), its value heads' ``A_log`` and ``dt_bias``,
    its convolution channels, the columns of ``out_proj`` (Shard(1)); the gated norm whole."""
    import copy

    share = copy.deepcopy(layer)
    rows = {"in_proj_qkvz.weight": 0, "in_proj_ba.weight": 0, "A_log": 0, "dt_bias": 0, "out_proj.weight": 1}
    with torch.no_grad():
        for name, dim in rows.items():
            module, _, leaf = name.rpartition(".")
            owner = share.get_submodule(module)
            setattr(owner, leaf, torch.nn.Parameter(owner.get_parameter(leaf).chunk(ranks, dim=dim)[rank].clone()))
        taps = share.conv1d.weight[layer.tensor_parallel_channels(rank, ranks)]
        share.conv1d.weight = torch.nn.Parameter(taps.clone())
    return share


def test_tensor_parallel_shares_sum_to_the_layer(layers):
    """Each rank's whole key-head groups, value heads and convolution channels compute its heads' part of the output;
    the row-parallel ``out_proj``'s partial sums add up to the layer's output, a document start included."""
    ours, _ = layers
    x = hidden(T=16, seed=4)
    starts = torch.zeros(B, 16, dtype=torch.bool)
    starts[0, 9] = True
    with torch.no_grad():
        parts = [tensor_parallel_share(ours, rank, 2)(x, attn_mask=starts) for rank in range(2)]
        torch.testing.assert_close(parts[0] + parts[1], ours(x, attn_mask=starts), rtol=1e-5, atol=1e-5)


def test_cuda_without_flash_linear_attention_logs_one_line(caplog, monkeypatch):
    import builtins

    from toolkit.models.common.attention import gated_deltanet

    real_import = builtins.__import__

    def no_fla(name, *args, **kwargs):
        if name.startswith("fla"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fla)
    monkeypatch.setattr(gated_deltanet, "_HINTED", [])
    with caplog.at_level("WARNING", logger=gated_deltanet.__name__):
        assert gated_deltanet.fla_chunk_kernel(torch.device("cpu")) is None
        assert not caplog.records  # the PyTorch form on CPU, no message
        for _ in range(2):
            assert gated_deltanet.fla_chunk_kernel(torch.device("cuda")) is None
    assert [r.getMessage() for r in caplog.records] == [gated_deltanet.FLA_HINT]
    assert "pip install flash-linear-attention" in gated_deltanet.FLA_HINT
