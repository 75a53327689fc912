"""Epoch-sharded data (``DATA=shard0:shard1:...``): epoch e trains on shard (e-1) mod n, as fairseq."""

from __future__ import annotations

import os

import pytest

from tests.helpers.sharded import make_shards
from toolkit.core.errors import UserError
from toolkit.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask


def task_for(data):
    return LanguageModelingTask.setup_task(LanguageModelingConfig(data=data, tokens_per_sample=8))


def epoch_words(task, epoch):
    dataset = task.dataset_for_epoch("train", epoch)
    itr = task.get_batch_iterator(dataset, batch_size=4, epoch=epoch).next_epoch_itr(shuffle=True)
    ids = {int(t) for batch in itr for t in batch["target"].flatten()}
    return {task.dictionary[i] for i in ids} - {"</s>", "<pad>"}


def test_each_epoch_reads_its_own_shard(tmp_path):
    paths = make_shards(str(tmp_path))
    task = task_for(":".join(paths))
    task.load_dataset("train")
    task.load_dataset("valid")
    words = {e: epoch_words(task, e) for e in range(1, 6)}
    assert words[1] == {"a", "b"} and words[2] == {"c", "d"} and words[3] == {"e", "f"}
    assert words[4] == words[1] and words[5] == words[2]  # round-robin
    assert task.dataset("valid") is task.datasets["valid"]  # valid stays the first shard's


def test_missing_shard_is_one_line_at_setup(tmp_path):
    paths = make_shards(str(tmp_path), n=2)
    with pytest.raises(UserError) as e:
        task_for(":".join(paths + [str(tmp_path / "shard2")]))
    assert str(e.value).startswith(f"{tmp_path / 'shard2'}: data shard not found") and "\n" not in str(e.value)


def test_shard_without_the_train_split_is_caught_at_first_load(tmp_path):
    paths = make_shards(str(tmp_path), n=3)
    for ext in ("bin", "idx"):
        os.remove(os.path.join(paths[2], f"train.{ext}"))
    task = task_for(":".join(paths))
    task.load_dataset("valid")  # only in the first shard: fine, as fairseq
    with pytest.raises(UserError) as e:
        task.load_dataset("train")
    assert "shard2/train.bin/.idx: not found" in str(e.value)
