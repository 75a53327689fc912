"""The run's state as one mapping of Statefuls (``Trainer.statefuls``) that both checkpoint formats save and
load without knowing what each entry is: a new entry round-trips through the .pt file and the DCP folder,
and the files keep the layout they had before the mapping (fairseq's keys, the same ``extra_state``).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.statefuls import Counter, assert_same, full_state, resume, train_and_save

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")

# The layout of the files as written before the Statefuls (commit 2696b9a), which old checkpoints have.
PT_KEYS = ["cfg", "model", "extra_state", "last_optimizer_state", "optimizer_name"]
EXTRA_KEYS = ["train_iterator", "val_loss", "best", "trainer", "metrics", "dictionary_hash"]
TRAINER_KEYS = ["num_updates", "lr_scheduler", "loss_scaler"]
META_KEYS = ["format", "cfg", "world_size", "has_optimizer_state", "optimizer_name", "extra_in_dcp", "extra_state"]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("statefuls") / "bin"))


@pytest.mark.parametrize("sharded", [False, True], ids=["pt", "dcp"])
def test_a_new_entry_round_trips_through_both_formats(data_bin, tmp_path, sharded):
    from toolkit.checkpoint.stateful import ModelState

    flags = ["--use-sharded-state"] if sharded else []
    probe = torch.nn.Linear(3, 4)  # a tensor entry the formats have never seen
    _, trainer, _ = train_and_save(
        data_bin, str(tmp_path), *flags, extra={"counter": Counter(5), "probe": ModelState(probe)}
    )
    fresh_probe = torch.nn.Linear(3, 4)
    counter = Counter()
    resumed, _, position = resume(
        data_bin, str(tmp_path), *flags, extra={"counter": counter, "probe": ModelState(fresh_probe)}
    )
    assert counter.value == 5
    assert_same(probe.state_dict(), fresh_probe.state_dict())
    assert_same(full_state(trainer), full_state(resumed))
    assert position["iterations_in_epoch"] == 2
    if sharded:
        from toolkit.checkpoint import sharded as dcp_format

        folder = os.path.join(str(tmp_path), "checkpoint_last")
        assert {"probe.weight", "probe.bias"} <= set(dcp_format.tensor_shapes(folder))
        assert dcp_format.read_meta(folder)["extra_state"]["counter"]["value"] == 5
    else:
        saved = torch.load(os.path.join(str(tmp_path), "checkpoint_last.pt"), weights_only=True)
        assert list(saved) == PT_KEYS + ["probe"] and list(saved["extra_state"]) == EXTRA_KEYS + ["counter"]


def head_layout_checkpoint(cfg, trainer, state) -> Dict[str, Any]:
    """A checkpoint as the code before the Statefuls wrote it, spelled out piece by piece (not through the
    formats): the layout every old ``.pt`` file has."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from toolkit.logging import metrics

    FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # torch's own, as the old code used

    position = dict(state.epoch_itr.state_dict(), update_freq=cfg.optimization.update_freq)
    extra = {
        "train_iterator": position,
        "val_loss": state.val_loss,
        "best": 3.5,
        "trainer": trainer.state_dict(),
        "metrics": metrics.state_dict(),
        "dictionary_hash": trainer.task.dictionary.symbols_hash(),
    }
    if trainer.ema is not None:
        extra["ema"] = trainer.ema.state_dict()
    return {
        "cfg": dict(cfg.to_dict(), distributed_world_size=1, data_parallel_size=1),
        "model": get_model_state_dict(trainer.model, options=FULL_STATE),
        "extra_state": extra,
        "last_optimizer_state": get_optimizer_state_dict(trainer.model, trainer.optimizer, options=FULL_STATE),
        "optimizer_name": "adam",
    }


@pytest.mark.parametrize("flags", [[], ["--store-ema", "--ema-decay", "0.5"]], ids=["plain", "ema"])
def test_old_layout_loads_and_saves_have_its_keys(data_bin, tmp_path, flags: List[str]):
    old_dir, new_dir = str(tmp_path / "old"), str(tmp_path / "new")
    os.makedirs(old_dir)
    cfg, trainer, state = train_and_save(data_bin, new_dir, *flags, updates=3)
    old = head_layout_checkpoint(cfg, trainer, state)
    torch.save(old, os.path.join(old_dir, "checkpoint_last.pt"))
    new = torch.load(os.path.join(new_dir, "checkpoint_last.pt"), weights_only=True)
    want_extra = EXTRA_KEYS + (["ema"] if flags else [])
    assert list(old) == list(new) == PT_KEYS
    assert list(old["extra_state"]) == list(new["extra_state"]) == want_extra
    assert list(new["extra_state"]["trainer"]) == TRAINER_KEYS
    assert_same(old["extra_state"]["train_iterator"], new["extra_state"]["train_iterator"])

    resumed, resumed_state, position = resume(data_bin, old_dir, *flags)
    assert_same(full_state(trainer), full_state(resumed))
    assert resumed.num_updates == 3 and resumed_state.best.best == 3.5 and position["iterations_in_epoch"] == 3
    if flags:
        assert_same(trainer.ema.state_dict(), resumed.ema.state_dict())


def test_sharded_meta_keeps_its_keys(data_bin, tmp_path):
    from toolkit.checkpoint import sharded

    train_and_save(data_bin, str(tmp_path), "--use-sharded-state", "--no-save-optimizer-state")
    folder = os.path.join(str(tmp_path), "checkpoint_last")
    meta = sharded.read_meta(folder)
    assert list(meta) == META_KEYS and list(meta["extra_state"]) == EXTRA_KEYS
    assert meta["has_optimizer_state"] is False and meta["optimizer_name"] is None
    assert {k.split(".")[0] for k in sharded.tensor_shapes(folder)} == {"model"}
    resumed, _, _ = resume(data_bin, str(tmp_path), "--use-sharded-state")
    assert resumed.num_updates == 2 and not resumed.optimizer.state  # nothing saved: a fresh optimizer


@pytest.mark.parametrize("reset", [False, True], ids=["restored", "reset"])
def test_reset_flags_live_in_the_entries(data_bin, tmp_path, reset):
    """--reset-optimizer / --reset-meters are the entries' own (the formats know no flags)."""
    from toolkit.logging import metrics

    _, trainer, _ = train_and_save(data_bin, str(tmp_path), updates=3)
    saved_loss = metrics.get_meter("default", "loss").state_dict()
    metrics.reset()  # a new process: no meters yet
    flags = ["--reset-optimizer", "--reset-meters"] if reset else []
    resumed, _, _ = resume(data_bin, str(tmp_path), *flags)
    assert resumed.num_updates == 3
    loss = metrics.get_meter("default", "loss")
    if reset:
        assert not resumed.optimizer.state and loss is None
    else:
        assert_same(full_state(trainer)["optim"], full_state(resumed)["optim"])
        assert loss.state_dict() == saved_loss
