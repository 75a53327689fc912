"""Distributed pieces checked in one process: a fairseq ``-shard`` set holding the full model loads,
the data position moves to another world size, and the backend is nccl on GPUs, gloo on CPUs.

The multi-process toolkit-train runs are in tests/integration/test_distributed.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import dist_helpers as H

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("dist") / "bin"))


@pytest.fixture()
def small_trainer(data_bin, tmp_path):
    from toolkit.distributed.utils import DistributedEnv
    from toolkit.train.train_loop import build_trainer

    cfg = H._parse_train_args([data_bin] + H.model_args(str(tmp_path)))
    return cfg, build_trainer(cfg, DistributedEnv())


def test_fairseq_shard_set_loaded_when_it_holds_the_full_model(small_trainer, tmp_path):
    import argparse

    import dataclasses

    from toolkit.train import checkpoint_manager as manager
    from toolkit.checkpoint.common import BestTracker, TrainingState
    from toolkit.distributed.utils import DistributedEnv
    from toolkit.core.errors import UserError

    cfg, trainer = small_trainer

    def load_latest(cfg):
        return manager.load_latest(cfg, trainer, TrainingState(trainer, BestTracker(False)), DistributedEnv())

    full = {k: torch.randn_like(v) for k, v in trainer.model.state_dict().items()}
    for i in range(2):  # fairseq names (decoder.*), every shard holding the whole model
        torch.save(
            {
                "model": {"decoder." + k: v for k, v in full.items()},
                "optimizer_history": [{"num_updates": 7}],
                "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 3, "shuffle": True}},
            },
            tmp_path / f"checkpoint_last-shard{i}.pt",
        )
    itr = load_latest(cfg)
    assert trainer.num_updates == 7 and itr["iterations_in_epoch"] == 3
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, full[k])

    def refused(files, match):
        d = tmp_path / match.replace(" ", "_")
        d.mkdir()
        for i, state in files.items():
            torch.save(state, d / f"ckpt-shard{i}.pt")
        restored = dataclasses.replace(
            cfg, checkpoint=dataclasses.replace(cfg.checkpoint, restore_file=str(d / "ckpt.pt"))
        )
        with pytest.raises(UserError, match=match) as e:
            load_latest(restored)
        assert "\n" not in str(e.value)

    flat = {
        "model": {"decoder.layers.0._fsdp_wrapped_module.flat_param_0": torch.zeros(10)},
        "shard_metadata": {"param_metadata": []},
    }
    refused({0: flat, 1: flat}, "FSDP flat-parameter shards")
    refused({0: {"args": argparse.Namespace(arch="x"), "model": full}}, "unsafe to load")
    refused({0: {"model": {"decoder.embed_tokens.weight": full["embed_tokens.weight"]}}}, "names do not match")
    refused({0: {"model": full}, 2: {"model": full}}, "shard 1 of 3 is missing")


def test_data_position_moves_to_another_world_size():
    from toolkit.distributed.utils import rescale_iterator_state

    state = {"epoch": 2, "iterations_in_epoch": 10, "shuffle": True}
    assert rescale_iterator_state(state, 2, 1)["iterations_in_epoch"] == 20
    assert rescale_iterator_state(state, 2, 4)["iterations_in_epoch"] == 5
    assert rescale_iterator_state(state, 2, 2) is state
    assert rescale_iterator_state(None, 2, 1) is None


def test_backend_is_nccl_on_gpus_gloo_on_cpus_and_both_for_cpu_offload():
    from toolkit.distributed.utils import default_backend

    assert default_backend(torch.device("cpu")) == "gloo"
    assert default_backend(torch.device("cpu"), cpu_offload=True) == "gloo"
    assert default_backend(torch.device("cuda", 0)) == "nccl"
    assert default_backend(torch.device("cuda", 0), cpu_offload=True) == "cuda:nccl,cpu:gloo"
