"""The bad-input catalogue: nothing deleted, one writer per folder,
sample positions, checksums.

Every case keeps the catalogue's promise (``tests.helpers.bad_inputs.check_bad_input``): exit 1,
one ``prog: error:`` line with the fragment, no traceback, every prepared file byte-identical.
Cases needing a held lock hold it in this process around the forked command.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from tests.helpers.bad_inputs import MODEL, PROGS, check_bad_input
from tests.helpers.checkpoints import damage_zip_record
from toolkit.core import folder_lock

TRAIN, EVAL, CONSOLIDATE, PREPROCESS, EXPORT = (
    "toolkit_cli.train",
    "toolkit_cli.eval_lm",
    "toolkit_cli.consolidate",
    "toolkit_cli.preprocess",
    "toolkit_cli.export",
)
PROGS.setdefault(EXPORT, "toolkit-export")  # run_forked names the program from this table
LAST = "{save}/checkpoint_last.pt"

CASES = [
    # --- 1. never delete what we did not write -----------------------------------------------------
    (
        "export-out-not-empty",
        EXPORT,
        ["--path", LAST, "--format", "safetensors", "--out", "{notes}"],
        "folder exists and is not empty",
    ),
    (
        "export-force-not-an-export",
        EXPORT,
        ["--path", LAST, "--format", "safetensors", "--out", "{notes}", "--force"],
        "not an earlier export",
    ),
    (
        "export-force-foreign-file",
        EXPORT,
        ["--path", LAST, "--format", "safetensors", "--out", "{earlier_plus}", "--force"],
        "holds files the export did not write (notes.txt)",
    ),
    (
        "export-into-input-folder",
        EXPORT,
        ["--path", LAST, "--format", "safetensors", "--out", "{save}", "--force"],
        "holds the input --path",
    ),
    ("export-out-dot", EXPORT, ["--path", LAST, "--format", "safetensors", "--out", "."], "is the current folder"),
    (
        "export-out-is-file",
        EXPORT,
        ["--path", LAST, "--format", "safetensors", "--out", "{bad}/train.txt"],
        "exists and is not a folder",
    ),
    (
        "import-hf-out-not-empty",
        EXPORT,
        ["--from", "hf", "--path", "{root}/gpt2", "--out", "{notes}"],
        "folder exists and is not empty",
    ),
    (
        "import-hf-into-parent",
        EXPORT,
        ["--from", "hf", "--path", "{notes}", "--out", "{root}", "--force"],
        "holds the input --path",
    ),
    (
        "consolidate-output-folder-force",
        CONSOLIDATE,
        ["{sharded}/checkpoint_last", "-o", "{bad}", "--force"],
        "is a folder",
    ),
    ("consolidate-to-fairseq-folder", CONSOLIDATE, [LAST, "--to-fairseq", "{bad}", "--force"], "is a folder"),
    # --- 2. one writer per folder (a file where the folder should be) ------------------------------
    ("train-save-dir-is-file", TRAIN, ["{bin}", MODEL, "--save-dir", "{bad}/train.txt"], "is a file, not a folder"),
    # --- 3. sample positions: what the samples are cannot change in mid-epoch -----------------------
    (
        "resume-other-tokens-per-sample",
        TRAIN,
        ["{bin}", MODEL, "--max-update", "9", "--tokens-per-sample", "16"],
        "--tokens-per-sample 16: the checkpoint stopped in mid-epoch with --tokens-per-sample 32",
    ),
    (
        "resume-other-break-mode",
        TRAIN,
        ["{bin}", MODEL, "--max-update", "9", "--sample-break-mode", "eos"],
        "--sample-break-mode eos: the checkpoint stopped in mid-epoch with --sample-break-mode none",
    ),
    # --- 4. integrity ------------------------------------------------------------------------------
    (
        "resume-damaged-pt",
        TRAIN,
        ["{bin}", MODEL, "--save-dir", "{damaged}", "--max-update", "9"],
        "checkpoint_last.pt: damaged: record ",
    ),
    (
        "eval-damaged-pt",
        EVAL,
        ["{bin}", "--path", "{damaged}/checkpoint_last.pt", "--gen-subset", "valid"],
        "the newest intact checkpoint beside it is ",
    ),
    (
        "export-damaged-pt",
        EXPORT,
        ["--path", "{damaged}/checkpoint_last.pt", "--format", "safetensors", "--out", "{root}/new_export"],
        "damaged: record ",
    ),
    (
        "resume-damaged-shard",
        TRAIN,
        ["{bin}", MODEL, "--use-sharded-state", "--save-dir", "{damaged_sharded}", "--max-update", "9"],
        "damaged: shard file __0_0.distcp",
    ),
    (
        "consolidate-damaged-shard",
        CONSOLIDATE,
        ["{damaged_sharded}/checkpoint_last", "-o", "{root}/out.pt"],
        "damaged: shard file __0_0.distcp",
    ),
]


def _damaged_copies(paths) -> None:
    root = paths["root"]
    os.makedirs(f"{root}/damaged")
    shutil.copy(f"{paths['save']}/checkpoint_last.pt", f"{root}/damaged/checkpoint_1_2.pt")
    os.utime(f"{root}/damaged/checkpoint_1_2.pt", (time.time() - 60, time.time() - 60))
    shutil.copy(f"{paths['save']}/checkpoint_last.pt", f"{root}/damaged/checkpoint_last.pt")
    damage_zip_record(f"{root}/damaged/checkpoint_last.pt")
    shutil.copytree(f"{paths['sharded']}/checkpoint_last", f"{root}/damaged_sharded/checkpoint_last")
    with open(f"{root}/damaged_sharded/checkpoint_last/__0_0.distcp", "r+b") as f:
        f.seek(os.path.getsize(f.name) // 2)
        f.write(b"\x00\x01\x02\x03")


@pytest.fixture(scope="module")
def paths(prepared):
    from toolkit.export.api import ExportConfig, run_export

    root = prepared["root"]
    extra = {
        "notes": f"{root}/notes",
        "earlier_plus": f"{root}/earlier_plus",
        "damaged": f"{root}/damaged",
        "damaged_sharded": f"{root}/damaged_sharded",
    }
    os.makedirs(extra["notes"])
    with open(f"{extra['notes']}/notes.txt", "w") as f:
        f.write("mine\n")
    run_export(
        ExportConfig(path=f"{prepared['save']}/checkpoint_last.pt", format="safetensors", out=extra["earlier_plus"])
    )
    shutil.copy(f"{extra['notes']}/notes.txt", extra["earlier_plus"])
    all_paths = {**prepared, **extra}
    _damaged_copies(all_paths)
    return all_paths


def test_catalogue_cases_are_many_and_named_once():
    assert len(CASES) >= 15 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,module,argv,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, module, argv, fragment, paths, tmp_path):
    check_bad_input(module, argv, fragment, paths, tmp_path)


@pytest.mark.parametrize(
    "module,argv",
    [
        (TRAIN, ["{bin}", MODEL, "--max-update", "9"]),
        (TRAIN, ["{bin}", MODEL, "--max-update", "9", "--use-sharded-state"]),
    ],
)
def test_second_run_on_a_locked_save_dir_stops_naming_the_holder(module, argv, paths, tmp_path):
    lock = os.path.join(paths["save"], folder_lock.SAVE_DIR_LOCK)
    with folder_lock.hold(lock, "--save-dir x", "toolkit-train"):
        check_bad_input(module, argv, f"in use by toolkit-train (pid {os.getpid()} on host ", paths, tmp_path)
    assert not os.path.exists(lock)


def test_second_preprocess_into_a_locked_destdir_stops(paths, tmp_path):
    dest = f"{paths['root']}/new_bin"
    with folder_lock.hold(folder_lock.beside(dest), f"--destdir {dest}", "toolkit-preprocess"):
        check_bad_input(
            PREPROCESS,
            ["--only-source", "--trainpref", "{bad}/train.txt", "--destdir", dest],
            "in use by toolkit-preprocess (pid ",
            paths,
            tmp_path,
        )
    assert not os.path.exists(dest) and not os.path.exists(folder_lock.beside(dest))
