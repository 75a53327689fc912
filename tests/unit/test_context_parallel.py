"""Context parallelism's layout (toolkit.distributed.context_parallel) and its attention (the attention package's
``across_ranks``), in one process.

The C ranks are simulated: each rank's queries are its chunks of the full q, the "gathered" keys are the
full k/v in the layout's order (what the all-gather returns), and the outputs put back in sequence order
must equal one process's attention (causal, within documents crossing chunk boundaries, within a window,
grouped-query, soft-capped), and so must the gradients of q, k, v. The collective itself (and its backward)
is exercised on gloo ranks by tests/integration/test_context_parallel.py.
"""

import pytest
import torch

from toolkit.core.errors import UserError
from toolkit.distributed.context_parallel import (
    ContextShard,
    check_sequence_split,
    chunk_layout,
    gathered_layout,
    pad_to_chunks,
    shard_sample,
)
from toolkit.models.common.attention import (
    Attention,
    LatentAttention,
    attend,
    attend_across_ranks,
    attention_mask,
    visible_keys,
)


def _task(tokens, bos=False, mode="none"):
    from types import SimpleNamespace

    return SimpleNamespace(tokens_per_sample=tokens, add_bos_token=bos, sample_break_mode=mode)


def _model(positions=None):
    from types import SimpleNamespace

    return SimpleNamespace(max_target_positions=positions)


@pytest.mark.parametrize(
    "cp,task,model,refused",
    [
        (2, _task(64), _model(), None),
        (1, _task(63), _model(), None),  # no context parallelism: any length
        (
            2,
            _task(63),
            _model(),
            "each sample is cut into 4 equal chunks (2 x 2 ranks), so its 63 positions must be "
            "a multiple of 4; use --tokens-per-sample 60 or 64",
        ),
        (4, _task(6), _model(), "its 6 positions must be a multiple of 8; use --tokens-per-sample 8"),
        (
            2,
            _task(64, bos=True),
            _model(),
            "its 65 positions (with --add-bos-token's <s>) must be a multiple of 4; use --tokens-per-sample 63 or 67",
        ),
        (2, _task(63), _model(64), None),  # padded to 64: the model has the positions
        (2, _task(63), _model(63), "use --tokens-per-sample 60 or 64 (or raise --max-target-positions 63)"),
        (2, _task(64, mode="eos"), _model(66), "its 66 positions must be a multiple of 4"),  # any length up to 66
    ],
)
def test_samples_must_cut_into_two_chunks_per_rank(cp, task, model, refused):
    """Checked before any rank starts (toolkit-train's resolve and the planner call it): a sample padded past the
    model's positions was an IndexError in every rank's first forward."""
    if refused is None:
        check_sequence_split(cp, task, model)
        return
    with pytest.raises(UserError) as error:
        check_sequence_split(cp, task, model)
    assert str(error.value).startswith(f"--tokens-per-sample {task.tokens_per_sample} with --context-parallel-size")
    assert refused in str(error.value)


