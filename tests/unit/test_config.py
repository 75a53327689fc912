"""One typed configuration: parsed once, implied settings resolved (and logged), validated before any worker."""

import dataclasses
import logging

import pytest

from toolkit.core.errors import UserError
from toolkit.train.resolve import parse_train_config


def test_headline_command_resolves_each_choice_in_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="toolkit.resolve"):
        cfg = parse_train_config(["data-bin/x", "--ddp-backend", "fully_sharded", "--cpu-offload", "--cpu"])
    assert cfg.components.optimizer == "cpu_adam" and cfg.components.arch == "transformer_lm"
    assert not cfg.common.fp16 and not cfg.common.bf16  # fp32 on CPU: offloading is a placement no-op
    assert cfg.dataset.max_tokens == max(4096, 2 * cfg.task.tokens_per_sample)
    assert type(cfg.optimizer).__name__ == "CPUAdamConfig"  # the implied optimizer's own options exist
    lines = [r.getMessage() for r in caplog.records if r.name == "toolkit.resolve" and r.levelno == logging.INFO]
    assert lines[:4] == [
        "--arch not given: using --arch transformer_lm",
        "--cpu-offload: using --optimizer cpu_adam",
        "--cpu-offload: no GPU in use, so training runs in fp32 (parameters and optimizer state are already "
        "in host memory)",
        "--max-tokens and --batch-size not given: using --max-tokens 4096",
    ]


def test_batch_size_default_follows_long_models():
    cfg = parse_train_config(["d", "--tokens-per-sample", "4096"])
    assert cfg.dataset.max_tokens == 8192
    assert parse_train_config(["d", "--batch-size", "3"]).dataset.max_tokens is None  # given: nothing implied


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ddp-backend", "fully_sharded", "--cpu-offload", "--optimizer", "sgd"], "got --optimizer sgd"),
        (["--tokens-per-sample", "256", "--max-target-positions", "128"], "--max-target-positions is 128"),
        (["--update-freq", "0"], "--update-freq must be >= 1"),
    ],
)
def test_explicit_conflicts_are_errors(argv, message):
    with pytest.raises(UserError, match=message):
        parse_train_config(["d", *argv])


def test_config_is_typed_sections_frozen_and_saved_flat():
    cfg = parse_train_config(["d", "--arch", "transformer_lm_gpt2_tiny", "--lr", "0.01", "--max-update", "5"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.common = None
    assert cfg.model.decoder_layers == 2 and cfg.optimization.lr == 0.01
    flat = cfg.to_dict()
    assert flat["arch"] == "transformer_lm_gpt2_tiny" and flat["decoder_layers"] == 2 and flat["max_update"] == 5
    assert all(isinstance(v, (str, int, float, bool, type(None), list, tuple)) for v in flat.values())


def test_the_start_up_line_lists_only_options_off_their_defaults(tmp_path):
    """toolkit-train logs its configuration as one readable line: the components, then per section the options a
    user (or an implied value) changed, not the hundreds at their defaults."""
    cfg = parse_train_config([str(tmp_path), "--arch", "transformer_lm", "--lr", "0.003", "--max-update", "7"])
    line = cfg.summary()
    assert "arch=transformer_lm" in line and "max_update=7" in line and "lr=0.003" in line
    assert "seed=" not in line and "clip_norm" not in line and len(line) < 1000, line


def test_context_parallelism_and_rope_scaling_are_said_at_start_up(tmp_path):
    from toolkit.train.train_loop import long_context_lines

    argv = [str(tmp_path), "--arch", "llama_tiny", "--tokens-per-sample", "64", "--rope-scaling-factor", "4"]
    cfg = parse_train_config(
        argv
        + [
            "--rope-scaling",
            "yarn",
            "--rope-original-max-positions",
            "16",
            "--context-parallel-size",
            "2",
            "--distributed-world-size",
            "2",
        ]
    )
    cp, rope = long_context_lines(cfg)
    assert "cut into 4 chunks of 16" in cp and "gathered from the 2 ranks" in cp
    assert "yarn, factor 4: a context of 16 positions stretched to 64" in rope and "attention factor 1.139" in rope
    assert long_context_lines(parse_train_config([str(tmp_path), "--arch", "llama_tiny"])) == []
