"""The bad-input catalogue: nothing lost through a symlinked lock or a
merge into its own parts, no unbounded YAML, no wrong number with exit 0, no refusal after the work.

Every case keeps the catalogue's promise (``tests.helpers.bad_inputs.check_bad_input``): exit 1 (2 for
argparse), one ``prog: error:`` line with the fragment, no traceback, every prepared file byte-identical
(a symlink's target included), nothing new written beside them.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers.bad_inputs import MODEL, PROGS, check_bad_input
from tests.helpers.lm_fixtures import write_split
from toolkit.core import folder_lock

TRAIN, PREPROCESS = "toolkit_cli.train", "toolkit_cli.preprocess"
VALIDATE, HYDRA, HARNESS = "toolkit_cli.validate", "toolkit_cli.hydra_train", "toolkit_cli.eval_harness"
OUR_PROGS = {VALIDATE: "toolkit-validate", HYDRA: "toolkit-hydra-train", HARNESS: "toolkit-eval-harness"}
LAST = "{save}/checkpoint_last.pt"

CASES = [
    # --- 5. data lost ------------------------------------------------------------------------------
    (
        "train-lock-is-a-symlink",
        TRAIN,
        ["{bin}", MODEL, "--save-dir", "{linked_save}", "--max-update", "1"],
        "is a symbolic link or not a plain file; a lock is never followed",
    ),
    (
        "preprocess-lock-is-a-symlink",
        PREPROCESS,
        ["--only-source", "--trainpref", "{bad}/train.txt", "--destdir", "{linked_bin}"],
        "is a symbolic link or not a plain file",
    ),
    (
        "merge-into-its-own-parts",
        PREPROCESS,
        ["--merge", "{big}/*", "--destdir", "{big}", "--overwrite"],
        "holds the input",
    ),
    # --- 6. hangs ----------------------------------------------------------------------------------
    ("train-config-alias-bomb", TRAIN, ["--config", "{bomb_dir}/config.yaml"], "(an alias bomb)"),
    ("hydra-train-alias-bomb", HYDRA, ["--config-dir", "{bomb_dir}", "--config-name", "config"], "(an alias bomb)"),
    # --- 7. wrong numbers with exit 0 --------------------------------------------------------------
    (
        "train-empty-valid-split",
        TRAIN,
        ["{empty_valid}", MODEL, "--save-dir", "{root}/new_save_ev", "--max-update", "2"],
        "--valid-subset valid: the split has no samples",
    ),
    (
        "validate-empty-valid-split",
        VALIDATE,
        ["{empty_valid}", "--path", LAST, "--cpu"],
        "--valid-subset valid: the split has no samples",
    ),
    ("validate-batch-size-0", VALIDATE, ["{bin}", "--path", LAST, "--batch-size", "0"], "0: must be at least 1"),
    (
        "validate-batch-size-minus-3",
        VALIDATE,
        ["{bin}", "--path", LAST, "--batch-size", "-3"],
        "-3: must be at least 1",
    ),
    (
        "preprocess-truncated-zst",
        PREPROCESS,
        ["--only-source", "--trainpref", "{cut_zst}", "--destdir", "{root}/new_zbin"],
        "truncated",
    ),
    (
        "mixture-weight-too-small",
        TRAIN,
        [
            "",
            MODEL,
            "--save-dir",
            "{root}/new_save_mix",
            "--data-mixture",
            "a={bin}:1e308,b={bin}:1e-320",
            "--max-update",
            "2",
        ],
        "the weight of b is too small next to the others",
    ),
    (
        "train-dropout-nan",
        TRAIN,
        ["{bin}", MODEL, "--dropout", "nan", "--max-update", "1"],
        "nan: must be a finite number",
    ),
    # --- 8. late failures --------------------------------------------------------------------------
    (
        "train-valid-samples-too-long",
        TRAIN,
        [
            "{bin}",
            MODEL,
            "--save-dir",
            "{root}/new_save_long",
            "--sample-break-mode",
            "eos",
            "--tokens-per-sample",
            "16",
        ],
        "--skip-invalid-size-inputs-valid-test",
    ),
    (
        "harness-output-path-first",
        HARNESS,
        ["--path", "{bad}/empty.pt", "--tasks", "no_such_task", "--output-path", "{root}/no_such_folder/results.json"],
        "--output-path {root}/no_such_folder/results.json: folder",
    ),
]


def _alias_bomb() -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return "\n".join(lines) + "\ncommon:\n  seed: *a8\n"


def _merge_parts(paths) -> None:
    from tests.helpers.preprocess import run

    for shard in range(2):
        run(
            "--trainpref",
            f"{paths['bad']}/train.txt",
            "--srcdict",
            f"{paths['bin']}/dict.txt",
            "--num-shards",
            2,
            "--shard-id",
            shard,
            "--destdir",
            f"{paths['big']}/{shard}",
        )


@pytest.fixture(scope="module")
def paths(prepared):
    from toolkit.data.dictionary import Dictionary

    root = prepared["root"]
    extra = {
        "linked_save": f"{root}/linked_save",
        "linked_bin": f"{root}/linked_bin",
        "big": f"{root}/big",
        "bomb_dir": f"{root}/bomb",
        "empty_valid": f"{root}/empty_valid",
        "cut_zst": f"{root}/cut.jsonl.zst",
    }
    os.makedirs(extra["linked_save"])
    os.symlink(f"{prepared['bad']}/train.txt", f"{extra['linked_save']}/{folder_lock.SAVE_DIR_LOCK}")
    os.symlink(f"{prepared['bad']}/train.txt", folder_lock.beside(extra["linked_bin"]))
    all_paths = {**prepared, **extra}
    _merge_parts(all_paths)
    os.makedirs(extra["bomb_dir"])
    with open(f"{extra['bomb_dir']}/config.yaml", "w") as f:
        f.write(_alias_bomb())
    import shutil

    shutil.copytree(prepared["bin"], extra["empty_valid"])
    write_split(f"{extra['empty_valid']}/valid", [], len(Dictionary.load(f"{prepared['bin']}/dict.txt")))
    zstd = pytest.importorskip("zstandard")
    whole = zstd.ZstdCompressor().compress(
        b"".join(json.dumps({"text": f"line {i} a b c"}).encode() + b"\n" for i in range(2000))
    )
    with open(extra["cut_zst"], "wb") as f:
        f.write(whole[: len(whole) // 2])
    return all_paths


def test_catalogue_cases_are_named_once():
    assert len({c[0] for c in CASES}) == len(CASES) >= 14


@pytest.mark.parametrize("name,module,argv,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, module, argv, fragment, paths, tmp_path, monkeypatch):
    for known, prog in OUR_PROGS.items():  # run_forked names the program from this table; only for this test,
        monkeypatch.setitem(PROGS, known, prog)  # as test_bad_inputs checks its cases cover the table
    check_bad_input(module, argv, fragment, paths, tmp_path)
