"""--data-mixture: weights met, deterministic by seed, exact resume after kill -9, validation per source."""

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import processes
from tests.helpers.cli import REPO_ROOT, TINY_MODEL, train
from tests.helpers.mixture import make_sources


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_sources(tmp_path_factory.mktemp("mixture"))


def mixture_args(root):
    return ["--data-mixture", f"web={root}/web:0.7,code={root}/code:0.3", "--log-format", "json"]


def train_mixture(root, save_dir, *extra, **kw):
    return train("", save_dir, *mixture_args(root), *extra, **kw)


def test_validation_per_source_and_weighted_total(tmp_path, sources):
    run = train_mixture(sources, str(tmp_path / "ck"), "--max-update", "4", "--no-save")
    web, code, total = (float(run.records(tag)[-1][f"{tag}_loss"]) for tag in ("valid_web", "valid_code", "valid"))
    assert abs(total - (0.7 * web + 0.3 * code)) < 2e-3, (web, code, total)
    assert "--valid-subset valid_web,valid_code" in run.stdout


def test_validate_prints_the_runs_weighted_valid(tmp_path, sources):
    """toolkit-validate on a mixture checkpoint: per source, then the weighted `valid` the run's
    --best-checkpoint-metric followed (the same number, not a draw from the mixed split)."""
    from tests.helpers.cli import run_cli

    run = train_mixture(sources, str(tmp_path / "ck"), "--max-update", "4", "--no-epoch-checkpoints")
    check = run_cli(
        "toolkit_cli.validate",
        ["", "--path", str(tmp_path / "ck" / "checkpoint_last.pt"), "--log-format", "json", "--cpu"],
    )
    assert check.returncode == 0, check.stderr[-2000:]
    for tag in ("valid_web", "valid_code", "valid"):
        trained, validated = run.records(tag)[-1], check.records(tag)[-1]
        assert validated[f"{tag}_loss"] == trained[f"{tag}_loss"], tag
        assert validated[f"{tag}_ppl"] == trained[f"{tag}_ppl"], tag


def popen_train(root, save_dir, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT)
    args = ["", "--save-dir", save_dir, *TINY_MODEL, *mixture_args(root), *extra]
    return processes.start(
        [sys.executable, "-m", "toolkit_cli.train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )


def test_resumes_exactly_after_kill_9(tmp_path, sources):
    common = ["--max-update", "12", "--save-interval-updates", "5", "--dropout", "0", "--seed", "7"]
    whole = train_mixture(sources, str(tmp_path / "whole"), *common, "--disable-validation")
    proc = popen_train(sources, str(tmp_path / "killed"), *common, "--disable-validation")
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "Saved checkpoint" in line and "checkpoint_1_5" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "".join(seen[-20:])
    resumed = train_mixture(sources, str(tmp_path / "killed"), *common, "--disable-validation")
    before, after = whole.losses(), resumed.losses()
    assert sorted(after) == list(range(6, 13))
    for update in after:
        assert after[update] == pytest.approx(before[update], abs=1e-6), (update, before, after)


def test_different_dictionaries_refused(tmp_path, sources):
    run = train(
        "",
        str(tmp_path / "ck"),
        "--data-mixture",
        f"web={sources}/web:1,other={sources}/other:1",
        "--max-update",
        "1",
        check=False,
    )
    assert run.returncode == 1
    err = run.stderr.strip().splitlines()
    assert len(err) == 1 and "must share one dictionary" in err[0] and "--srcdict" in err[0], err
