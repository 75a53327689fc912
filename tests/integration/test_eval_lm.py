"""toolkit-eval-lm reproduces fairseq-eval-lm's block, context and counting arithmetic.

The reference scores every token with an explicit loop over the split: each block's
input is built by hand (the context is the last tokens of everything fed before it,
at most ``context_window``, and at most what fits in ``tokens_per_sample`` with the
block), and the logits come from a direct forward pass over fairseq-named weights
(tests/helpers/fairseq_layout.py), not from the toolkit's model.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.eval_lm_setup import make_eval_lm_files


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_eval_lm_files(tmp_path_factory.mktemp("evallm"))


def test_cli_flags_and_errors(setup, tmp_path):
    data, path, _, _ = setup
    flags = [
        data,
        "--path",
        path,
        "--task",
        "language_modeling",
        "--criterion",
        "cross_entropy",
        "--sample-break-mode",
        "none",
        "--tokens-per-sample",
        "12",
        "--context-window",
        "4",
        "--softmax-batch",
        "7",
        "--output-word-stats",
        "--remove-bpe",
        "--quiet",
        "--results-path",
        str(tmp_path),
        "--model-overrides",
        "{'dropout': 0.0}",
        "--num-workers",
        "2",
        "--skip-invalid-size-inputs-valid-test",
        "--max-target-positions",
        "40",
        "--num-shards",
        "1",
        "--shard-id",
        "0",
        "--seed",
        "3",
        "--log-format",
        "simple",
        "--max-sentences",
        "2",
        "--cpu",
    ]
    run = run_cli("toolkit_cli.eval_lm", flags)
    assert run.returncode == 0, run.stderr
    assert "Loss (base 2):" in run.stdout
    for flag in (
        "--criterion",
        "--quiet",
        "--results-path",
        "--num-workers",
        "--max-target-positions",
        "--skip-invalid-size-inputs-valid-test",
    ):
        assert f"{flag} accepted for fairseq compatibility, no effect" in run.stdout, flag
    assert not os.listdir(tmp_path)
