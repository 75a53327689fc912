import os

import numpy as np
import pytest
import torch

from tests.helpers.lm_fixtures import make_data_bin, make_wikitext_data_bin
from toolkit.data.batching import batch_by_size, filter_by_size
from toolkit.data.indexed_dataset import MMapIndexedDataset
from toolkit.data.iterators import CountingIterator, EpochBatchIterator
from toolkit.data.lm_dataset import MonolingualDataset, collate, collate_tokens
from toolkit.data.token_block_dataset import TokenBlockDataset, block_slices
from toolkit.core.errors import UserError
from toolkit.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

# ids: <s>=0 <pad>=1 </s>=2 <unk>=3 a=4 b=5 ... j=13
SYMBOLS = list("abcdefghij")
LINES = ["a b c", "d e", "", "f g h i", "j"]
# stream: a b c </s> | d e </s> | </s> | f g h i </s> | j </s>
STREAM = [4, 5, 6, 2, 7, 8, 2, 2, 9, 10, 11, 12, 2, 13, 2]
BOS, PAD, EOS = 0, 1, 2


@pytest.fixture
def data_bin(tmp_path):
    make_data_bin(tmp_path / "bin", {"train": LINES, "valid": LINES[:2]}, symbols=SYMBOLS)
    return str(tmp_path / "bin")


@pytest.fixture
def split(data_bin):
    return MMapIndexedDataset(os.path.join(data_bin, "train"))


def blocks_of(split, size, mode):
    ds = TokenBlockDataset(split, size, pad=PAD, eos=EOS, break_mode=mode)
    return [(s.tolist(), t.tolist()) for s, t in (ds[i] for i in range(len(ds)))]


# --- token blocks ----------------------------------------------------------------------
def test_fixture_writes_expected_stream(split, data_bin):
    assert split.tokens.tolist() == STREAM
    assert split.sizes.tolist() == [4, 3, 1, 5, 2]
    assert os.path.isfile(os.path.join(data_bin, "dict.txt"))


def test_break_mode_none(split):
    assert blocks_of(split, 4, "none") == [
        ([2, 4, 5, 6], [4, 5, 6, 2]),  # starts the split: source begins with </s>
        ([2, 7, 8, 2], [7, 8, 2, 2]),  # starts line 2
        ([2, 9, 10, 11], [9, 10, 11, 12]),  # starts line 4
        ([12, 2, 13], [2, 13, 2]),  # starts inside line 4: previous token
    ]


def test_break_mode_none_source_at_line_start_is_eos_even_without_eos_items():
    class Items:  # lines without </s>: a block starting a line still gets </s> (fairseq)
        sizes = np.array([3, 2])
        tokens = np.array([4, 5, 6, 7, 8])

    ds = TokenBlockDataset(Items(), 3, pad=PAD, eos=EOS, break_mode="none")
    assert [t.tolist() for t in ds[1]] == [[2, 7], [7, 8]]
    ds = TokenBlockDataset(Items(), 2, pad=PAD, eos=EOS, break_mode="none")
    assert [t.tolist() for t in ds[1]] == [[5, 6], [6, 7]]


def test_break_mode_complete(split):
    assert blocks_of(split, 6, "complete") == [
        ([2, 4, 5, 6], [4, 5, 6, 2]),
        ([2, 7, 8, 2], [7, 8, 2, 2]),  # line 2 + the empty line
        ([2, 9, 10, 11, 12], [9, 10, 11, 12, 2]),
        ([2, 13], [13, 2]),
    ]
    assert blocks_of(split, 100, "complete") == [([2] + STREAM[:-1], STREAM)]
    # a line longer than the block is a block of its own
    assert [t for _, t in blocks_of(split, 2, "complete")] == [
        [4, 5, 6, 2],
        [7, 8, 2],
        [2],
        [9, 10, 11, 12, 2],
        [13, 2],
    ]


