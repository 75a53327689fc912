"""Mixed precision: --fp16 dynamic loss scaling (fairseq's semantics and log lines), the minimum-scale
stop, --memory-efficient-fp16 (fp16 weights, fp32 optimizer state), --bf16, the CPU warning, the
--cpu-offload flag combinations, adam <-> cpu_adam checkpoints, and overflow agreement across 2 ranks.

Also a worker program for the 2-rank tests (each rank runs toolkit-train with a test-only fault)::

    python -m tests.test_fp16 worker {shard|loss} UPDATE -- TRAIN_ARGS...
"""
from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from tests.lm_fixtures import make_data_bin
from tests.train_helpers import LOG_LINE, REPO_ROOT, train
from toolkit.optim import build_optimizer
from toolkit.optim.fp16 import MemoryEfficientFP16, grad_norm_fp32
from toolkit.optim.loss_scaler import DynamicLossScaler

HUGE_SCALE = 2 ** 40  # fp16 gradients overflow at this loss scale: forced overflows
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


# --------------------------------------------------------------------------- units

SHAPES = [(7, 5), (5,), (13, 3), (4,), (6, 6)]
OPTIMIZERS = {
    "adam": dict(optimizer="adam", lr=0.01, weight_decay=0.1, adam_betas="(0.9, 0.98)", adam_eps=1e-8),
    "sgd": dict(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
    "cpu_adam": dict(optimizer="cpu_adam", lr=0.01, weight_decay=0.1, adam_betas="(0.9, 0.98)", adam_eps=1e-8),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_memory_efficient_step_is_fp32_math_on_fp16_weights(name):
    """Chunked fp32 steps over fp16 weights == the optimizer on fp32 copies, rounded to fp16 after each step."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    p16 = [torch.nn.Parameter(t.half()) for t in init]
    ref = [torch.nn.Parameter(t.half().float()) for t in init]
    opt = build_optimizer(OPTIMIZERS[name], p16)
    stepper = MemoryEfficientFP16(opt, chunk_numel=40)  # several chunks
    assert len(stepper._chunks(p16)) > 2
    ref_opt = build_optimizer(OPTIMIZERS[name], ref)
    factor = 1.0 / 4096  # e.g. world_size / (sample_size * loss_scale)
    for step in range(4):
        grads = [(torch.randn(s, generator=g) * 4096 * (10 ** -step)).half() for s in SHAPES]
        for p, gr in zip(p16, grads):
            p.grad = gr.clone()
        stepper.step(factor)
        for r, gr in zip(ref, grads):
            r.grad = gr.float() * factor
        ref_opt.step()
        with torch.no_grad():
            for r in ref:
                r.copy_(r.half().float())  # the weights live in fp16
        for p, r in zip(p16, ref):
            assert p.dtype == torch.float16 and p.grad is None
            assert torch.equal(p.float(), r), (name, step)
    for p, r in zip(p16, ref):
        for k, v in ref_opt.state[r].items():
            mine = opt.state[p][k]
            if torch.is_tensor(v) and k != "step":
                assert mine.dtype == torch.float32 and torch.equal(mine, v), k


def test_memory_efficient_step_keeps_the_parameters_autograd_identity():
    """Parameters are written in place: storage and gradient hooks (what DDP's all-reduce hangs on) survive."""
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    fired = []
    p.register_post_accumulate_grad_hook(lambda t: fired.append(t.grad.clone()))
    storage = p.untyped_storage().data_ptr()
    stepper = MemoryEfficientFP16(build_optimizer(OPTIMIZERS["adam"], [p]))
    for _ in range(2):
        (p.float() * 2).sum().backward()
        stepper.step(0.5)
    assert len(fired) == 2 and p.untyped_storage().data_ptr() == storage and p.dtype == torch.float16


def test_memory_efficient_small_gradients_do_not_underflow():
    """Unscaling happens in fp32: a gradient that is tiny after unscaling still moves the weight (SGD)."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    stepper = MemoryEfficientFP16(build_optimizer(dict(optimizer="sgd", lr=1.0), [p]))
    p.grad = torch.full((4,), 1024.0, dtype=torch.float16)
    stepper.step(2.0 ** -34)  # 6e-8 after unscaling: fp16 flushes it to 0, fp32 keeps it
    ref = torch.tensor(1.0) - 1024.0 * 2.0 ** -34
    assert torch.equal(p.float(), ref.half().float().expand(4))
    assert (torch.tensor(1024.0, dtype=torch.float16) * torch.tensor(2.0 ** -34, dtype=torch.float16)) == 0


def test_memory_efficient_state_stays_fp32_through_checkpoint_state_dicts():
    """torch casts loaded state to the parameter dtype; the fp32 moments must survive save/load (DCP helpers)."""
    from toolkit.checkpoint.consolidated import FULL_STATE, optimizer_state
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    def model_and_opt(hooks: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)).half()
        opt = build_optimizer(OPTIMIZERS["adam"], list(model.parameters()))
        return model, opt, MemoryEfficientFP16(opt) if hooks else None

    model, opt, stepper = model_and_opt(True)
    for p in model.parameters():
        p.grad = torch.randn(p.shape).half()
    stepper.step(1e-3)
    saved = optimizer_state(model, opt)
    assert all(st["exp_avg"].dtype == torch.float32 for st in saved["state"].values())

    model2, opt2, _ = model_and_opt(True)
    set_optimizer_state_dict(model2, opt2, saved, options=FULL_STATE)
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt2.state[p2][k].dtype == torch.float32
            assert torch.equal(opt2.state[p2][k], opt.state[p][k]), (name, k)
    model3, opt3, _ = model_and_opt(False)  # without the hooks torch would round the moments to fp16
    set_optimizer_state_dict(model3, opt3, saved, options=FULL_STATE)
    assert next(iter(opt3.state.values()))["exp_avg"].dtype == torch.float16


def test_grad_norm_fp32_does_not_overflow_and_flags_inf():
    p = torch.nn.Parameter(torch.zeros(10000, dtype=torch.float16))
    p.grad = torch.full((10000,), 1000.0, dtype=torch.float16)  # norm 1e5 > fp16 max 65504
    assert torch.linalg.vector_norm(p.grad) == math.inf  # an fp16 result overflows: a false "overflow"
    assert float(grad_norm_fp32([p])) == pytest.approx(1e5, rel=1e-5)
    p.grad[3] = float("inf")
    assert not math.isfinite(float(grad_norm_fp32([p])))


def parse_train_args(*argv):
    """toolkit-train's resolved config for these flags (toolkit.train.resolve)."""
    from toolkit.train.resolve import parse_train_config

    return parse_train_config(["data", "--arch", "transformer_lm", "--batch-size", "2", "--max-update", "1", *argv])


@pytest.mark.parametrize("argv,message", [
    (["--ddp-backend", "fully_sharded", "--cpu-offload", "--optimizer", "adam", "--fp16"],
     "--cpu-offload requires --optimizer cpu_adam (the offloaded shards are updated in host memory by "
     "DeepSpeed's CPU Adam), got --optimizer adam; drop --optimizer or use --optimizer cpu_adam"),
    (["--cpu-offload", "--optimizer", "cpu_adam", "--fp16"], "--cpu-offload requires --ddp-backend fully_sharded"),
    (["--cpu-offload"], "--cpu-offload requires --ddp-backend fully_sharded"),
    (["--memory-efficient-fp16", "--bf16"], "--memory-efficient-fp16 and --bf16 conflict; choose one"),
    (["--fp16", "--bf16"], "--fp16 and --bf16 conflict; choose one"),
])
def test_flag_combinations(argv, message):
    from toolkit.core.errors import UserError

    with pytest.raises(UserError) as e:
        parse_train_args(*argv)
    assert str(e.value) == message


def test_valid_flag_combinations():
    for argv in (["--ddp-backend", "fully_sharded", "--cpu-offload", "--optimizer", "cpu_adam", "--fp16"],
                 ["--ddp-backend", "fully_sharded", "--cpu-offload", "--optimizer", "cpu_adam", "--bf16"],
                 ["--fp16", "--fp16-no-flatten-grads", "--fp16-scale-tolerance", "0.25",
                  "--threshold-loss-scale", "1", "--min-loss-scale", "0.001", "--fp16-scale-window", "16"]):
        parse_train_args(*argv)
    cfg = parse_train_args("--memory-efficient-fp16")
    assert cfg.common.fp16  # --memory-efficient-fp16 is fp16 training
    assert cfg.common.fp16_init_scale == 128 and cfg.common.min_loss_scale == 1e-4


# --------------------------------------------------------------------------- CLI, one process

@pytest.fixture(scope="module")
def overflow_run(data_bin, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("overflow"))
    return save, train(data_bin, save, "--fp16", "--fp16-init-scale", str(HUGE_SCALE), "--fp16-scale-window", "2",
                       "--max-update", "8", "--save-interval-updates", "4")


def test_fp16_overflow_skips_update_halves_then_doubles_scale(overflow_run):
    _, run = overflow_run
    evs = events(run.stdout)
    assert evs[0] == ("overflow", "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: "
                                  f"{float(HUGE_SCALE // 2)}")
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
    resumed = train(data_bin, str(tmp_path), "--fp16", "--fp16-init-scale", str(HUGE_SCALE),
                    "--fp16-scale-window", "2", "--max-update", "8",
                    "--restore-file", os.path.join(save, "checkpoint_1_4.pt"))
    assert "loaded checkpoint" in resumed.stdout
    # (as in fairseq, a skipped update at 4 saves checkpoint_1_4.pt again: the resumed run continues from
    # the last save, so its events are the reference's last ones)
    got = events(resumed.stdout)
    expected = events(ref.stdout)[-len(got):]
    assert [k for k, _ in got] == [k for k, _ in expected]  # the same overflows at the same points
    for (kind, mine), (_, theirs) in zip(got, expected):
        if kind == "overflow":
            assert mine == theirs
        else:
            assert mine["num_updates"] == theirs["num_updates"] and mine["loss_scale"] == theirs["loss_scale"]
            assert float(mine["loss"]) == pytest.approx(float(theirs["loss"]), rel=1e-6)
    assert sorted(resumed.losses()) == [5, 6, 7, 8]


def test_min_loss_scale_stops_with_fairseqs_message(data_bin, tmp_path):
    run = train(data_bin, str(tmp_path), "--fp16", "--fp16-init-scale", str(HUGE_SCALE),
                "--min-loss-scale", str(float(HUGE_SCALE // 8)), "--max-update", "3", check=False)
    assert run.returncode == 1
    assert [m for _, m in events(run.stdout)] == [
        f"NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {float(HUGE_SCALE // 2)}",
        f"NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {float(HUGE_SCALE // 4)}"]
    assert run.stderr.strip().splitlines() == [
        f"toolkit-train: error: Minimum loss scale reached ({float(HUGE_SCALE // 8)}). Your loss is probably "
        "exploding. Try lowering the learning rate, using gradient clipping or increasing the batch size."]
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
    resumed = train(data_bin, str(tmp_path / "b"), "--memory-efficient-fp16", "--max-update", "8",
                    "--restore-file", os.path.join(a, "checkpoint_1_4.pt"))
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
        fp16_stats = train(data_bin, save, "--optimizer", "cpu_adam", "--fp16-adam-stats", "--max-update", "9",
                           *flags, check=False)
        assert fp16_stats.returncode == 1 and "run toolkit-consolidate" in fp16_stats.stderr
    sgd = train(data_bin, save, "--optimizer", "sgd", "--max-update", "9", *flags, check=False)
    assert sgd.returncode == 1
    assert sgd.stderr.strip().endswith("optimizer state was saved by --optimizer adam but this run uses "
                                       "--optimizer sgd; add --reset-optimizer to start a fresh optimizer state")


# --------------------------------------------------------------------------- 2 ranks

def run_two_ranks(mode: str, update: int, train_args, timeout: int = 600):
    """Both ranks of a torchrun-style group as subprocesses of this test (rank 1 gets the fault)."""
    from toolkit.distributed.utils import find_free_port

    port = find_free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.test_fp16", "worker", mode, str(update), "--",
                                       *train_args], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
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


@pytest.mark.parametrize("backend,mode,extra", [
    ("fully_sharded", "shard", ["--fp16"]),  # inf in rank 1's local shard only: the DTensor norm is global
    ("c10d", "loss", ["--memory-efficient-fp16"]),  # rank 1's backward overflows: DDP's all-reduce spreads it
], ids=["fully_sharded-fp16", "ddp-memory-efficient-fp16"])
def test_overflow_on_one_rank_is_seen_by_all(data_bin, tmp_path, backend, mode, extra):
    from tests.train_helpers import TINY_MODEL

    args = [data_bin, "--save-dir", str(tmp_path), *TINY_MODEL, "--ddp-backend", backend, *extra,
            "--max-update", "4", "--no-save"]
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


def _worker(mode: str, update: int, argv) -> None:
    """One rank of toolkit-train; rank 1 overflows once, at update ``update``; prints its final state."""
    from toolkit.criterions.cross_entropy import CrossEntropyCriterion
    from toolkit.train.trainer import Trainer
    from toolkit_cli.train import cli_main

    rank = int(os.environ["RANK"])
    box = {"trainer": None, "injected": 0}
    init = Trainer.__init__

    def trainer_init(self, *a, **kw):
        init(self, *a, **kw)
        box["trainer"] = self

    def due() -> bool:
        t = box["trainer"]
        return rank == 1 and not box["injected"] and t is not None and t.num_updates == update - 1

    def poison_shard(orig):
        def wrapped(self, *a, **kw):
            if due():  # after the gradient reduction: only this rank's shard holds the inf
                p = next(p for p in self.model.parameters() if p.grad is not None)
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                local.view(-1)[0] = float("inf")
                box["injected"] = 1
            return orig(self, *a, **kw)
        return wrapped

    forward = CrossEntropyCriterion.forward

    def poisoned_forward(self, model, sample, reduce=True):
        loss, sample_size, logging_output = forward(self, model, sample, reduce)
        if due():  # before the all-reduce: this rank's backward overflows
            box["injected"] = 1
            loss = loss * 1e30
        return loss, sample_size, logging_output

    Trainer.__init__ = trainer_init
    if mode == "shard":
        Trainer._normalize_and_clip = poison_shard(Trainer._normalize_and_clip)
        Trainer._scaled_grad_norm = poison_shard(Trainer._scaled_grad_norm)
    else:
        CrossEntropyCriterion.forward = poisoned_forward
    cli_main(list(argv))
    t = box["trainer"]
    total = sum(float(p.detach().float().sum()) for p in t.model.parameters()
                if not hasattr(p, "to_local"))
    print(f"FINAL rank={rank} injected={box['injected']} num_updates={t.num_updates} "
          f"loss_scale={t.scaler.loss_scale if t.scaler else None} params={total!r}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[1] == "worker" and sys.argv[4] == "--":
        _worker(sys.argv[2], int(sys.argv[3]), sys.argv[5:])
    else:
        sys.exit(__doc__)
