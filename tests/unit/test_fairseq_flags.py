"""fairseq's training flags of issue 11 item 4: parsed under fairseq's names, with fairseq's effect.

Parse-level checks use ``parse_train_config`` in process; the effects on a run use tiny
``toolkit-train`` runs (a few updates) on a slice of WikiText.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from toolkit.checkpoint import best_checkpoints, finetune
from toolkit.checkpoint.common import BestTracker, checkpoint_names
from toolkit.config import CheckpointConfig, EMAConfig
from toolkit.train.ema import EMA
from toolkit.core.errors import UserError
from toolkit.config.flag_types import for_epoch
from toolkit.train.resolve import parse_train_config


def parse(*flags: str):
    return parse_train_config(["data-bin", "--max-update", "1", *flags])


def infos(caplog, *flags: str):
    with caplog.at_level(logging.INFO, logger="toolkit.resolve"):
        caplog.clear()
        cfg = parse(*flags)
    return cfg, [r.getMessage() for r in caplog.records if r.name == "toolkit.resolve"]


@pytest.mark.parametrize("given, ours", [("pytorch_ddp", "c10d"), ("legacy_ddp", "no_c10d"), ("no_c10d", "no_c10d")])
def test_ddp_backend_aliases(caplog, given, ours):
    cfg, lines = infos(caplog, "--ddp-backend", given)
    assert cfg.distributed.ddp_backend == ours
    assert sum(f"--ddp-backend {given}" in line for line in lines) == (given != ours)


def test_ddp_only_flags_say_when_they_do_nothing(caplog):
    cfg, lines = infos(caplog, "--find-unused-parameters", "--bucket-cap-mb", "50")
    assert (cfg.distributed.find_unused_parameters, cfg.distributed.bucket_cap_mb) == (True, 50)
    assert not any("no effect" in line for line in lines)  # c10d: DDP takes them
    for backend in ("fully_sharded", "legacy_ddp"):
        _, lines = infos(caplog, "--ddp-backend", backend, "--find-unused-parameters")
        assert sum("--find-unused-parameters: accepted, no effect" in line for line in lines) == 1
    with pytest.raises(UserError, match="--bucket-cap-mb"):
        parse("--bucket-cap-mb", "0")


@pytest.mark.parametrize("flag", ["--local-rank", "--local_rank", "--device-id"])
def test_local_rank_from_torch_distributed_launch(caplog, monkeypatch, flag):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg, lines = infos(caplog, f"{flag}=1")
    assert cfg.distributed.device_id == 1 and not any("LOCAL_RANK" in line for line in lines)
    monkeypatch.setenv("LOCAL_RANK", "0")
    _, lines = infos(caplog, flag, "1")
    assert sum("using LOCAL_RANK" in line for line in lines) == 1


def test_validation_flags_parse():
    cfg = parse(
        "--max-sentences-valid",
        "3",
        "--skip-invalid-size-inputs-valid-test",
        "--combine-val",
        "--fixed-validation-seed",
        "7",
        "--validate-after-updates",
        "5",
    )
    data = cfg.dataset
    assert (
        data.batch_size_valid,
        data.skip_invalid_size_inputs_valid_test,
        data.combine_valid_subsets,
        data.fixed_validation_seed,
        data.validate_after_updates,
    ) == (3, True, True, 7, 5)


def test_lr_list_is_one_value_per_epoch_under_fixed(caplog):
    from toolkit.optim.lr_scheduler import build_lr_scheduler_from_section

    cfg = parse("--lr", "0.1,0.05,0.01", "--lr-scheduler", "fixed")
    assert cfg.optimization.lr == 0.1 and cfg.optimization.lr_per_epoch == (0.1, 0.05, 0.01)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optimization.lr)
    sched = build_lr_scheduler_from_section("fixed", cfg.lr_scheduler, opt)
    lrs = cfg.optimization.lr_per_epoch
    for epoch in range(1, 6):  # fairseq's FixedLRSchedule: lrs[min(epoch - 1, len(lrs) - 1)]
        assert sched.step_begin_epoch(epoch) == pytest.approx(lrs[min(epoch - 1, len(lrs) - 1)])
    annealed = parse("--lr", "0.1,0.05", "--lr-scheduler", "fixed", "--force-anneal", "2", "--lr-shrink", "0.5")
    sched = build_lr_scheduler_from_section("fixed", annealed.lr_scheduler, opt)
    assert sched.step_begin_epoch(3) == pytest.approx(0.05 * 0.5 ** (3 + 1 - 2))
    assert parse("--lr", "0.1").optimization.lr_per_epoch == (0.1,)
    with pytest.raises(UserError, match="--lr-scheduler fixed"):
        parse("--lr", "0.1,0.05", "--lr-scheduler", "inverse_sqrt")
    cfg, lines = infos(caplog, "--lr", "0.1,0.05", "--lr-scheduler", "polynomial_decay", "--total-num-update", "9")
    assert cfg.lr_scheduler.lr == 0.1 and sum("uses the first value" in line for line in lines) == 1


def test_update_freq_list():
    cfg = parse("--update-freq", "2,4")
    assert cfg.optimization.update_freq == 2 and cfg.optimization.update_freq_per_epoch == (2, 4)
    assert [for_epoch((2, 4), e) for e in (1, 2, 3, 7)] == [2, 4, 4, 4]  # fairseq: the last value repeats
    with pytest.raises(UserError, match="--update-freq"):
        parse("--update-freq", "2,0")


def test_amp_on_cpu_trains_in_fp32(caplog):
    cfg, lines = infos(caplog, "--amp", "--cpu")
    assert cfg.common.amp and not cfg.common.fp16 and not cfg.common.bf16
    assert sum(line.startswith("--amp: no GPU in use") for line in lines) == 1


def test_store_ema_flags_and_refusals():
    cfg = parse("--store-ema", "--ema-decay", "0.99", "--ema-start-update", "3", "--ema-update-freq", "2", "--ema-fp32")
    assert cfg.ema == EMAConfig(store_ema=True, ema_decay=0.99, ema_start_update=3, ema_update_freq=2, ema_fp32=True)
    assert parse("--store-ema", "--ddp-backend", "fully_sharded").ema.store_ema  # each rank averages its shards
    assert parse("--store-ema", "--ddp-backend", "fully_sharded", "--use-sharded-state").ema.store_ema  # DCP entries


def test_launch_retry_and_ema_seed_flags_parse_under_fairseqs_names(caplog, tmp_path):
    """The flags of issue 11's last items (their effects: test_slurm, test_amp_retries, test_ema_seed)."""
    seed = tmp_path / "seed.pt"
    seed.write_bytes(b"")
    cfg, lines = infos(
        caplog, "--amp-batch-retries", "4", "--store-ema", "--ema-seed-model", str(seed), "--distributed-port", "12345"
    )
    assert (cfg.common.amp_batch_retries, cfg.ema.ema_seed_model, cfg.distributed.distributed_port) == (
        4,
        str(seed),
        12345,
    )
    assert sum("--amp-batch-retries 4: accepted, no effect without --amp" in line for line in lines) == 1
    assert parse().common.amp_batch_retries == 2  # fairseq's default