def test_break_mode_complete_doc(split):
    assert blocks_of(split, 6, "complete_doc") == [
        ([2, 4, 5, 6], [4, 5, 6, 2]),
        ([2, 7, 8], [7, 8, 2]),  # the document ends at the empty line
        ([2, 9, 10, 11, 12], [9, 10, 11, 12, 2]),
        ([2, 13], [13, 2]),
    ]
    assert [t for _, t in blocks_of(split, 100, "complete_doc")] == [[4, 5, 6, 2, 7, 8, 2], [9, 10, 11, 12, 2, 13, 2]]


def test_break_mode_eos(split):
    assert blocks_of(split, None, "eos") == [
        ([2, 4, 5, 6], [4, 5, 6, 2]),
        ([2, 7, 8], [7, 8, 2]),
        ([2], [2]),
        ([2, 9, 10, 11, 12], [9, 10, 11, 12, 2]),
        ([2, 13], [13, 2]),
    ]


def test_block_slices_match_reference_loops():
    rng = np.random.RandomState(0)
    sizes = rng.choice([1, 1, 2, 3, 5, 9, 17], size=300)

    def complete_ref(sizes, block, doc):
        out, tok, i, cur = [], 0, 0, 0
        while i < len(sizes):
            if (cur + sizes[i] <= block or cur == 0) and not (doc and sizes[i] == 1):
                cur += sizes[i]
                i += 1
            else:
                if cur > (1 if doc else 0):
                    out.append((tok, tok + cur))
                tok += cur
                cur = 0
                if doc and sizes[i] == 1:
                    tok += 1
                    i += 1
        if cur > (1 if doc else 0):
            out.append((tok, tok + cur))
        return out

    for block in (1, 4, 8, 16, 50):
        for mode, doc in (("complete", False), ("complete_doc", True)):
            got = [tuple(x) for x in block_slices(sizes, block, mode).tolist()]
            assert got == complete_ref(sizes, block, doc), (mode, block)
        none = block_slices(sizes, block, "none")
        assert none[0].tolist() == [0, block] and none[-1, 1] == sizes.sum()
        assert (np.diff(none[:, 0]) == block).all()


def test_blocks_pickle_without_copying_the_token_array(split):
    import pickle

    ds = TokenBlockDataset(split, 4, pad=PAD, eos=EOS, break_mode="none")
    data = pickle.dumps(ds)
    assert ds.tokens.tobytes() not in data
    copy = pickle.loads(data)
    assert [t.tolist() for t in copy[3]] == [t.tolist() for t in ds[3]]


def test_blocks_of_a_plain_dataset_and_of_an_empty_split(tmp_path):
    class Lines(torch.utils.data.Dataset):  # no .tokens: items are concatenated
        sizes = np.array([2, 3])

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.tensor([[4, 2], [5, 6, 2]][i])

    ds = TokenBlockDataset(Lines(), 2, pad=PAD, eos=EOS, break_mode="none")
    assert [[t.tolist() for t in ds[i]] for i in range(len(ds))] == [[[2, 4], [4, 2]], [[2, 5], [5, 6]], [[6], [2]]]

    make_data_bin(tmp_path / "e", {"train": []}, symbols=SYMBOLS)
    task = LanguageModelingTask.setup_task({"data": str(tmp_path / "e")})
    for mode in ("none", "complete", "complete_doc", "eos"):
        task.cfg.sample_break_mode = mode
        empty = task.load_dataset("train")
        assert len(empty) == 0
        itr = task.get_batch_iterator(empty, max_tokens=16, num_shards=2, shard_id=1)
        assert len(itr) == 0 and list(itr.next_epoch_itr()) == [] and itr.end_of_epoch()


def test_add_bos_token_prepends_to_source_and_target(split):
    blocks = TokenBlockDataset(split, 4, pad=PAD, eos=EOS, break_mode="none")
    d = make_dict()
    item = MonolingualDataset(blocks, d, add_bos_token=True)[3]
    assert item["source"].tolist() == [0, 12, 2, 13]
    assert item["target"].tolist() == [0, 2, 13, 2]
    assert MonolingualDataset(blocks, d, add_bos_token=False)[3]["source"].tolist() == [12, 2, 13]


