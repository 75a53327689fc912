"""Mixed precision: --fp16 dynamic loss scaling (fairseq's semantics and log lines), the minimum-scale
stop, --memory-efficient-fp16 (fp16 weights, fp32 optimizer state), --bf16, the CPU warning, the
--cpu-offload flag combinations, adam <-> cpu_adam checkpoints, and overflow agreement across 2 ranks.
The 2-rank tests run each rank as tests/helpers/fp16_worker.py (toolkit-train with a test-only fault).
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO_ROOT, free_port
from tests.helpers.cli import LOG_LINE, train
from tests.helpers.lm_fixtures import make_data_bin
from toolkit.optim.loss_scaler import DynamicLossScaler

HUGE_SCALE = 2**40  # fp16 gradients overflow at this loss scale: forced overflows
SLOW_WARNING = "compute works but is much slower than fp32 on most CPUs"


def markov_lines(n: int, seed: int = 0):
    """Lines of a 40-word Markov chain with two successors per word: a tiny model learns it within updates."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        w, words = rng.randrange(40), []
        for _ in range(rng.randint(5, 25)):
            words.append(f"w{w}")
            w = (w * 7 + rng.choice((1, 2))) % 40
        lines.append(" ".join(words))
    return lines


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    dest = tmp_path_factory.mktemp("fp16-bin")
    make_data_bin(str(dest), {"train": markov_lines(300), "valid": markov_lines(30, seed=1)})
    return str(dest)


def events(stdout: str):
    """('overflow', message) and ('update', train_inner record) in log order."""
    out = []
    for line in stdout.splitlines():
        m = LOG_LINE.match(line)
        if not m:
            continue
        if m.group(4).startswith("NOTE: gradient overflow detected"):
            out.append(("overflow", m.group(4)))
        elif m.group(3) == "train_inner":
            import json

            out.append(("update", json.loads(m.group(4))))
    return out


@pytest.fixture(scope="module")
def overflow_run(data_bin, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("overflow"))
    return save, train(
        data_bin,
        save,
        "--fp16",
        "--fp16-init-scale",
        str(HUGE_SCALE),
        "--fp16-scale-window",
        "2",
        "--max-update",
        "8",
        "--save-interval-updates",
        "4",
    )


def test_fp16_overflow_skips_update_halves_then_doubles_scale(overflow_run):
    _, run = overflow_run
    evs = events(run.stdout)
    assert evs[0] == (
        "overflow",
        f"NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {float(HUGE_SCALE // 2)}",
    )
    # Replay fairseq's scaler on the logged sequence: every NOTE line and every logged loss_scale agrees.
    scaler = DynamicLossScaler(init_scale=HUGE_SCALE, scale_window=2)
    updates, doubled, skipped = [], False, 0
    for kind, value in evs:
        if kind == "overflow":
            with pytest.raises(OverflowError) as e:
                scaler.check_overflow(float("inf"))
            assert value == f"NOTE: gradient overflow detected, ignoring gradient, {e.value}"
            skipped += 1
        else:
            before = scaler.loss_scale
            scaler.update()
            doubled |= scaler.loss_scale == 2 * before
            assert float(value["loss_scale"]) == scaler.loss_scale
            updates.append(int(value["num_updates"]))
    assert updates == list(range(1, 9))  # skipped updates do not count
    assert skipped >= 20 and doubled  # halved from 2**40 down to a workable scale, then doubled after 2 clean ones
    assert sum(SLOW_WARNING in line for line in run.stdout.splitlines()) == 1
    assert "WARNING | toolkit.optim.fp16 | --fp16 on CPU: float16 compute works" in run.stdout
    losses = run.losses()
    assert losses[8] < losses[1]


def test_fp16_resume_restores_the_loss_scaler(data_bin, overflow_run, tmp_path):
    save, ref = overflow_run
    state = torch.load(os.path.join(save, "checkpoint_1_4.pt"), map_location="cpu", weights_only=True)
    assert state["extra_state"]["trainer"]["loss_scaler"]["loss_scale"] > 0
    resumed = train(
        data_bin,
        str(tmp_path),
        "--fp16",
        "--fp16-init-scale",
        str(HUGE_SCALE),
        "--fp16-scale-window",
        "2",
        "--max-update",
        "8",
        "--restore-file",
        os.path.join(save, "checkpoint_1_4.pt"),
    )
    assert "loaded checkpoint" in resumed.stdout
    # (as in fairseq, a skipped update at 4 saves checkpoint_1_4.pt again: the resumed run continues from
    # the last save, so its events are the reference's last ones)
    got = events(resumed.stdout)
    expected = events(ref.stdout)[-len(got) :]
    assert [k for k, _ in got] == [k for k, _ in expected]  # the same overflows at the same points
    for (kind, mine), (_, theirs) in zip(got, expected):
        if kind == "overflow":
            assert mine == theirs
        else:
            assert mine["num_updates"] == theirs["num_updates"] and mine["loss_scale"] == theirs["loss_scale"]
            assert float(mine["loss"]) == pytest.approx(float(theirs["loss"]), rel=1e-6)
    assert sorted(resumed.losses()) == [5, 6, 7, 8]


