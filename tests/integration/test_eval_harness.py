"""toolkit-eval-harness: the harness's own ``hf`` model on the Hugging Face export gives the same numbers.

Two checkpoints trained here on WikiText-2 (transformer_lm: 2 ranks, fully_sharded, sharded state;
a tiny Llama: one process) are exported with ``toolkit-export --format hf``; the local tasks in
``tests/harness_tasks`` (multiple choice, rolling perplexity, generate_until) run through
``ToolkitLM`` and through lm_eval's ``HFLM`` on the export: per-request log-likelihoods within 1e-4,
identical accuracies, identical greedy generations, with ``HFLM``'s default model_args. ``ToolkitLM`` reads
the sharded folder, its consolidated ``.pt`` and its fairseq-layout export alike; the command prints the table
and writes JSON.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from tests.helpers import cli as H  # noqa: E402
from tests.helpers.lm_fixtures import make_wikitext_data_bin  # noqa: E402
from toolkit.checkpoint import sharded  # noqa: E402
from toolkit.evaluation.harness import ToolkitLM  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

TASKS_DIR = os.path.join(H.REPO_ROOT, "tests", "harness_tasks")
CHOICE_TASKS = ["toolkit_wiki_cloze", "toolkit_wiki_gen"]
ROLLING_TASKS = ["toolkit_wiki_ppl"]
COMMON = [
    "--tokens-per-sample",
    "64",
    "--batch-size",
    "8",
    "--optimizer",
    "adam",
    "--lr",
    "0.003",
    "--seed",
    "3",
    "--num-workers",
    "0",
    "--cpu",
    "--max-update",
    "30",
    "--log-format",
    "json",
    "--no-epoch-checkpoints",
]
TRANSFORMER = [
    "--arch",
    "transformer_lm",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-input-dim",
    "32",
    "--decoder-output-dim",
    "32",
    "--decoder-normalize-before",
    "--decoder-ffn-embed-dim",
    "64",
    "--decoder-attention-heads",
    "2",
    "--dropout",
    "0.0",
]
FSDP = ["--distributed-world-size", "2", "--ddp-backend", "fully_sharded", "--use-sharded-state"]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory, wikitext_dir):
    path = str(tmp_path_factory.mktemp("harness") / "bin")
    make_wikitext_data_bin(path, wikitext_dir, max_train_lines=600, max_valid_lines=50)
    return path


def _train_and_export(root, data_bin, flags, consolidate: bool) -> dict:
    save = str(root / "ck")
    run = H.run_cli("toolkit_cli.train", [data_bin, "--save-dir", save, *COMMON, *flags])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    path = os.path.join(save, "checkpoint_last.pt")
    if consolidate:
        folder = sharded.find_sharded(path)
        assert folder is not None and not os.path.isfile(path)
        sharded.consolidate(folder, str(root / "consolidated.pt"), include_optimizer=False)
        path = str(root / "consolidated.pt")
    run_export(ExportConfig(path=path, format="hf", out=str(root / "hf")))
    return {"save": save, "pt": path, "hf": str(root / "hf")}


@pytest.fixture(scope="module")
def transformer_ckpt(tmp_path_factory, data_bin):
    return _train_and_export(tmp_path_factory.mktemp("transformer"), data_bin, TRANSFORMER + FSDP, consolidate=True)


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory, data_bin):
    return _train_and_export(tmp_path_factory.mktemp("llama"), data_bin, ["--arch", "llama_tiny"], consolidate=False)


@pytest.fixture(scope="module")
def manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=TASKS_DIR, include_defaults=False)


def evaluate(lm, tasks, manager):
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, bootstrap_iters=0, log_samples=True)


def responses(results, task):
    """Per request, in the harness's order: (log-likelihood, is_greedy), a float, or a generated text."""
    return [resp[0] for doc in results["samples"][task] for resp in doc["resps"]]