def make_dict():
    from tests.helpers.lm_fixtures import build_dictionary

    return build_dictionary([], symbols=SYMBOLS)


# --- collate -----------------------------------------------------------------------------
def test_collate_pads_right_and_counts_tokens():
    samples = [
        {"id": 7, "source": torch.tensor([2, 4, 5]), "target": torch.tensor([4, 5, 2])},
        {"id": 3, "source": torch.tensor([2]), "target": torch.tensor([2])},
    ]
    batch = collate(samples, PAD)
    assert batch["id"].tolist() == [7, 3]
    assert batch["nsentences"] == 2 and batch["ntokens"] == 4
    assert batch["net_input"]["src_tokens"].tolist() == [[2, 4, 5], [2, 1, 1]]
    assert batch["net_input"]["src_lengths"].tolist() == [3, 1]
    assert batch["target"].tolist() == [[4, 5, 2], [2, 1, 1]]
    assert batch["target"].dtype == torch.long
    assert int(batch["target"].ne(PAD).sum()) == batch["ntokens"]
    assert collate([], PAD) == {}
    assert collate_tokens([np.array([5])], PAD, pad_to_length=3).tolist() == [[5, 1, 1]]


# --- batching ----------------------------------------------------------------------------
def padded(batch, sizes):
    return len(batch) * max(sizes[i] for i in batch)


def test_batch_by_size_max_tokens():
    sizes = np.array([3, 3, 3, 3, 3, 5, 5, 8, 8, 1])
    order = np.argsort(sizes, kind="stable")
    batches = batch_by_size(order, sizes, max_tokens=10)
    assert [b.tolist() for b in batches] == [[9, 0, 1], [2, 3, 4], [5, 6], [7], [8]]
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert all(padded(b, sizes) <= 10 for b in batches)


def test_batch_by_size_batch_size_and_multiple():
    sizes = np.full(11, 4)
    idx = np.arange(11)
    assert [len(b) for b in batch_by_size(idx, sizes, max_sentences=3)] == [3, 3, 3, 2]
    # 7 fit (28 tokens <= 30), rounded down to a multiple of 2; the rest carries over
    assert [len(b) for b in batch_by_size(idx, sizes, max_tokens=30, required_batch_size_multiple=2)] == [6, 4, 1]
    # fewer than the multiple fit: keep what fits
    assert [len(b) for b in batch_by_size(idx, sizes, max_tokens=12, required_batch_size_multiple=8)] == [3, 3, 3, 2]
    both = batch_by_size(idx, sizes, max_tokens=20, max_sentences=4, required_batch_size_multiple=2)
    assert [len(b) for b in both] == [4, 4, 2, 1]  # the tail too is cut to a multiple (as fairseq)
    assert batch_by_size(np.zeros(0, dtype=np.int64), sizes, max_tokens=8) == []


def test_batch_by_size_random_respects_limits():
    rng = np.random.RandomState(1)
    sizes = rng.randint(1, 40, size=500)
    order = rng.permutation(500)
    for max_tokens, max_sent, mult in [(64, None, 1), (100, 7, 4), (None, 16, 8), (250, None, 8)]:
        batches = batch_by_size(
            order, sizes, max_tokens=max_tokens, max_sentences=max_sent, required_batch_size_multiple=mult
        )
        assert np.concatenate(batches).tolist() == order.tolist()
        for b in batches:
            assert max_tokens is None or padded(b, sizes) <= max_tokens
            assert max_sent is None or len(b) <= max_sent
        # all but the last are multiples of mult unless fewer than mult fit
        for b, nxt in zip(batches[:-1], batches[1:]):
            if len(b) % mult:
                assert len(b) < mult


def test_batch_by_size_sample_too_long():
    with pytest.raises(UserError, match="--max-tokens 4"):
        batch_by_size(np.arange(2), np.array([3, 5]), max_tokens=4)


def test_filter_by_size():
    kept, dropped = filter_by_size(np.array([2, 0, 1]), np.array([5, 9, 3]), 5)
    assert kept.tolist() == [2, 0] and dropped.tolist() == [1]


