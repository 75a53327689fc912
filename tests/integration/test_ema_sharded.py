"""--store-ema where the weights are sharded (FSDP2, tensor parallelism, FSDP2's --cpu-offload): each rank
averages its own shards, the consolidated checkpoint holds the whole average, and it equals one process's.

Two ranks against one process: FSDP2 splits the batch over two data-parallel ranks (one process takes both
with ``--update-freq 2``); under TP the two ranks are one replica, so both runs take ``--update-freq 2``;
``hsdp`` is four ranks, two replicas of two shards (``hybrid_shard``), against ``--update-freq 4``. The
``fsdp`` case stops after 3 updates and resumes at two ranks for the 4th, so the average goes through a save
(gathered) and a load (each rank's part taken back). ``--ema-decay 0.5`` keeps the average away from the last
weights (checked), so a run that saved the weights instead, or one rank's shards, fails. Weights and averages are
fp32; tolerance rtol 1e-3 / atol 1e-4 (as test_composition's TP x cpu-offload weights), losses 1e-3 relative.

With ``--use-sharded-state`` each rank writes its shards of the average as DCP entries (``ema.*``): a 2-rank run
stopped after 3 updates and resumed for the 4th, at 2 ranks and (resharded) in one process, equals the
uninterrupted 2-rank run to rtol 1e-4 (the same arithmetic in the same layout) and one process's run as above;
under TP (2 ranks) resumed at 2 ranks, one process's.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from toolkit.checkpoint import sharded

from tests.helpers import dist_helpers as H

UPDATES = 4
EMA = ["--store-ema", "--ema-decay", "0.5"]
OFFLOAD = ["--cpu-offload", "--optimizer", "cpu_adam"]
TWO_FSDP = ["--distributed-world-size", "2", "--ddp-backend", "fully_sharded"]
CASES = {  # case: (the two-rank run's flags, the one-process run's flags)
    "fsdp": (TWO_FSDP, ["--update-freq", "2"]),
    "tp": (
        [
            "--distributed-world-size",
            "2",
            "--model-parallel-size",
            "2",
            "--ddp-backend",
            "fully_sharded",
            "--update-freq",
            "2",
        ],
        ["--update-freq", "2"],
    ),
    "hsdp": (
        [
            "--distributed-world-size",
            "4",
            "--ddp-backend",
            "fully_sharded",
            "--sharding-strategy",
            "hybrid_shard",
            "--shard-group-size",
            "2",
        ],
        ["--update-freq", "4"],
    ),  # 2 replicas of 2 shards
    "offload": (TWO_FSDP + OFFLOAD, ["--update-freq", "2", "--optimizer", "cpu_adam"]),
    "offload_overlap": (
        TWO_FSDP + OFFLOAD + ["--overlap-offload-step"],
        ["--update-freq", "2", "--optimizer", "cpu_adam"],
    ),
}


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("ema_sharded") / "bin"))


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """The one-process runs by their flags, trained once for the cases that share them."""
    return {"root": tmp_path_factory.mktemp("ema_one"), "runs": {}}


def train(data_bin, save_dir, *flags, max_update=UPDATES):
    proc = H.run_train(
        [data_bin, *H.model_args(str(save_dir)), "--disable-validation", "--max-update", str(max_update), *EMA, *flags],
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def one_process(data_bin, runs, flags):
    key = " ".join(flags)
    if key not in runs["runs"]:
        save_dir = runs["root"] / f"one{len(runs['runs'])}"
        runs["runs"][key] = (train(data_bin, save_dir, *flags), save_dir / "checkpoint_last.pt")
    return runs["runs"][key]


def saved(path):
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return ckpt["model"], ckpt["extra_state"]["ema"]


def assert_close_states(got, want, what):
    assert got.keys() == want.keys(), what
    for k in want:
        a, b = got[k], want[k]
        if k.endswith("qkv_proj.bias"):  # the k bias has an exactly-zero gradient: Adam steps on rounding noise
            C = a.numel() // 3  # (as in test_composition / test_tp_cli)
            a, b = torch.cat([a[:C], a[2 * C :]]), torch.cat([b[:C], b[2 * C :]])
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-4), (what, k, (a - b).abs().max())


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_moving_average_equals_one_process(data_bin, one_process_runs, tmp_path, case):
    sharded_flags, one_flags = CASES[case]
    one, one_path = one_process(data_bin, one_process_runs, one_flags)
    if case == "fsdp":  # 3 updates, then a resumed run for the 4th: the average is saved and loaded sharded
        train(data_bin, tmp_path / "two", *sharded_flags, max_update=UPDATES - 1)
    two = train(data_bin, tmp_path / "two", *sharded_flags)
    if case == "hsdp":
        assert "('dp_replicate', 'dp_shard')" in two.stdout and "(2, 2)" in two.stdout, two.stdout[-2000:]
    got, want = H.losses(two.stdout), H.losses(one.stdout)
    assert UPDATES in got and all(abs(got[u] - want[u]) <= 1e-3 * abs(want[u]) + H.LOGGED_TOL for u in got)
    if case == "fsdp":
        assert sorted(got) == [UPDATES], "the second run resumed after update 3"
    weights, average = saved(tmp_path / "two" / "checkpoint_last.pt")
    one_weights, one_average = saved(one_path)
    assert_close_states(weights, one_weights, "weights")
    assert_close_states(average, one_average, "moving average")
    key = next(k for k in average if k.endswith("layers.0.fc1.weight"))
    assert not torch.allclose(average[key], weights[key], atol=1e-4), "the average is not the last weights"


def consolidated_state(folder, out):
    """Weights and moving average of a sharded checkpoint, through toolkit-consolidate's function."""
    sharded.consolidate(str(folder), str(out), include_optimizer=False)
    return saved(out)