def assert_same(ours, theirs, tasks):
    for task in tasks:
        a, b = responses(ours, task), responses(theirs, task)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            if isinstance(x, str):
                assert x == y
            elif isinstance(x, float):
                assert abs(x - y) < 1e-4
            else:
                assert abs(x[0] - y[0]) < 1e-4 and x[1] == y[1]
        for metric, value in ours["results"][task].items():
            if metric.startswith(("acc", "exact_match")) and "stderr" not in metric:
                assert value == theirs["results"][task][metric], metric
            elif "perplexity" in metric or "bits_per_byte" in metric:
                assert value == pytest.approx(theirs["results"][task][metric], rel=1e-5), metric


def check_parity(ckpt, manager, path=None):
    from lm_eval.models.huggingface import HFLM

    ours = ToolkitLM(path=path or ckpt["pt"], batch_size=8, device="cpu")
    hf = HFLM(pretrained=ckpt["hf"], batch_size=8, device="cpu")
    assert_same(evaluate(ours, CHOICE_TASKS, manager), evaluate(hf, CHOICE_TASKS, manager), CHOICE_TASKS)
    # hf's defaults (lm_eval --model hf as a user runs it): its leading symbol scored in rolling requests too
    ours_rolling = evaluate(ours, ROLLING_TASKS, manager)
    assert_same(ours_rolling, evaluate(hf, ROLLING_TASKS, manager), ROLLING_TASKS)
    return ours_rolling


def test_transformer_lm_sharded_checkpoint_equals_hf_backend_on_its_export(transformer_ckpt, manager):
    check_parity(transformer_ckpt, manager, path=os.path.join(transformer_ckpt["save"], "checkpoint_last"))


def test_llama_checkpoint_equals_hf_backend_on_its_export(llama_ckpt, manager):
    results = check_parity(llama_ckpt, manager)
    assert 1.0 < results["results"]["toolkit_wiki_ppl"]["word_perplexity,none"] < 1e5


def test_fairseq_layout_checkpoint_scores_the_same(transformer_ckpt, manager, tmp_path):
    fairseq_pt = str(tmp_path / "fairseq.pt")
    run = H.run_cli("toolkit_cli.consolidate", [transformer_ckpt["pt"], "--to-fairseq", fairseq_pt])
    assert run.returncode == 0, run.stderr
    a = evaluate(ToolkitLM(path=transformer_ckpt["pt"], device="cpu"), ["toolkit_wiki_cloze"], manager)
    b = evaluate(
        ToolkitLM(path=fairseq_pt, data=_data_of(transformer_ckpt), device="cpu"), ["toolkit_wiki_cloze"], manager
    )
    assert responses(a, "toolkit_wiki_cloze") == responses(b, "toolkit_wiki_cloze")


def _data_of(ckpt) -> str:
    return torch.load(ckpt["pt"], weights_only=True)["cfg"]["data"]


def test_command_prints_table_and_writes_json(transformer_ckpt, tmp_path):
    out = str(tmp_path / "results.json")
    sharded_folder = os.path.join(transformer_ckpt["save"], "checkpoint_last")  # consolidated on the fly
    run = H.run_cli(
        "toolkit_cli.eval_harness",
        [
            _data_of(transformer_ckpt),
            "--path",
            sharded_folder,
            "--tasks",
            "toolkit_wiki_cloze",
            "--include-path",
            TASKS_DIR,
            "--limit",
            "8",
            "--output-path",
            out,
            "--bootstrap-iters",
            "0",
        ],
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "|toolkit_wiki_cloze|" in run.stdout and "acc_norm" in run.stdout
    results = json.load(open(out))
    assert 0.0 <= results["results"]["toolkit_wiki_cloze"]["acc,none"] <= 1.0
    assert results["n-samples"]["toolkit_wiki_cloze"]["effective"] == 8


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--tasks", "toolkit_wiki_cloze", "--include-path", "/nonexistent"],
            "--include-path /nonexistent: no such folder",
        ),
        ([], "--tasks is required"),
    ],
)
def test_bad_options_are_one_line(transformer_ckpt, flags, message):
    run = H.run_cli("toolkit_cli.eval_harness", ["--path", transformer_ckpt["pt"], *flags])
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(f"toolkit-eval-harness: error: {message}")