def test_finetune_and_restore_file_rules(tmp_path):
    with pytest.raises(UserError, match="--restore-file"):
        parse("--finetune-from-model", "a.pt", "--restore-file", "b.pt")
    with pytest.raises(UserError, match="--reset-optimizer"):
        parse("--finetune-from-model", "a.pt", "--reset-optimizer")
    cfg = CheckpointConfig(save_dir=str(tmp_path / "save"), restore_file="x/ckpt.pt")
    assert finetune.restore_path(cfg) == "x/ckpt.pt"  # relative to the working directory, as in fairseq
    assert finetune.restore_path(CheckpointConfig(save_dir="s")) == os.path.join("s", "checkpoint_last.pt")
    pretrained = tmp_path / "pre.pt"
    pretrained.write_bytes(b"")
    cfg = CheckpointConfig(save_dir="s", finetune_from_model=str(pretrained))
    assert finetune.choose(cfg, last_exists=False) == (str(pretrained), True)
    assert finetune.choose(cfg, last_exists=True) == (os.path.join("s", "checkpoint_last.pt"), False)


def test_ema_follows_fairseq_formula():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, EMAConfig(store_ema=True, ema_decay=0.9, ema_start_update=2, ema_update_freq=2))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for update in range(1, 7):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.step(model, update)
        if update % 2 == 0:  # every --ema-update-freq updates; decay 0 before --ema-start-update
            decay = 0.0 if update < 2 else 0.9
            expected = {k: decay * expected[k] + (1 - decay) * v for k, v in model.state_dict().items()}
        for k, v in ema.state_dict().items():
            torch.testing.assert_close(v, expected[k])
    target = torch.nn.Linear(3, 2)
    ema.copy_to(target)
    torch.testing.assert_close(target.weight, expected["weight"])