def test_layout_is_load_balanced_and_covers_the_sequence():
    assert chunk_layout(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_layout(8, 2, 1).tolist() == [2, 3, 4, 5]
    for C in (1, 2, 3, 4):
        T = 2 * C * 3
        held = [chunk_layout(T, C, r) for r in range(C)]
        assert sorted(torch.cat(held).tolist()) == list(range(T))
        assert torch.equal(gathered_layout(T, C), torch.cat(held))
        # causal work: how many (query, key) pairs each rank scores is the same on every rank
        work = {int(visible_keys(h, torch.arange(T)).sum()) for h in held}
        assert len(work) == 1, (C, work)
    with pytest.raises(ValueError):
        chunk_layout(10, 2, 0)


def _documents(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    starts = (torch.rand(B, T, generator=g) < 0.2).long()
    starts[:, 0] = 0
    return starts.cumsum(1)


class _SimulatedGather(ContextShard):
    """A shard in one process whose 'all-gather' returns the whole sequence's entries in the layout's order."""

    def __init__(self, T, C, r, full_entries, **kw):
        super().__init__(T, C, r, **kw)
        self.full_entries = full_entries

    def gather(self, entries):
        assert [e.shape[2] * self.cp_size for e in entries] == [e.shape[2] for e in self.full_entries]
        return self.full_entries


class _Layer(Attention):
    """The logits' options of one layer, for calling attend_across_ranks on given q/k/v."""

    def __init__(self, window=None, softcap=None):
        super().__init__(8, 1, 1, 8, window=window, softcap=softcap)


MASKS = [(False, None, None), (True, None, None), (False, 5, None), (True, 4, None)]
# soft-capped logits always take the mask inside attend_across_ranks, so their case runs through that door only
CASES = [pytest.param(*m, True, id=f"tiles-{m}") for m in MASKS + [(True, None, 30.0)]] + [
    pytest.param(*m, False, id=f"one_mask-{m}") for m in MASKS
]


@pytest.mark.parametrize("C", [2, 3])
@pytest.mark.parametrize("documents,window,softcap,tiles", CASES)
def test_simulated_ranks_equal_full_attention_and_its_gradients(C, documents, window, softcap, tiles):
    """Both back ends: the CPU tiles merged by log-sum-exp (soft-capped logits take the mask instead), and
    ``attend`` under the [T/C, T] mask (CUDA's)."""
    B, H, G, T, D = 2, 4, 2, 12 * C, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, heads, T, D, generator=g, requires_grad=True) for heads in (H, G, G))
    docs = _documents(B, T) if documents else None
    full = attend(q, k, v, attention_mask(docs, T, window=window), softcap=softcap)
    grad = torch.randn(full.shape, generator=g)
    want = torch.autograd.grad(full, (q, k, v), grad)

    keys = gathered_layout(T, C)
    out = torch.empty_like(full)
    for r in range(C):
        shard = _SimulatedGather(T, C, r, (k[:, :, keys], v[:, :, keys]), document_ids=docs)
        rows = shard.query_index
        if tiles:
            layer = _Layer(window, softcap)
            part = attend_across_ranks(layer, q[:, :, rows], (k[:, :, rows], v[:, :, rows]), shard)
        else:
            part = attend(q[:, :, rows], k[:, :, keys], v[:, :, keys], shard.visibility(window).dense())
        out[:, :, rows] = part
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(out, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_tiles_skip_what_the_mask_hides():
    """Plain causal: a rank's tiles are the diagonal ones (flash's is_causal) and the earlier chunks, unmasked."""
    shard = ContextShard(16, 2, 0)
    tiles = shard.visibility(None).tiles(torch.float32)
    # rank 0 holds chunks 0 and 3; gathered key chunks: 0, 3 (rank 0), 1, 2 (rank 1)
    assert {(b.query, b.key, b.causal, b.mask is None) for b in tiles} == {
        (0, 0, True, True),
        (1, 1, True, True),
        (1, 0, False, True),
        (1, 2, False, True),
        (1, 3, False, True),
    }
    assert [b.causal for b in tiles[:2]] == [True, True]  # the diagonal first: each row's log-sum-exp is finite


LAYERS = {
    "window": lambda: Attention(32, 4, 2, 8, window=6),
    "sinks": lambda: Attention(32, 4, 2, 8, sinks=True),  # the explicit form under the layout's mask
    # gpt-oss's local layer: sinks, a window and biases on every projection
    "sinks_window": lambda: Attention(32, 4, 2, 8, qkv_bias=True, window=6, sinks=True, output_bias=True),
    # its own entries (a latent and a rotary key) travel, not k and v; values narrower than keys, then as wide
    "latent": lambda: LatentAttention(32, 4, kv_rank=6, rope_dim=4, nope_dim=8, v_dim=6, q_rank=12),
    "latent_same_width": lambda: LatentAttention(32, 4, kv_rank=6, rope_dim=4, nope_dim=8, v_dim=12),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_attention_module_gathers_through_the_shard(name):
    """A layer hands its entries to the shard and attends under the shard's view of its window: the rows equal the
    full layer's."""
    torch.manual_seed(0)
    T, C = 16, 2
    layer = LAYERS[name]()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, T, 32)
    D = 4 if name.startswith("latent") else 8
    cos, sin = torch.ones(T, D), torch.zeros(T, D)  # no rotation: positions are the test of the integration
    full = layer(x, cos, sin)
    _, entries, _ = layer.project(x, cos, sin)
    keys = gathered_layout(T, C)
    for r in range(C):
        rows = chunk_layout(T, C, r)
        shard = _SimulatedGather(T, C, r, tuple(e[:, :, keys] for e in entries))
        torch.testing.assert_close(layer(x[:, rows], cos[rows], sin[rows], context_parallel=shard), full[:, rows])


def test_shard_sample_keeps_positions_global_and_counts_each_token_once():
    tokens = torch.arange(1, 11).view(1, 10)  # T 10: padded to 12, a multiple of 2C = 4
    target = tokens + 100
    target[0, -1] = 0  # a padded target (pad 0)
    sample = {
        "net_input": {"src_tokens": tokens, "document_ids": torch.tensor([[0] * 5 + [1] * 5])},
        "target": target,
        "ntokens": 9,
        "nsentences": 1,
    }
    padded = pad_to_chunks(sample, 2, pad=0)
    assert padded["net_input"]["src_tokens"].tolist() == [list(range(1, 11)) + [0, 0]]
    parts = [shard_sample(sample, 2, r, None, pad=0) for r in range(2)]
    assert [p["net_input"]["positions"].tolist() for p in parts] == [[[0, 1, 2, 9, 10, 11]], [[3, 4, 5, 6, 7, 8]]]
    assert [p["net_input"]["src_tokens"].tolist() for p in parts] == [[[1, 2, 3, 10, 0, 0]], [[4, 5, 6, 7, 8, 9]]]
    assert sum(p["ntokens"] for p in parts) == 9 and [p["nsentences"] for p in parts] == [1, 0]
    assert all("document_ids" not in p["net_input"] for p in parts)
    assert parts[1]["net_input"]["context_parallel"].document_ids.tolist() == [[0] * 5 + [1] * 7]
    reset = dict(sample, net_input=dict(sample["net_input"], positions=torch.tensor([[0, 1, 2, 3, 4] * 2])))
    assert shard_sample(reset, 2, 1, None, pad=0)["net_input"]["positions"].tolist() == [[3, 4, 0, 1, 2, 3]]


def test_planner_divides_activations_per_cp_rank(tmp_path):
    """toolkit-plan: a rank of --context-parallel-size 2 holds half of each sequence's activations."""
    import dataclasses

    from tests.helpers.dist_helpers import llama_args, make_lm_data_bin
    from toolkit.plan.memory import activation_bytes, context_parallel_held
    from toolkit.plan.model_stats import model_stats
    from toolkit.plan.setup import setup_from_config
    from toolkit.plan.hardware import PRESETS
    from toolkit.plan.step_time import step_time
    from toolkit.plan.update_peak import moments
    from toolkit.train.resolve import parse_train_config

    data = make_lm_data_bin(str(tmp_path / "bin"))
    cfg = parse_train_config(
        [
            data,
            *llama_args(tmp_path / "ck"),
            "--distributed-world-size",
            "2",
            "--context-parallel-size",
            "2",
            "--ddp-backend",
            "fully_sharded",
        ]
    )
    stats, cp2 = model_stats(cfg, torch.float32), setup_from_config(cfg, gpu=True)
    assert cp2.cp == 2
    for checkpoint in (False, True):
        split = activation_bytes(stats, dataclasses.replace(cp2, checkpoint=checkpoint))
        whole = activation_bytes(stats, dataclasses.replace(cp2, cp=1, checkpoint=checkpoint))
        assert [2 * s for s in split] == pytest.approx(whole, abs=2)

        # the update's peak moments (start of backward, first block's backward) hold half the activations too
        def at(setup):
            both = moments(stats, setup)
            return [sum(n for n, _ in terms) for terms in (both.top, both.bottom)]

        state = at(dataclasses.replace(cp2, checkpoint=checkpoint, batch_sequences=0))
        split_peaks = [p - q for p, q in zip(at(dataclasses.replace(cp2, checkpoint=checkpoint)), state)]
        one_state = at(dataclasses.replace(cp2, cp=1, checkpoint=checkpoint, batch_sequences=0))
        whole_peaks = [p - q for p, q in zip(at(dataclasses.replace(cp2, cp=1, checkpoint=checkpoint)), one_state)]
        # ... beyond which a CP rank holds the other rank's keys/values (every layer's, or the recomputed one's)
        gathered = context_parallel_held(stats, cp2, True)[0]
        held = [gathered * (1 if checkpoint else stats.num_layers), gathered]
        assert [2 * (p - h) for p, h in zip(split_peaks, held)] == pytest.approx(whole_peaks, abs=8)
    # the step's compute: a CP rank computes half of each sequence, the update still counts every token
    one = step_time(stats, dataclasses.replace(cp2, cp=1, world=1), PRESETS["h100"])
    two = step_time(stats, cp2, PRESETS["h100"])
    assert two.flops_per_rank == pytest.approx(one.flops_per_rank / 2) and two.tokens_per_step == one.tokens_per_step
    # the K/V exchange: llama_tiny's 2 layers of k and v (2 heads x 16 each), 4 x 32 tokens, fp32; half comes
    # from the other rank, 3 times (gather, and the gradients' ring all-reduce); not in one process's step
    exchange = {name: size for name, size, _ in two.comm}["context-parallel K/V exchange"]
    assert exchange == 2 * (2 * 32) * 4 * 32 * 4 / 2 * 3
    assert "context-parallel K/V exchange" not in {name for name, _, _ in one.comm}


def test_planner_counts_the_gathered_keys_values_and_the_mask_per_cp_rank(tmp_path):
    """llama_tiny (2 layers, k and v of 2 heads x 16), 4 x 32 tokens in fp32 at CP 2: a rank holds the other
    rank's half of each layer's k and v (4 x 16 tokens x 128 features x 4 bytes) and, on a GPU, the bool
    [1, 1, 16, 32] mask ([4, 1, 16, 32] with --document-attention-mask); the table prints both rows."""
    from tests.helpers.dist_helpers import llama_args, make_lm_data_bin
    from toolkit.plan.hardware import PRESETS
    from toolkit.plan.memory import context_parallel_held, memory_items
    from toolkit.plan.model_stats import model_stats
    from toolkit.plan.planner import make_plan
    from toolkit.plan.report import table
    from toolkit.plan.setup import setup_from_config
    from toolkit.train.resolve import parse_train_config

    data = make_lm_data_bin(str(tmp_path / "bin"))
    flags = [
        data,
        *llama_args(tmp_path / "ck"),
        "--distributed-world-size",
        "2",
        "--context-parallel-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
    ]
    cfg = parse_train_config(flags)
    stats, setup = model_stats(cfg, torch.float32), setup_from_config(cfg, gpu=True)
    assert stats.kv_width == 2 * 2 * 2 * 16
    assert context_parallel_held(stats, setup, has_gpu=True) == (4 * 16 * 64 * 4, 16 * 32)
    assert context_parallel_held(stats, setup, has_gpu=False) == (4 * 16 * 64 * 4, 0)  # CPU: tile by tile
    documents = setup_from_config(parse_train_config(flags + ["--document-attention-mask"]), gpu=True)
    assert documents.document_mask and context_parallel_held(stats, documents, True)[1] == 4 * 16 * 32
    rows = {item.name: item.gpu for item in memory_items(stats, setup, PRESETS["h100"])}
    assert rows["gathered keys/values (cp)"] == 2 * 4 * 16 * 64 * 4 and rows["context-parallel mask"] == 16 * 32
    printed = table(make_plan(cfg, PRESETS["h100"], world_size=2))
    assert "gathered keys/values (cp)" in printed and "context-parallel K/V exchange" in printed


def test_a_131072_token_sample_goes_through_the_task_and_the_cp_split(tmp_path):
    """--tokens-per-sample 131072 --document-attention-mask --reset-position-ids: the task packs ~100 documents
    into 131072-token blocks whose positions restart at each document; --context-parallel-size 8 gives each rank
    2 chunks of 8192 columns with the block's own tokens, targets and positions, and the whole row's documents."""
    import numpy as np

    from tests.helpers.lm_fixtures import make_data_bin
    from toolkit.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

    T, C = 131072, 8
    rng = np.random.default_rng(0)
    make_data_bin(
        tmp_path / "bin",
        {"train": [" ".join(f"w{i}" for i in rng.integers(0, 50, n)) for n in rng.integers(100, 3000, 110)]},
    )
    task = LanguageModelingTask.setup_task(
        LanguageModelingConfig(
            data=str(tmp_path / "bin"),
            tokens_per_sample=T,
            sample_break_mode="none",
            document_attention_mask=True,
            reset_position_ids=True,
        )
    )
    dataset = task.load_dataset("train")
    assert dataset.sizes[0] == T
    sample = dataset.collater([dataset[0]])
    net = sample["net_input"]
    assert net["src_tokens"].shape == sample["target"].shape == net["positions"].shape == (1, T)
    docs, positions = net["document_ids"][0], net["positions"][0]
    starts = torch.cat([torch.tensor([True]), docs[1:] != docs[:-1]])
    assert 40 < int(starts.sum()) < 200 and (positions[starts] == 0).all()
    assert (positions[1:][~starts[1:]] == positions[:-1][~starts[1:]] + 1).all()  # counting up within a document
    parts = [shard_sample(sample, C, r, None, pad=task.dictionary.pad()) for r in range(C)]
    for r, part in enumerate(parts):
        columns = chunk_layout(T, C, r)
        assert part["net_input"]["src_tokens"].shape == (1, T // C)
        assert torch.equal(part["net_input"]["src_tokens"][0], net["src_tokens"][0, columns])
        assert torch.equal(part["target"][0], sample["target"][0, columns])
        assert torch.equal(part["net_input"]["positions"][0], positions[columns])
        assert torch.equal(part["net_input"]["context_parallel"].document_ids, net["document_ids"])


def test_the_planner_refuses_a_layout_whose_samples_do_not_cut(tmp_path):
    """A layout the planner is asked about (or tries) with --context-parallel-size 2 and 63-token samples: the
    same one line as toolkit-train's, not a FITS."""
    import dataclasses

    from toolkit.plan import PRESETS, make_plan
    from toolkit.train.resolve import parse_train_config

    cfg = parse_train_config([str(tmp_path), "--cpu", "--arch", "llama_tiny", "--tokens-per-sample", "63"])
    cp2 = dataclasses.replace(
        cfg,
        distributed=dataclasses.replace(cfg.distributed, context_parallel_size=2, distributed_world_size=2),
    )
    with pytest.raises(UserError, match=r"^--tokens-per-sample 63 with --context-parallel-size 2: .* 60 or 64$"):
        make_plan(cp2, PRESETS["h100"], vocab_size=64)
    assert make_plan(cfg, PRESETS["h100"], vocab_size=64).fits  # one rank: nothing to cut
