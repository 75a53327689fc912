"""Launching as fairseq does (issue 11 item 6): every visible GPU by default, and Slurm's srun layout.

The layout arithmetic is checked against fairseq's ``_infer_slurm_init`` formulas; the real
runs simulate ``srun`` on CPU by setting Slurm's variables by hand for two processes (one
task per process) and for one process (one task per node, spawning its workers), and compare
their losses and final weights with the same two ranks spawned by ``--distributed-world-size 2``.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch

from tests.helpers import dist_helpers as H
from toolkit.distributed import launch, slurm
from toolkit.core.errors import UserError
from toolkit.train.resolve import parse_train_config

SLURM_KEYS = (
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_NNODES",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
)
TORCHRUN_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


@pytest.fixture
def clean_env(monkeypatch):
    for key in SLURM_KEYS + TORCHRUN_KEYS:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node07", ["node07"]),
        ("node[01-03,07],other", ["node01", "node02", "node03", "node07", "other"]),
        ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a[1],b[003-004]x", ["a1", "b003x", "b004x"]),
    ],
)
def test_nodelist_expands_like_scontrol(nodelist, hosts):
    assert slurm.parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node[a-b]", "node[5-3]"])
def test_bad_nodelist_is_one_line(bad):
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST"):
        slurm.parse_nodelist(bad)


def test_scontrol_is_preferred_when_on_path(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf \'from-scontrol-1\\nfrom-scontrol-2\\n\'\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert slurm.expand_nodelist("node[1-2]") == ["from-scontrol-1", "from-scontrol-2"]
    monkeypatch.setenv("PATH", "/nonexistent")
    assert slurm.expand_nodelist("node[1-2]") == ["node1", "node2"]


def fairseq_layout(env, gpus_per_node, world_size):
    """fairseq's _infer_slurm_init (and distributed_main's spawned ranks): [(rank, device_id)] of this task."""
    nnodes = int(env["SLURM_NNODES"])
    per_node = int(env.get("SLURM_NTASKS_PER_NODE") or int(env["SLURM_NTASKS"]) // nnodes)
    if per_node == 1:
        start = int(env["SLURM_NODEID"]) * gpus_per_node
        return nnodes * gpus_per_node, [(start + i, i) for i in range(min(gpus_per_node, nnodes * gpus_per_node))]
    assert per_node == world_size // nnodes
    return world_size, [(int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"]))]


def plan_ranks(plan):
    return plan.world_size, [
        (int(plan.rank_env(i)["RANK"]), int(plan.rank_env(i)["LOCAL_RANK"])) for i in range(plan.local_procs)
    ]


@pytest.mark.parametrize("task", range(8))
def test_one_task_per_gpu_matches_fairseq(task):
    env = {
        "SLURM_JOB_NODELIST": "gpu[17-18]",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": str(task),
        "SLURM_LOCALID": str(task % 4),
        "SLURM_NODEID": str(task // 4),
    }
    plan = slurm.plan_from_env(12345, 1, gpus=4, environ=env, hostnames=slurm.parse_nodelist)
    assert plan_ranks(plan) == fairseq_layout(env, 4, 8)
    assert plan.rank_env(0)["MASTER_ADDR"] == "gpu17" and plan.rank_env(0)["MASTER_PORT"] == "12345"
    assert plan.local_world_size == 4
    with_tasks_per_node = dict(env, SLURM_NTASKS_PER_NODE="4")
    del with_tasks_per_node["SLURM_NTASKS"]
    assert plan_ranks(slurm.plan_from_env(12345, 8, 4, with_tasks_per_node, slurm.parse_nodelist)) == plan_ranks(plan)


@pytest.mark.parametrize("node", [0, 1, 2])
def test_one_task_per_node_spawns_its_gpus_like_fairseq(node):
    env = {
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_NNODES": "3",
        "SLURM_NTASKS": "3",
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(node),
    }
    plan = slurm.plan_from_env(2000, 1, gpus=8, environ=env, hostnames=slurm.parse_nodelist)
    assert plan_ranks(plan) == fairseq_layout(env, 8, 24)
    assert plan.local_procs == 8 and plan.rank_env(0)["MASTER_ADDR"] == "n1"
    # on CPU: --distributed-world-size split over the nodes
    cpu = slurm.plan_from_env(2000, 6, gpus=0, environ=env, hostnames=slurm.parse_nodelist)
    assert plan_ranks(cpu) == (6, [(2 * node, 0), (2 * node + 1, 1)])


def test_slurm_ignored_without_port_or_under_torchrun():
    env = {
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    assert slurm.plan_from_env(-1, 1, 0, env, slurm.parse_nodelist) is None
    torchrun = dict(env, MASTER_ADDR="h", MASTER_PORT="1", WORLD_SIZE="2", RANK="0")
    assert slurm.plan_from_env(2000, 1, 0, torchrun, slurm.parse_nodelist) is None
    assert slurm.plan_from_env(2000, 1, 0, env, slurm.parse_nodelist) is not None


@pytest.mark.parametrize(
    "env, world, match",
    [
        ({"SLURM_NNODES": "2", "SLURM_NTASKS": "4"}, 8, "srun started 4 tasks"),
        ({"SLURM_NNODES": "2", "SLURM_NTASKS": "3"}, 1, "does not split evenly"),
        ({"SLURM_NNODES": "2", "SLURM_NTASKS": "2"}, 3, "does not split evenly over the job's 2 nodes"),
        ({"SLURM_NTASKS": "2"}, 1, r"\$SLURM_NNODES is not set"),
        ({"SLURM_NNODES": "x", "SLURM_NTASKS": "2"}, 1, "expected an integer"),
    ],
)
def test_inconsistent_layout_is_one_line(env, world, match):
    env = dict(env, SLURM_JOB_NODELIST="n[1-2]", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    with pytest.raises(UserError, match=match):
        slurm.plan_from_env(2000, world, 0, env, slurm.parse_nodelist)


def test_tasks_that_each_see_one_gpu_are_refused():
    """srun --gpus-per-task 1: SLURM_LOCALID would name a GPU the task cannot see."""
    env = {
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "3",
    }
    with pytest.raises(UserError, match="each sees 1 GPU"):
        slurm.plan_from_env(2000, 1, 1, env, slurm.parse_nodelist)
    assert slurm.plan_from_env(2000, 1, 4, env, slurm.parse_nodelist).rank_env(0)["LOCAL_RANK"] == "3"


def fake_gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize(
    "gpus, given, cpu, want",
    [
        (4, False, False, 4),
        (1, False, False, None),
        (0, False, False, None),
        (4, True, False, None),
        (4, False, True, None),
    ],
)
def test_default_world_size_is_every_visible_gpu(clean_env, gpus, given, cpu, want):
    fake_gpus(clean_env, gpus)
    assert launch.default_world_size(given, cpu, port=-1) == want


def test_default_world_size_leaves_torchrun_and_slurm_alone(clean_env):
    fake_gpus(clean_env, 4)
    clean_env.setenv("SLURM_JOB_NODELIST", "n1")
    assert launch.default_world_size(False, False, port=-1) == 4  # Slurm needs --distributed-port, as fairseq
    assert launch.default_world_size(False, False, port=2000) is None
    for key, value in (("WORLD_SIZE", "2"), ("RANK", "0")):
        clean_env.setenv(key, value)
    assert launch.default_world_size(False, False, port=-1) is None


def test_resolver_spawns_one_process_per_gpu_with_one_info_line(clean_env, caplog):
    fake_gpus(clean_env, 3)
    with caplog.at_level("INFO", logger="toolkit.resolve"):
        cfg = parse_train_config(["data-bin", "--max-update", "1"])
    assert cfg.distributed.distributed_world_size == 3
    assert sum("using all 3 visible GPUs" in r.getMessage() for r in caplog.records) == 1
    assert parse_train_config(["data-bin", "--max-update", "1", "--cpu"]).distributed.distributed_world_size == 1
    assert parse_train_config(["data-bin", "--distributed-world-size", "2"]).distributed.distributed_world_size == 2


def test_launchers_on_other_nodes_join_the_first_nodes_store():
    """One task per node: node 0's launcher hosts the store, the others connect to it (abort messages)."""
    port = H.free_port()
    host = launch._host_store("127.0.0.1", port, 30.0)
    other = launch._host_store("127.0.0.1", port, 30.0, client=True)
    other.set("from-node-1", "hello")
    assert host.get("from-node-1") == b"hello"