def test_ema_fp32_keeps_an_fp32_average_of_half_weights():
    model = torch.nn.Linear(4, 4).half()
    ema = EMA(model, EMAConfig(store_ema=True, ema_decay=0.5, ema_fp32=True))
    start = ema.state_dict()["weight"].clone()
    with torch.no_grad():
        model.weight.add_(0.001)
    ema.step(model, 1)
    assert ema.state_dict()["weight"].dtype == torch.float32
    torch.testing.assert_close(ema.state_dict()["weight"], 0.5 * start + 0.5 * model.weight.float())


def test_keep_best_checkpoint_names_and_pruning(tmp_path):
    cfg = CheckpointConfig(save_dir=str(tmp_path), keep_best_checkpoints=2)
    # fairseq: "checkpoint.best_{metric}_{val:.3f}{digit}.pt", digit from numpy_seed(epoch, updates, val)
    digit = np.random.RandomState(int(hash((1, 10, 3.25)) % 1e6)).randint(0, 2)
    assert best_checkpoints.best_name(cfg, 1, 10, 3.25) == f"checkpoint.best_loss_3.250{digit}.pt"
    best = BestTracker(maximize=False)
    for updates, loss in enumerate([5.0, 4.0, 4.5, 3.0, 6.0], start=1):
        for name in checkpoint_names(cfg, 1, False, updates, loss, best):
            if name.startswith("checkpoint.best"):
                (tmp_path / name).write_bytes(b"")
        best_checkpoints.prune_best(cfg)
        best.update(loss)
    kept = sorted(os.listdir(tmp_path))
    assert [name[len("checkpoint.best_loss_") :][:5] for name in kept] == ["3.000", "4.000"]


@pytest.mark.parametrize("break_mode", ["none", "eos"])
def test_combine_val_concatenates_numbered_valid_splits(tmp_path, break_mode):
    """fairseq's --combine-val: valid, valid1, valid2 read as one split, blocks crossing their boundaries."""
    from tests.helpers.lm_fixtures import make_data_bin
    from toolkit.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask

    train_lines = ["the cat sat on the mat", "a dog ran far away"] * 4
    parts = [["the cat sat", "a dog"], ["ran far away now", "the mat"], ["a cat ran"]]
    combined, one = str(tmp_path / "combined"), str(tmp_path / "one")
    make_data_bin(
        combined, {"train": train_lines, "valid": parts[0], "valid1": parts[1], "valid2": parts[2], "valid4": parts[0]}
    )  # valid3 missing: valid4 is not read, as in fairseq
    make_data_bin(one, {"train": train_lines, "valid": [line for p in parts for line in p]})

    def samples(data: str, combine: bool):
        task = LanguageModelingTask.setup_task(
            LanguageModelingConfig(data=data, tokens_per_sample=5, sample_break_mode=break_mode)
        )
        ds = task.load_dataset("valid", combine=combine)
        return [(ds[i]["source"].tolist(), ds[i]["target"].tolist()) for i in range(len(ds))]

    assert samples(combined, True) == samples(one, False)
    assert len(samples(combined, False)) < len(samples(one, False))


@pytest.mark.parametrize(
    "arch, given, expected",
    [
        # What real fairseq 0.12.2 builds (options.parse_args_and_arch + convert_namespace_to_omegaconf, cfg.model):
        # --arch transformer_lm is the config's defaults (a no-op arch): post-norm, 512-wide input/output.
        ("transformer_lm", {"decoder_embed_dim": 64}, (64, 512, 512, False)),
        ("transformer_lm_gpt", {}, (768, None, None, True)),  # None: follows --decoder-embed-dim (768 in fairseq)
        ("transformer_lm_gpt", {"decoder_embed_dim": 64}, (64, None, None, True)),
        ("transformer_lm", {"decoder_normalize_before": True, "decoder_input_dim": 64}, (512, 64, 512, True)),
    ],
)
def test_transformer_lm_arch_defaults_are_fairseqs(arch, given, expected):
    import toolkit.models.transformer_lm  # noqa: F401  (registers the archs)
    from toolkit.options import architecture_defaults

    d = architecture_defaults(arch, given)
    got = (d["decoder_embed_dim"], d["decoder_input_dim"], d["decoder_output_dim"], d["decoder_normalize_before"])
    assert got == expected
