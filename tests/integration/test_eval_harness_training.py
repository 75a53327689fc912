"""--eval-harness-tasks during toolkit-train: lines at the interval, the numbers of the saved model,
a harness metric as --best-checkpoint-metric, exact resume, 2 fully_sharded ranks (gathered)."""

from __future__ import annotations

import os

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from tests.helpers import cli as H  # noqa: E402
from tests.helpers.lm_fixtures import make_wikitext_data_bin  # noqa: E402
from toolkit.evaluation.during_training import flatten  # noqa: E402
from toolkit.evaluation.harness import ToolkitLM  # noqa: E402
from toolkit.evaluation.harness_main import evaluate, task_manager  # noqa: E402

TASKS_DIR = os.path.join(H.REPO_ROOT, "tests", "harness_tasks")
TASKS = "toolkit_wiki_cloze,toolkit_wiki_ppl"
HARNESS = [
    "--eval-harness-tasks",
    TASKS,
    "--eval-harness-interval-updates",
    "5",
    "--eval-harness-limit",
    "12",
    "--eval-harness-include-path",
    TASKS_DIR,
    "--best-checkpoint-metric",
    "toolkit_wiki_cloze_acc_norm",
    "--maximize-best-checkpoint-metric",
    "--save-interval-updates",
    "5",
    "--tokens-per-sample",
    "32",
]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory, wikitext_dir):
    path = str(tmp_path_factory.mktemp("harness_train") / "bin")
    make_wikitext_data_bin(path, wikitext_dir, max_train_lines=300, max_valid_lines=20)
    return path


@pytest.fixture(scope="module")
def straight(data_bin, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("straight") / "ck")
    return save, H.train(data_bin, save, "--max-update", "15", *HARNESS, "--tensorboard-logdir", save + "/tb")


def harness_lines(run) -> dict:
    """{num_updates: {metric: value}} of the eval_harness lines (json format: keys prefixed by the tag)."""
    lines = [{k.replace("eval_harness_", "", 1): v for k, v in r.items()} for r in run.records("eval_harness")]
    return {int(r["num_updates"]): r for r in lines}


def test_lines_at_the_interval_are_the_saved_models_numbers(straight):
    save, run = straight
    lines = harness_lines(run)
    assert sorted(lines) == [5, 10, 15]
    assert os.listdir(os.path.join(save, "tb", "eval_harness"))  # the same scalars for TensorBoard
    lm = ToolkitLM(path=os.path.join(save, "checkpoint_1_10.pt"), device="cpu")
    names = TASKS.split(",")
    expected = flatten(evaluate(lm, names, task_manager(names, TASKS_DIR), limit=12, seed=3))
    assert set(expected) == set(lines[10]) - {"num_updates", "epoch"}
    for key, value in expected.items():
        assert float(lines[10][key]) == pytest.approx(value, rel=1e-3, abs=1e-3), key


def test_harness_metric_picks_checkpoint_best(straight):
    save, run = straight
    lines = harness_lines(run)
    best_update = max(sorted(lines), key=lambda u: (float(lines[u]["toolkit_wiki_cloze_acc_norm"]), -u))
    best = torch.load(os.path.join(save, "checkpoint_best.pt"), weights_only=True)["extra_state"]
    assert best["trainer"]["num_updates"] == best_update
    assert best["best"] == pytest.approx(float(lines[best_update]["toolkit_wiki_cloze_acc_norm"]))


def test_resume_is_exact(data_bin, straight, tmp_path):
    _, run = straight
    save = str(tmp_path / "ck")
    first = H.train(data_bin, save, "--max-update", "10", *HARNESS)
    second = H.train(data_bin, save, "--max-update", "15", *HARNESS)
    assert harness_lines(first) == {u: r for u, r in harness_lines(run).items() if u <= 10}
    assert harness_lines(second)[15] == harness_lines(run)[15]
    assert second.losses() == {u: v for u, v in run.losses().items() if u > 10}


def test_two_fully_sharded_ranks_evaluate_the_gathered_model(data_bin, straight, tmp_path):
    save = str(tmp_path / "ck")
    run = H.train(
        data_bin, save, "--max-update", "5", "--distributed-world-size", "2", "--ddp-backend", "fully_sharded", *HARNESS
    )
    lines = harness_lines(run)
    assert sorted(lines) == [5]
    lm = ToolkitLM(path=os.path.join(save, "checkpoint_1_5.pt"), device="cpu")
    names = TASKS.split(",")
    expected = flatten(evaluate(lm, names, task_manager(names, TASKS_DIR), limit=12, seed=3))
    for key, value in expected.items():
        assert float(lines[5][key]) == pytest.approx(value, rel=1e-3, abs=1e-3), key


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--eval-harness-tasks", "x"], "--eval-harness-tasks x: also give --eval-harness-interval-updates N"),
        (["--eval-harness-interval-updates", "5"], "--eval-harness-interval-updates/--eval-harness-limit need"),
    ],
)
def test_flag_errors_are_one_line(data_bin, tmp_path, flags, message):
    run = H.train(data_bin, str(tmp_path / "ck"), "--max-update", "1", *flags, check=False)
    assert "eval_harness" not in run.stdout
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(f"toolkit-train: error: {message}")
