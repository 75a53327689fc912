"""A flag from another tool (HF Trainer, Megatron, torchtitan, nanoGPT) is answered with this toolkit's name for it,
on the one error line, and only with flags the command has."""

import importlib
import re

import pytest

from toolkit.config.foreign_flags import FOREIGN, explain_unrecognized


def _error_line(module: str, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).cli_main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--max-steps", "10"], "--max-steps: use --max-update here"),
        (["--gradient-accumulation-steps", "2"], "--gradient-accumulation-steps: use --update-freq here"),
        (["--seq-len", "2048"], "--seq-len: use --tokens-per-sample here"),
        (["--micro-batch-size", "4"], "--micro-batch-size: use --batch-size here"),
        (["--z-loss", "1e-4"], "--z-loss: use --z-loss-coef here"),
        (["--ep", "2"], "--ep: use --expert-parallel-size here"),
        (["--max_update", "3"], "--max_update: use --max-update here"),
        (["--fsdp"], "--fsdp: use --ddp-backend fully_sharded here"),
        (["--lrr", "3"], "--lrr: did you mean --lr?"),
    ],
)
def test_train_names_its_own_flag_for_a_foreign_one(argv, hint, capsys, tmp_path):
    err = _error_line("toolkit_cli.train", [str(tmp_path), *argv], capsys)
    assert "unrecognized arguments" in err and hint in err, err


def test_a_flag_the_command_lacks_is_not_offered(capsys, tmp_path):
    """eval-lm has no --max-update: --max-steps there stays argparse's plain refusal."""
    err = _error_line("toolkit_cli.eval_lm", [str(tmp_path), "--path", "x.pt", "--max-steps", "3"], capsys)
    assert "unrecognized arguments: --max-steps 3" in err and "--max-update" not in err, err


def test_generation_takes_transformers_spellings(capsys, tmp_path):
    err = _error_line("toolkit_cli.generate", [str(tmp_path), "--path", "x.pt", "--num-beams", "5"], capsys)
    assert "--num-beams: use --beam here" in err, err


def _help(module: str, argv, capsys) -> str:
    with pytest.raises(SystemExit):
        importlib.import_module(module).cli_main([*argv, "--help"])
    return capsys.readouterr().out


def test_every_target_is_a_real_flag_of_some_command(capsys, tmp_path):
    """The table names flags that exist: each target is in the help of train (a MoE arch, so its options show),
    generate or eval-lm."""
    shown = "".join(
        _help(module, argv, capsys)
        for module, argv in [
            ("toolkit_cli.train", [str(tmp_path), "--arch", "olmoe_tiny"]),
            ("toolkit_cli.generate", [str(tmp_path)]),
            ("toolkit_cli.eval_lm", [str(tmp_path)]),
        ]
    )
    flags = set(re.findall(r"--[a-z0-9-]+", shown))
    missing = sorted({ours for ours, _ in FOREIGN.values()} - flags)
    assert not missing, missing


def test_other_messages_pass_through():
    assert explain_unrecognized("argument --lr: invalid float value: 'x'", ["--lr"]) == (
        "argument --lr: invalid float value: 'x'"
    )
    assert explain_unrecognized("unrecognized arguments: --nothing-like-it", ["--lr"]) == (
        "unrecognized arguments: --nothing-like-it"
    )
