"""toolkit-export round trips: safetensors -> hub, ONNX -> onnxruntime, HF both ways (tiny models)."""

from __future__ import annotations


def test_cli_reports_user_errors_in_one_line(tmp_path):
    from tests.helpers.cli import run_cli

    run = run_cli(
        "toolkit_cli.export", ["--path", str(tmp_path / "missing.pt"), "--format", "hf", "--out", str(tmp_path / "hf")]
    )
    assert run.returncode == 1 and run.stderr.strip().count("\n") == 0
    assert run.stderr.startswith("toolkit-export: error: ") and "checkpoint not found" in run.stderr
