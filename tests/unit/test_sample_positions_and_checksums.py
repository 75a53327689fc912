"""Sample positions resume exactly under another batching, changed data is refused, checksums are checked, and
an export replaces only an earlier export.

(The refusals are in ``tests/integration/test_bad_inputs_writers_and_checksums.py``.)
"""

from __future__ import annotations

import io
import os

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.checkpoints import damage_zip_record
from toolkit.checkpoint import integrity, sharded, stale_files
from toolkit.data.iterators import EpochBatchIterator
from toolkit.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("bin") / "bin"))


def _iterator(task, dataset, batch_size, num_shards=1, shard_id=0, seed=3, epoch=1) -> EpochBatchIterator:
    return task.get_batch_iterator(
        dataset, batch_size=batch_size, seed=seed, num_shards=num_shards, shard_id=shard_id, epoch=epoch
    )


def _ids(batches):
    return [int(i) for b in batches if not b["is_dummy"] for i in b["id"]]


def _through_a_checkpoint(state):
    """What a resume reads: the state saved and loaded with weights_only."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _resume_all_ranks(task, dataset, state, batch_size, num_shards, seed=3):
    """Every rank's rest of the epoch after loading ``state``, in global batch order."""
    per_rank = []
    for rank in range(num_shards):
        itr = _iterator(task, dataset, batch_size, num_shards, rank, seed=seed, epoch=state["epoch"])
        itr.load_state_dict(_through_a_checkpoint(state))
        per_rank.append(list(itr.next_epoch_itr()))
    rows = [b for step in zip(*per_rank) for b in step]
    return _ids(rows), per_rank


@pytest.mark.parametrize("new_batch_size,num_shards,seed", [(8, 1, 3), (3, 1, 3), (8, 2, 3), (4, 2, 3), (8, 1, 5)])
def test_resume_with_other_batching_trains_exactly_the_remaining_samples(data_bin, new_batch_size, num_shards, seed):
    task = LanguageModelingTask.setup_task(LanguageModelingConfig(data=data_bin, tokens_per_sample=32))
    dataset = task.load_dataset("train")
    first = _iterator(task, dataset, 4)
    batches = first.next_epoch_itr()
    consumed = _ids([next(batches) for _ in range(4)])  # 4 updates of --batch-size 4
    state = first.state_dict()
    assert state["samples_in_epoch"] == 16 == len(consumed)
    order = _ids(list(_iterator(task, dataset, 4).next_epoch_itr()))  # the epoch's sample order
    rest, per_rank = _resume_all_ranks(task, dataset, state, new_batch_size, num_shards, seed=seed)
    assert consumed + rest == order  # nothing skipped, nothing repeated, same order
    assert max(len(b["id"]) for r in per_rank for b in r) <= new_batch_size
    # a second stop inside the resumed epoch, then a third batching: still the same order
    resumed = _iterator(task, dataset, new_batch_size, num_shards, 0, seed=seed)
    resumed.load_state_dict(_through_a_checkpoint(state))
    itr = resumed.next_epoch_itr()
    next(itr)
    mid = resumed.state_dict()
    done = (
        len(_ids(per_rank[0][:1]))
        if num_shards == 1
        else sum(len(r[0]["id"]) for r in per_rank if not r[0]["is_dummy"])
    )
    assert mid["samples_in_epoch"] == 16 + done and mid["sampler"] == state["sampler"]
    again, _ = _resume_all_ranks(task, dataset, mid, 5, 1)
    assert order[: mid["samples_in_epoch"]] + again == order
    # the next epoch is the new batching's own
    assert resumed.state_dict()["sampler"]["batch_size"] == 4
    list(itr)
    assert (
        resumed.state_dict()["samples_in_epoch"] == 0
        and resumed.state_dict()["sampler"]["batch_size"] == new_batch_size
    )


def test_same_batching_resumes_at_the_batch_offset(data_bin):
    task = LanguageModelingTask.setup_task(LanguageModelingConfig(data=data_bin, tokens_per_sample=32))
    dataset = task.load_dataset("train")
    run = _iterator(task, dataset, 4)
    itr = run.next_epoch_itr()
    [next(itr) for _ in range(3)]
    resumed = _iterator(task, dataset, 4)
    resumed.load_state_dict(_through_a_checkpoint(run.state_dict()))
    assert resumed.iterations_in_epoch == 3 and resumed._plan is None


def test_changed_data_mid_epoch_is_refused(data_bin):
    from toolkit.core.errors import UserError

    task = LanguageModelingTask.setup_task(LanguageModelingConfig(data=data_bin, tokens_per_sample=32))
    dataset = task.load_dataset("train")
    run = _iterator(task, dataset, 4)
    next(run.next_epoch_itr())
    state = run.state_dict()
    state["sampler"] = dict(state["sampler"], fingerprint="0" * 16)
    with pytest.raises(UserError, match="the data-bin changed.*--reset-dataloader"):
        _iterator(task, dataset, 4).load_state_dict(state)


def test_export_force_replaces_only_an_earlier_export(tmp_path):
    from toolkit.export.api import ExportConfig, run_export
    from toolkit.export.target import MANIFEST, listed_files
    from tests.helpers.checkpoints import make_checkpoint

    path, _ = make_checkpoint(tmp_path)
    out = str(tmp_path / "st")
    run_export(ExportConfig(path=path, format="safetensors", out=out))
    listed = listed_files(out)
    assert sorted(listed + [MANIFEST]) == sorted(os.listdir(out)) and "model.safetensors" in listed
    os.utime(os.path.join(out, "model.safetensors"), (0, 0))
    run_export(ExportConfig(path=path, format="safetensors", out=out, force=True))
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) > 0  # written again
    empty = tmp_path / "empty"
    empty.mkdir()
    run_export(ExportConfig(path=path, format="safetensors", out=str(empty)))
    assert listed_files(str(empty)) == listed


def test_zip_crc_check(tmp_path):
    path = str(tmp_path / "c.pt")
    torch.save({"model": {"w": torch.randn(4096)}}, path)
    assert integrity.damaged_record(path) is None
    integrity.check_file(path)
    damage_zip_record(path)
    assert integrity.damaged_record(path).startswith("record ")
    assert integrity.newest_intact_beside(path) is None
    torch.save({"model": {"w": torch.zeros(8)}}, str(tmp_path / "checkpoint_1_2.pt"))
    assert integrity.newest_intact_beside(path) == str(tmp_path / "checkpoint_1_2.pt")


def test_sharded_temp_names_are_per_run_and_recovered(tmp_path):
    token = sharded.run_token()
    folder = str(tmp_path / "checkpoint_last")
    assert os.path.basename(sharded.tmp_path(folder)) == f".checkpoint_last.{token}.tmp"
    aside = tmp_path / f".checkpoint_last.{token}.tmp"
    aside.mkdir()
    for name in (".metadata", "meta.pt"):
        (aside / name).write_bytes(b"x")
    assert sharded.find_sharded(folder + ".pt") == str(aside)  # a crash between the two renames
    os.makedirs(folder)
    for name in (".metadata", "meta.pt"):
        open(os.path.join(folder, name), "wb").close()
    assert stale_files.stale_temp_paths(str(tmp_path)) == [str(aside)]