def test_min_loss_scale_stops_with_fairseqs_message(data_bin, tmp_path):
    run = train(
        data_bin,
        str(tmp_path),
        "--fp16",
        "--fp16-init-scale",
        str(HUGE_SCALE),
        "--min-loss-scale",
        str(float(HUGE_SCALE // 8)),
        "--max-update",
        "3",
        check=False,
    )
    assert run.returncode == 1
    assert [m for _, m in events(run.stdout)] == [
        f"NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {float(HUGE_SCALE // 2)}",
        f"NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {float(HUGE_SCALE // 4)}",
    ]
    assert run.stderr.strip().splitlines() == [
        f"toolkit-train: error: Minimum loss scale reached ({float(HUGE_SCALE // 8)}). Your loss is probably "
        "exploding. Try lowering the learning rate, using gradient clipping or increasing the batch size."
    ]
    assert not os.path.exists(os.path.join(str(tmp_path), "checkpoint_last.pt"))


def test_bf16_trains_without_loss_scale(data_bin, tmp_path):
    run = train(data_bin, str(tmp_path), "--bf16", "--max-update", "8")
    losses = run.losses()
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1] - 0.3, losses
    assert all("loss_scale" not in r for r in run.records("train_inner"))
    assert "NOTE: gradient overflow" not in run.stdout
    assert sum(SLOW_WARNING in line for line in run.stdout.splitlines()) == 1
    assert "--bf16 on CPU: bfloat16 compute works" in run.stdout


def test_memory_efficient_fp16_trains_resumes_and_keeps_fp32_state(data_bin, tmp_path):
    a = str(tmp_path / "a")
    first = train(data_bin, a, "--memory-efficient-fp16", "--max-update", "8", "--save-interval-updates", "4")
    losses = first.losses()
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1] - 0.3, losses
    assert all(r["loss_scale"] == "128" for r in first.records("train_inner"))
    assert "--memory-efficient-fp16 on CPU" in first.stdout
    state = torch.load(os.path.join(a, "checkpoint_1_4.pt"), map_location="cpu", weights_only=True)
    assert {v.dtype for v in state["model"].values()} == {torch.float16}  # no fp32 copy of the weights
    moments = [st["exp_avg_sq"] for st in state["last_optimizer_state"]["state"].values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    resumed = train(
        data_bin,
        str(tmp_path / "b"),
        "--memory-efficient-fp16",
        "--max-update",
        "8",
        "--restore-file",
        os.path.join(a, "checkpoint_1_4.pt"),
    )
    assert sorted(resumed.losses()) == [5, 6, 7, 8]
    for update in (5, 6, 7, 8):
        assert resumed.losses()[update] == pytest.approx(losses[update], rel=1e-6), update
    # fp16 weights with fp32 updates track --fp16 (fp32 master weights) closely on a short run
    fp16 = train(data_bin, str(tmp_path / "c"), "--fp16", "--max-update", "8", "--no-save")
    for update in range(1, 9):
        assert losses[update] == pytest.approx(fp16.losses()[update], rel=2e-3), update


def test_memory_efficient_fp16_accumulates_micro_batches_like_fp16(data_bin, tmp_path):
    # --update-freq 2: the fp16 gradients of two micro-batches add up (scaled) before the fp32 step
    args = ("--update-freq", "2", "--max-update", "6", "--no-save")
    mefp16 = train(data_bin, str(tmp_path / "me"), "--memory-efficient-fp16", *args)
    fp16 = train(data_bin, str(tmp_path / "fp16"), "--fp16", *args)
    assert sorted(mefp16.losses()) == list(range(1, 7))
    for update in range(1, 7):
        assert mefp16.losses()[update] == pytest.approx(fp16.losses()[update], rel=2e-3), update
    assert [r["bsz"] for r in mefp16.records("train_inner")] == [r["bsz"] for r in fp16.records("train_inner")]


@pytest.mark.parametrize("layout", ["consolidated", "sharded"])
def test_adam_and_cpu_adam_checkpoints_resume_each_other(data_bin, tmp_path, layout):
    save = str(tmp_path / "switch")
    flags = ["--ddp-backend", "fully_sharded", "--use-sharded-state"] if layout == "sharded" else []
    train(data_bin, save, "--max-update", "3", *flags)
    if layout == "sharded":
        assert os.path.isdir(os.path.join(save, "checkpoint_last"))
    to_cpu_adam = train(data_bin, save, "--optimizer", "cpu_adam", "--max-update", "6", *flags)
    assert "optimizer state of --optimizer adam loaded into --optimizer cpu_adam" in to_cpu_adam.stdout
    back = train(data_bin, save, "--optimizer", "adam", "--max-update", "8", *flags)
    assert "optimizer state of --optimizer cpu_adam loaded into --optimizer adam" in back.stdout
    assert sorted(back.losses()) == [7, 8]
    # the moments really carried over: the same as never switching (DeepSpeed's AdamW == torch's up to rounding)
    straight = train(data_bin, str(tmp_path / "straight"), "--max-update", "8", "--no-save", *flags)
    for update in (4, 5, 6):
        assert to_cpu_adam.losses()[update] == pytest.approx(straight.losses()[update], rel=1e-4), update
    for update in (7, 8):
        assert back.losses()[update] == pytest.approx(straight.losses()[update], rel=1e-4), update
    if layout == "sharded":
        fp16_stats = train(
            data_bin, save, "--optimizer", "cpu_adam", "--fp16-adam-stats", "--max-update", "9", *flags, check=False
        )
        assert fp16_stats.returncode == 1 and "run toolkit-consolidate" in fp16_stats.stderr
    sgd = train(data_bin, save, "--optimizer", "sgd", "--max-update", "9", *flags, check=False)
    assert sgd.returncode == 1
    assert sgd.stderr.strip().endswith(
        "optimizer state was saved by --optimizer adam but this run uses "
        "--optimizer sgd; add --reset-optimizer to start a fresh optimizer state"
    )


def run_two_ranks(mode: str, update: int, train_args, timeout: int = 600):
    """Both ranks of a torchrun-style group as subprocesses of this test (rank 1 gets the fault)."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=REPO_ROOT,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.fp16_worker", "worker", mode, str(update), "--", *train_args],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    for code, out, err in outs:
        assert code == 0, f"{out[-3000:]}\n{err[-3000:]}"
    return outs


def finals(outs):
    result = []
    for _, out, _ in outs:
        m = re.search(r"^FINAL (.*)$", out, re.M)
        assert m, out[-2000:]
        result.append(dict(kv.split("=") for kv in m.group(1).split()))
    return result


@pytest.mark.parametrize(
    "backend,mode,extra",
    [
        ("fully_sharded", "shard", ["--fp16"]),  # inf in rank 1's local shard only: the DTensor norm is global
        ("c10d", "loss", ["--memory-efficient-fp16"]),  # rank 1's backward overflows: DDP's all-reduce spreads it
    ],
    ids=["fully_sharded-fp16", "ddp-memory-efficient-fp16"],
)
def test_overflow_on_one_rank_is_seen_by_all(data_bin, tmp_path, backend, mode, extra):
    from tests.helpers.cli import TINY_MODEL

    args = [
        data_bin,
        "--save-dir",
        str(tmp_path),
        *TINY_MODEL,
        "--ddp-backend",
        backend,
        *extra,
        "--max-update",
        "4",
        "--no-save",
    ]
    outs = run_two_ranks(mode, 2, args)
    rank0 = outs[0][1]
    evs = events(rank0)
    assert [k for k, _ in evs] == ["update", "overflow", "update", "update", "update"], evs
    assert evs[1][1] == "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 64.0"
    assert [r["loss_scale"] for k, r in evs if k == "update"] == ["128", "64", "64", "64"]
    f0, f1 = finals(outs)
    assert f0["injected"] == "0" and f1["injected"] == "1"
    assert f0["num_updates"] == f1["num_updates"] == "4" and f0["loss_scale"] == f1["loss_scale"] == "64.0"
    if backend == "c10d":
        assert f0["params"] == f1["params"]  # replicas stayed identical: both skipped the same update