def test_sharded_state_holds_each_ranks_average_and_resumes_at_any_world_size(data_bin, one_process_runs, tmp_path):
    two_flags = TWO_FSDP + ["--use-sharded-state"]
    one, one_path = one_process(data_bin, one_process_runs, ["--update-freq", "2"])
    whole = train(data_bin, tmp_path / "whole", *two_flags)
    train(data_bin, tmp_path / "two", *two_flags, max_update=UPDATES - 1)
    folder = tmp_path / "two" / "checkpoint_last"
    shapes = sharded.tensor_shapes(str(folder))
    assert any(k.startswith("ema.") and k.endswith("layers.0.fc1.weight") for k in shapes), "the average in DCP"
    assert "ema" not in sharded.read_meta(str(folder))["extra_state"]
    shutil.copytree(tmp_path / "two", tmp_path / "one")
    resumed = {
        "two": train(data_bin, tmp_path / "two", *two_flags),  # the 4th update, at 2 ranks and in one
        "one": train(data_bin, tmp_path / "one", "--update-freq", "2", "--use-sharded-state"),
    }
    want, want_whole = H.losses(one.stdout), H.losses(whole.stdout)
    whole_weights, whole_average = consolidated_state(tmp_path / "whole" / "checkpoint_last", tmp_path / "w.pt")
    one_weights, one_average = saved(one_path)
    for name, run in resumed.items():
        got = H.losses(run.stdout)
        assert sorted(got) == [UPDATES], f"{name}: resumed after update 3"
        assert abs(got[UPDATES] - want[UPDATES]) <= 1e-3 * abs(want[UPDATES]) + H.LOGGED_TOL, name
        assert abs(got[UPDATES] - want_whole[UPDATES]) <= H.LOGGED_TOL, name
        weights, average = consolidated_state(tmp_path / name / "checkpoint_last", tmp_path / f"{name}.pt")
        for k in whole_average:
            assert torch.allclose(average[k], whole_average[k], rtol=1e-4, atol=1e-6), (name, k)
        assert_close_states(weights, one_weights, f"{name}: weights")
        assert_close_states(average, one_average, f"{name}: moving average")
    key = next(k for k in average if k.endswith("layers.0.fc1.weight"))
    assert not torch.allclose(average[key], weights[key], atol=1e-4), "the average is not the last weights"


def test_tensor_parallel_sharded_state_resumes_its_average(data_bin, one_process_runs, tmp_path):
    """The same under TP (2 ranks, one replica): the average's column- and row-parallel shards as DCP entries."""
    tp_flags, one_flags = CASES["tp"]
    one, one_path = one_process(data_bin, one_process_runs, one_flags)
    train(data_bin, tmp_path / "tp", *tp_flags, "--use-sharded-state", max_update=UPDATES - 1)
    assert "ema" not in sharded.read_meta(str(tmp_path / "tp" / "checkpoint_last"))["extra_state"]
    resumed = train(data_bin, tmp_path / "tp", *tp_flags, "--use-sharded-state")
    got, want = H.losses(resumed.stdout), H.losses(one.stdout)
    assert sorted(got) == [UPDATES] and abs(got[UPDATES] - want[UPDATES]) <= 1e-3 * abs(want[UPDATES]) + H.LOGGED_TOL
    weights, average = consolidated_state(tmp_path / "tp" / "checkpoint_last", tmp_path / "tp.pt")
    one_weights, one_average = saved(one_path)
    assert_close_states(weights, one_weights, "weights")
    assert_close_states(average, one_average, "moving average")