# --- iterators ---------------------------------------------------------------------------
class ListDataset(torch.utils.data.Dataset):
    """Sample i is just i; collate gives the list of ids."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def collate_ids(samples):
    return {"ids": list(samples), "ntokens": len(samples), "nsentences": len(samples)}


def make_itr(num_batches=10, per_batch=2, seed=1, num_shards=1, shard_id=0, epoch=1, num_workers=0):
    batches = [list(range(k * per_batch, (k + 1) * per_batch)) for k in range(num_batches)]
    return EpochBatchIterator(
        ListDataset(num_batches * per_batch),
        collate_ids,
        batches,
        seed=seed,
        num_shards=num_shards,
        shard_id=shard_id,
        num_workers=num_workers,
        epoch=epoch,
    )


def epoch_ids(itr, shuffle=True):
    return [tuple(s["ids"]) for s in itr.next_epoch_itr(shuffle=shuffle)]


def test_counting_iterator():
    it = CountingIterator(iter(range(5)), start=2, total=7)
    assert len(it) == 7 and it.n == 2 and it.has_next()
    assert next(it) == 0 and it.n == 3
    it.take(4)
    assert list(it) == [1] and it.n == 4 and not it.has_next()
    assert list(CountingIterator([1, 2, 3]).skip(1)) == [2, 3]


def test_epoch_iterator_is_deterministic_and_reshuffles_per_epoch():
    a, b = make_itr(), make_itr()
    e1, e1b = epoch_ids(a), epoch_ids(b)
    assert e1 == e1b
    assert sorted(e1) == [tuple(range(2 * k, 2 * k + 2)) for k in range(10)]
    assert a.epoch == 1 and a.end_of_epoch() and a.next_epoch_idx == 2
    e2 = epoch_ids(a)
    assert a.epoch == 2 and sorted(e2) == sorted(e1) and e2 != e1
    assert epoch_ids(make_itr(epoch=2)) == e2
    assert epoch_ids(make_itr(seed=2)) != e1
    unshuffled = epoch_ids(make_itr(), shuffle=False)
    assert unshuffled == [tuple(range(2 * k, 2 * k + 2)) for k in range(10)]
    # the order is numpy's legacy RandomState(seed + epoch) shuffle (fairseq's)
    expected = [tuple(range(2 * k, 2 * k + 2)) for k in range(10)]
    np.random.RandomState(1 + 1).shuffle(expected)
    assert e1 == expected


def batch_position(state):
    """The batch count part of an iterator state (what older checkpoints hold)."""
    return {key: state[key] for key in ("epoch", "iterations_in_epoch", "shuffle")}


@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_resume_mid_epoch(k):
    full = make_itr()
    epoch_ids(full)  # epoch 1
    reference = epoch_ids(full)  # epoch 2, uninterrupted

    run = make_itr()
    epoch_ids(run)
    itr = run.next_epoch_itr()
    consumed = [tuple(next(itr)["ids"]) for _ in range(k)]
    state = run.state_dict()
    assert batch_position(state) == {"epoch": 2, "iterations_in_epoch": k, "shuffle": True}
    assert state["samples_in_epoch"] == 2 * k and state["sampler"]["num_samples"] == 20
    assert all(
        type(v) in (int, bool, str) for v in [*state.values(), *state["sampler"].values()] if type(v) is not dict
    )

    resumed = make_itr(epoch=state["epoch"])
    resumed.load_state_dict(state)
    assert resumed.iterations_in_epoch == k and resumed.next_epoch_idx == 2
    itr2 = resumed.next_epoch_itr()
    assert itr2.n == k and len(itr2) == 10
    rest = [tuple(s["ids"]) for s in itr2]
    assert consumed + rest == reference
    assert resumed.end_of_epoch() and resumed.epoch == 2
    assert batch_position(resumed.state_dict()) == {"epoch": 3, "iterations_in_epoch": 0, "shuffle": True}
    # and the next epoch matches the uninterrupted run's next epoch
    assert epoch_ids(resumed) == epoch_ids(full)


def test_resume_skips_without_loading():
    calls = []

    class Spy(ListDataset):
        def __getitem__(self, i):
            calls.append(i)
            return i

    batches = [[2 * k, 2 * k + 1] for k in range(5)]
    itr = EpochBatchIterator(Spy(10), collate_ids, batches, seed=3)
    itr.load_state_dict({"epoch": 1, "iterations_in_epoch": 3, "shuffle": True})
    out = list(itr.next_epoch_itr())
    assert len(out) == 2 and len(calls) == 4


def test_resume_state_beyond_epoch_is_user_error():
    itr = make_itr(num_batches=3)
    with pytest.raises(UserError, match="--reset-dataloader"):
        itr.load_state_dict({"epoch": 1, "iterations_in_epoch": 5, "shuffle": True})


def test_state_dict_before_first_epoch_and_at_end():
    itr = make_itr(epoch=3)
    assert batch_position(itr.state_dict()) == {"epoch": 3, "iterations_in_epoch": 0, "shuffle": True}
    assert not itr.end_of_epoch() and itr.next_epoch_idx == 3
    epoch_ids(itr, shuffle=False)
    assert batch_position(itr.state_dict()) == {"epoch": 4, "iterations_in_epoch": 0, "shuffle": False}


@pytest.mark.parametrize("num_batches", [10, 11, 1])
def test_sharding_interleaves_to_single_shard_order(num_batches):
    single = epoch_ids(make_itr(num_batches=num_batches))
    shards = [make_itr(num_batches=num_batches, num_shards=3, shard_id=r) for r in range(3)]
    per_rank = [list(s.next_epoch_itr()) for s in shards]
    assert len({len(s) for s in shards}) == 1
    assert all(len(p) == len(shards[0]) == -(-num_batches // 3) for p in per_rank)
    interleaved = [per_rank[r][i] for i in range(len(per_rank[0])) for r in range(3)]
    real = [tuple(s["ids"]) for s in interleaved if not s["is_dummy"]]
    assert real == single
    dummies = [s for s in interleaved if s["is_dummy"]]
    assert len(dummies) == 3 * len(per_rank[0]) - num_batches
    for d in dummies:  # a real batch's tensors, but weightless
        assert d["ntokens"] == 0 and d["nsentences"] == 0 and len(d["ids"]) == 2
        assert tuple(d["ids"]) == single[0]
    # dummies only ever come last
    for p in per_rank:
        flags = [s["is_dummy"] for s in p]
        assert flags == sorted(flags)


def test_two_ranks_update_freq_1_equal_one_rank_update_freq_2():
    single = epoch_ids(make_itr(num_batches=8))
    r0, r1 = (epoch_ids(make_itr(num_batches=8, num_shards=2, shard_id=r)) for r in range(2))
    updates_2_ranks = [{a, b} for a, b in zip(r0, r1)]
    updates_1_rank = [set(single[i : i + 2]) for i in range(0, 8, 2)]
    assert updates_2_ranks == updates_1_rank


def test_worker_processes_give_the_same_batches():
    assert epoch_ids(make_itr(num_batches=4, num_workers=1)) == epoch_ids(make_itr(num_batches=4))


# --- task -------------------------------------------------------------------------------
def make_task(data, **kw):
    return LanguageModelingTask.setup_task(LanguageModelingConfig(data=data, **kw))


def test_task_setup_and_datasets(data_bin):
    task = make_task(data_bin, tokens_per_sample=4)
    assert len(task.dictionary) == 14 and task.source_dictionary is task.target_dictionary is task.dictionary
    ds = task.load_dataset("train")
    assert task.dataset("train") is ds and task.datasets["train"] is ds
    assert len(ds) == 4 and ds.sizes.tolist() == [4, 4, 4, 3]
    assert ds[0]["target"].tolist() == STREAM[:4]
    with pytest.raises(KeyError):
        task.dataset("test")


def test_task_accepts_namespace_or_dict(data_bin):
    import argparse

    ns = argparse.Namespace(
        data=data_bin, tokens_per_sample=8, sample_break_mode="complete", add_bos_token=True, lr=1.0
    )
    task = LanguageModelingTask.setup_task(ns)
    assert task.cfg.tokens_per_sample == 8 and task.cfg.add_bos_token
    assert LanguageModelingTask.setup_task({"data": data_bin}).cfg.tokens_per_sample == 1024


def test_task_missing_dict_is_user_error(tmp_path):
    with pytest.raises(UserError) as e:
        make_task(str(tmp_path))
    assert str(e.value) == (f"{tmp_path}/dict.txt: not found; is {tmp_path} a data-bin made by toolkit-preprocess?")


def test_task_missing_split_is_user_error(data_bin):
    task = make_task(data_bin)
    with pytest.raises(UserError) as e:
        task.load_dataset("test")
    msg = str(e.value)
    assert msg.startswith(f"{data_bin}/test.bin/.idx: not found") and "train, valid" in msg


def test_task_round_robin_over_data_folders(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    make_data_bin(a, {"train": ["a b"]}, symbols=SYMBOLS)
    make_data_bin(b, {"train": ["c d e"]}, symbols=SYMBOLS)
    task = make_task(f"{a}:{b}", tokens_per_sample=100)
    assert [task.load_dataset("train", epoch=e)[0]["target"].tolist() for e in (1, 2, 3)] == [
        [4, 5, 2],
        [6, 7, 8, 2],
        [4, 5, 2],
    ]


def test_task_batch_iterator_covers_every_token(data_bin):
    task = make_task(data_bin, tokens_per_sample=3)
    ds = task.load_dataset("train")
    itr = task.get_batch_iterator(ds, max_tokens=6, seed=5, epoch=1)
    samples = list(itr.next_epoch_itr())
    assert len(samples) == len(itr)
    assert sum(s["ntokens"] for s in samples) == len(STREAM)
    targets = {}
    for s in samples:
        assert s["target"].numel() <= 6 and not s["is_dummy"]
        assert s["net_input"]["src_tokens"].shape == s["target"].shape
        for i, row in zip(s["id"].tolist(), s["target"].tolist()):
            targets[i] = [t for t in row if t != PAD]
    assert sum((targets[i] for i in range(len(ds))), []) == STREAM


def test_task_max_positions_filter(data_bin):
    task = make_task(data_bin, sample_break_mode="eos")
    ds = task.load_dataset("train")
    with pytest.raises(UserError, match="longer than the model's 4 positions"):
        task.get_batch_iterator(ds, batch_size=2, max_positions=4)
    itr = task.get_batch_iterator(ds, batch_size=2, max_positions=4, ignore_invalid_inputs=True)
    ids = sorted(i for s in itr.next_epoch_itr() for i in s["id"].tolist())
    assert ids == [0, 1, 2, 4]


def test_task_builds_criterion(data_bin):
    import argparse
    from toolkit.criterions.cross_entropy import CrossEntropyCriterion

    task = make_task(data_bin)
    crit = task.build_criterion(argparse.Namespace(criterion="cross_entropy", sentence_avg=False))
    assert isinstance(crit, CrossEntropyCriterion) and crit.padding_idx == PAD


def test_task_builds_model_from_arch(data_bin, monkeypatch):
    import argparse
    from dataclasses import dataclass, field
    from toolkit.core import registry

    @dataclass
    class TinyCfg:
        width: int = field(default=2, metadata={"help": "w"})
        depth: int = field(default=1, metadata={"help": "d"})

    class Tiny:
        @classmethod
        def build_model(cls, cfg, task):
            m = cls()
            m.cfg, m.vocab = cfg, len(task.dictionary)
            return m

    # registered only for this test
    monkeypatch.setitem(
        registry.MODEL_REGISTRY.entries, "_test_tiny_lm", registry.RegistryEntry("_test_tiny_lm", Tiny, TinyCfg)
    )
    monkeypatch.setitem(registry.ARCH_MODEL_NAME, "_test_tiny_lm_wide", "_test_tiny_lm")
    monkeypatch.setitem(registry.ARCH_CONFIG_FN, "_test_tiny_lm_wide", lambda cfg: setattr(cfg, "width", 64))
    task = make_task(data_bin)
    m = task.build_model({"arch": "_test_tiny_lm_wide", "depth": 3})
    assert (m.cfg.width, m.cfg.depth, m.vocab) == (64, 3, 14)
    m = task.build_model(argparse.Namespace(arch="_test_tiny_lm", width=5, depth=2, lr=0.1))
    assert (m.cfg.width, m.cfg.depth) == (5, 2)


def test_task_and_criterion_registered_with_options():
    import argparse
    from toolkit.config import options
    from toolkit.core import registry
    from toolkit.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig

    task_entry = registry.TASK_REGISTRY.get("language_modeling")
    crit_entry = registry.CRITERION_REGISTRY.get("cross_entropy")
    assert (task_entry.cls, task_entry.config) == (LanguageModelingTask, LanguageModelingConfig)
    assert (crit_entry.cls, crit_entry.config) == (CrossEntropyCriterion, CrossEntropyCriterionConfig)
    parser = argparse.ArgumentParser()
    options.add_dataclass_options(parser, LanguageModelingConfig)
    options.add_dataclass_options(parser, CrossEntropyCriterionConfig)
    args = parser.parse_args(["/tmp/bin", "--tokens-per-sample", "16", "--sample-break-mode", "eos", "--add-bos-token"])
    assert (args.data, args.tokens_per_sample, args.sample_break_mode, args.add_bos_token, args.sentence_avg) == (
        "/tmp/bin",
        16,
        "eos",
        True,
        False,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["/tmp/bin", "--sample-break-mode", "lines"])


# --- the real corpus --------------------------------------------------------------------
def test_wikitext_smoke(tmp_path, wikitext_dir):
    d = make_wikitext_data_bin(tmp_path / "wt", wikitext_dir, max_train_lines=2000, max_valid_lines=200)
    task = make_task(str(tmp_path / "wt"), tokens_per_sample=128)
    ds = task.load_dataset("train")
    split = MMapIndexedDataset(str(tmp_path / "wt" / "train"))
    total = len(split.tokens)
    assert total > 50_000 and len(ds) == -(-total // 128)
    itr = task.get_batch_iterator(ds, max_tokens=1024, required_batch_size_multiple=8, seed=1, num_shards=2, shard_id=1)
    seen = 0
    for s in itr.next_epoch_itr():
        assert s["target"].numel() <= 1024
        assert s["net_input"]["src_tokens"].max() < len(d)
        if not s["is_dummy"]:
            seen += s["ntokens"]
    other = task.get_batch_iterator(
        ds, max_tokens=1024, required_batch_size_multiple=8, seed=1, num_shards=2, shard_id=0
    )
    seen += sum(s["ntokens"] for s in other.next_epoch_itr() if not s["is_dummy"])
    assert seen == total
    for mode in ("complete", "complete_doc", "eos"):
        blocks = make_task(str(tmp_path / "wt"), tokens_per_sample=128, sample_break_mode=mode).load_dataset("valid")
        assert len(blocks) > 0
        s = blocks[0]
        assert s["source"][0] == EOS and s["source"][1:].tolist() == s["target"][:-1].tolist()


def test_data_loader_workers_drop_only_the_descriptor_sharing_threads_reports(monkeypatch):
    """A worker's fd-sharing thread (multiprocessing.resource_sharer._serve) reporting a broken connection after
    the main process left is dropped; any other error still reaches the previous excepthook."""
    import sys
    from multiprocessing import resource_sharer

    from toolkit.data.iterators import quiet_descriptor_sharing_errors

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(kind.__name__))
    quiet_descriptor_sharing_errors(0)
    namespace = {}  # a function "defined in" resource_sharer.py, so its frame carries that file name
    exec(compile("def _serve():\n    raise OSError('broken pipe')\n", resource_sharer.__file__, "exec"), namespace)
    for fail in (namespace["_serve"], lambda: int("not a number")):
        try:
            fail()
        except Exception:
            sys.excepthook(*sys.exc_info())
    assert seen == ["ValueError"]
