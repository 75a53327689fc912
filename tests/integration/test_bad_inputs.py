"""The bad-input catalogue: every CLI answers a user mistake with one line, and damages nothing.

One table: each case is a command (module + arguments, with ``{placeholders}`` for the
prepared files), the fragment its one-line error must contain, and the promise checked
for all of them: exit status 1 (2 for argparse's own parse errors), no ``Traceback`` anywhere, the last stderr line is
``prog: error: ...``, and every prepared file (data-bins, checkpoints, the forged and
damaged inputs) is byte-identical afterwards.

Speed: the prepared files are made once per session (two 2-update trainings, shared with
test_bad_inputs_writers_and_checksums.py), and each
case runs in a forked child of this process (torch already imported, real exit status
and real stderr, nothing shared back), so the whole table takes seconds.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers import processes
from tests.helpers.bad_inputs import (
    CONSOLIDATE,
    EVAL,
    EXPORT,
    GENERATE,
    INTERACTIVE,
    MODEL,
    NAN_GEN,
    PREPROCESS,
    PROGS,
    TRAIN,
    check_bad_input,
    run_forked,
)
from tests.helpers.cli import run_cli

CASES = [
    # --- toolkit-train: flags, caught before any work -----------------------------------------
    ("train-no-data", TRAIN, ["{root}/nope", MODEL], "nope: data shard not found"),
    (
        "train-tp-world",
        TRAIN,
        ["{bin}", MODEL, "--model-parallel-size", "2", "--distributed-world-size", "3"],
        "--model-parallel-size 2: must divide the world size 3",
    ),
    (
        "train-arch-typo",
        TRAIN,
        ["{bin}", "--arch", "transformer_lm_gpt3_smal", "--batch-size", "2"],
        "transformer_lm_gpt3_small",
    ),
    ("train-fp16-bf16", TRAIN, ["{bin}", MODEL, "--fp16", "--bf16"], "--fp16 and --bf16 conflict"),
    (
        "train-explicit-offload-optimizer",
        TRAIN,
        ["{bin}", MODEL, "--ddp-backend", "fully_sharded", "--cpu-offload", "--optimizer", "sgd"],
        "got --optimizer sgd",
    ),
    ("train-update-freq-0", TRAIN, ["{bin}", MODEL, "--update-freq", "0"], "--update-freq must be >= 1"),
    ("train-offload-not-sharded", TRAIN, ["{bin}", MODEL, "--cpu-offload"], "--cpu-offload requires --ddp-backend"),
    (
        "train-positions",
        TRAIN,
        ["{bin}", MODEL, "--tokens-per-sample", "256", "--max-target-positions", "128"],
        "--max-target-positions is 128",
    ),
    (
        "train-ep-not-dividing-experts",
        TRAIN,
        [
            "{bin}",
            "--arch",
            "moe_tiny",
            "--batch-size",
            "2",
            "--cpu",
            "--distributed-world-size",
            "3",
            "--expert-parallel-size",
            "3",
        ],
        "--expert-parallel-size 3: each rank keeps an equal share of a layer's 4 experts (--moe-num-experts)",
    ),
    (
        "train-port-in-use",
        TRAIN,
        ["{bin}", MODEL, "--distributed-world-size", "2", "--distributed-port", "{port}"],
        "address already in use",
    ),
    ("train-unknown-optimizer", TRAIN, ["{bin}", MODEL, "--optimizer", "adamm"], "adam"),
    ("train-unknown-valid-subset", TRAIN, ["{bin}", MODEL, "--valid-subset", "valid9"], "valid9"),
    # --- toolkit-train: data-bins --------------------------------------------------------------
    ("train-truncated-idx", TRAIN, ["{bad}/truncated_idx", MODEL], "truncated: "),
    ("train-truncated-idx-header", TRAIN, ["{bad}/short_idx", MODEL], "shorter than the 26-byte header"),
    ("train-bad-idx-magic", TRAIN, ["{bad}/magic_idx", MODEL], "bad magic"),
    ("train-missing-bin", TRAIN, ["{bad}/missing_bin", MODEL], "train.bin/.idx: not found"),
    ("train-dict-duplicate", TRAIN, ["{bad}/dict_dup", MODEL], "duplicate token"),
    ("train-dict-bad-line", TRAIN, ["{bad}/dict_line", MODEL], "expected '<token> <count>'"),
    # --- toolkit-train: resuming ---------------------------------------------------------------
    ("resume-more-layers", TRAIN, ["{bin}", MODEL, "--max-update", "9", "--decoder-layers", "3"], "--decoder-layers"),
    (
        "resume-shared-embed",
        TRAIN,
        ["{bin}", MODEL, "--max-update", "9", "--share-decoder-input-output-embed"],
        "--share-decoder-input-output-embed False in the checkpoint, True now",
    ),
    (
        "resume-learned-pos",
        TRAIN,
        ["{bin}", MODEL, "--max-update", "9", "--decoder-learned-pos"],
        "--decoder-learned-pos False in the checkpoint, True now",
    ),
    ("resume-other-dictionary", TRAIN, ["{bad}/shuffled", MODEL, "--max-update", "9"], "trained with dictionary"),
    (
        "resume-other-optimizer",
        TRAIN,
        ["{bin}", MODEL, "--max-update", "9", "--optimizer", "sgd"],
        "optimizer state was saved by --optimizer adam",
    ),
    # (a missing --restore-file starts a fresh run, as in fairseq: tests/test_fairseq_flags.py)
    (
        "finetune-missing-model",
        TRAIN,
        ["{bin}", MODEL, "--save-dir", "{root}/fresh", "--finetune-from-model", "{root}/none.pt"],
        "none.pt: file not found",
    ),
    (
        "finetune-with-restore-file",
        TRAIN,
        ["{bin}", MODEL, "--finetune-from-model", "{root}/none.pt", "--restore-file", "{root}/none.pt"],
        "cannot be given together",
    ),
    (
        "finetune-with-reset",
        TRAIN,
        ["{bin}", MODEL, "--finetune-from-model", "{root}/none.pt", "--reset-meters"],
        "--reset-meters",
    ),
    (
        "lr-list-inverse-sqrt",
        TRAIN,
        ["{bin}", MODEL, "--lr", "0.1,0.05", "--lr-scheduler", "inverse_sqrt"],
        "needs --lr-scheduler fixed",
    ),
    (
        "tp-no-c10d-mefp16",
        TRAIN,
        [
            "{bin}",
            MODEL,
            "--model-parallel-size",
            "2",
            "--distributed-world-size",
            "2",
            "--ddp-backend",
            "no_c10d",
            "--memory-efficient-fp16",
        ],
        "--memory-efficient-fp16 with --model-parallel-size > 1 and --ddp-backend no_c10d",
    ),
    (
        "resume-forged-pt",
        TRAIN,
        ["{bin}", MODEL, "--restore-file", "{bad}/forged.pt"],
        "refusing to load: unexpected object posix.system",
    ),
    (
        "resume-fairseq-pt",
        TRAIN,
        ["{bin}", MODEL, "--restore-file", "{bad}/fairseq.pt"],
        "fairseq.pt: cannot load: the checkpoint has no weight for",
    ),
    (
        "resume-corrupt-pt",
        TRAIN,
        ["{bin}", MODEL, "--restore-file", "{bad}/corrupt.pt"],
        "corrupt.pt: cannot ",
    ),  # random bytes: "cannot read/load checkpoint (...)"
    (
        "resume-forged-dcp-metadata",
        TRAIN,
        ["{bin}", MODEL, "--use-sharded-state", "--restore-file", "{bad}/forged_sharded"],
        "refusing to load: unexpected object",
    ),
    (
        "resume-incomplete-sharded",
        TRAIN,
        ["{bin}", MODEL, "--use-sharded-state", "--restore-file", "{bad}/incomplete_sharded"],
        "not a complete sharded checkpoint",
    ),
    # --- toolkit-eval-lm ---------------------------------------------------------------------------
    ("eval-no-path", EVAL, ["{bin}"], "--path is required"),
    ("eval-missing-checkpoint", EVAL, ["{bin}", "--path", "{root}/none.pt"], "checkpoint not found"),
    ("eval-forged-pt", EVAL, ["{bin}", "--path", "{bad}/forged.pt"], "refusing to load: unexpected object"),
    ("eval-fairseq-pt", EVAL, ["{bin}", "--path", "{bad}/fairseq.pt"], "cannot load: the checkpoint has no weight"),
    (
        "eval-fairseq-namespace-pt",
        EVAL,
        ["{bin}", "--path", "{bad}/fairseq_args.pt"],
        "cannot load: the checkpoint has no weight",
    ),
    ("eval-empty-pt", EVAL, ["{bin}", "--path", "{bad}/empty.pt"], "cannot load checkpoint"),
    (
        "eval-other-dictionary",
        EVAL,
        ["{bad}/shuffled", "--path", "{save}/checkpoint_last.pt", "--gen-subset", "valid"],
        "trained with dictionary",
    ),
    (
        "eval-too-long-blocks",
        EVAL,
        ["{bin}", "--path", "{save}/checkpoint_last.pt", "--gen-subset", "valid", "--tokens-per-sample", "1000"],
        "every block is longer than the model's 32 positions",
    ),
    (
        "eval-truncated-idx",
        EVAL,
        ["{bad}/truncated_idx", "--path", "{save}/checkpoint_last.pt", "--gen-subset", "valid"],
        "truncated: ",
    ),
    # --- toolkit-consolidate -------------------------------------------------------------------
    ("consolidate-not-sharded", CONSOLIDATE, ["{root}"], "no complete sharded checkpoint"),
    (
        "consolidate-output-exists",
        CONSOLIDATE,
        ["{sharded}/checkpoint_last", "-o", "{save}/checkpoint_last.pt"],
        "already exists",
    ),
    (
        "consolidate-forged-metadata",
        CONSOLIDATE,
        ["{bad}/forged_sharded", "-o", "{root}/out.pt"],
        "refusing to load: unexpected object",
    ),
    (
        "consolidate-forged-meta-pt",
        CONSOLIDATE,
        ["{bad}/forged_meta", "-o", "{root}/out.pt"],
        "refusing to load: unexpected object",
    ),
    # --- toolkit-preprocess --------------------------------------------------------------------
    ("preprocess-nothing-to-do", PREPROCESS, ["--only-source", "--destdir", "{root}/new"], "nothing to do"),
    (
        "preprocess-missing-train",
        PREPROCESS,
        ["--only-source", "--trainpref", "{root}/none.txt", "--destdir", "{root}/new"],
        "no such",
    ),
    (
        "preprocess-empty-train",
        PREPROCESS,
        ["--only-source", "--trainpref", "{bad}/empty.txt", "--destdir", "{root}/new"],
        "the file is empty",
    ),
    (
        "preprocess-destdir-not-empty",
        PREPROCESS,
        ["--only-source", "--trainpref", "{bad}/train.txt", "--destdir", "{bin}"],
        "folder exists and is not empty",
    ),
    (
        "preprocess-workers-0",
        PREPROCESS,
        ["--only-source", "--trainpref", "{bad}/train.txt", "--destdir", "{root}/new", "--workers", "0"],
        "must be at least 1",
    ),
    # --- no wrong number with exit 0 (issue 19, item 5) --------------------------------------------
    (
        "eval-nan-weight",
        EVAL,
        ["{bin}", "--path", "{bad}/nan.pt", "--gen-subset", "valid"],
        "the checkpoint looks broken",
    ),
    (
        "eval-empty-split",
        EVAL,
        ["{bad}/empty_split", "--path", "{save}/checkpoint_last.pt", "--gen-subset", "test"],
        "test: no tokens to evaluate",
    ),
    (
        "eval-batch-size-0",
        EVAL,
        ["{bin}", "--path", "{save}/checkpoint_last.pt", "--batch-size", "0"],
        "--batch-size/--max-sentences: 0: must be at least 1",
    ),
    (
        "eval-max-tokens-0",
        EVAL,
        ["{bin}", "--path", "{save}/checkpoint_last.pt", "--max-tokens", "0"],
        "--max-tokens: 0: must be at least 1",
    ),
    (
        "generate-nan-weight",
        GENERATE,
        ["{bin}", *NAN_GEN, "--gen-subset", "valid", "--prefix-size", "2"],
        "next-token probabilities are all NaN",
    ),
    ("generate-batch-size-0", GENERATE, ["{bin}", *NAN_GEN, "--batch-size", "0"], "0: must be at least 1"),
    (
        "interactive-nan-weight",
        INTERACTIVE,
        ["{bin}", *NAN_GEN, "--input", "{bad}/prompts.txt"],
        "next-token probabilities are all NaN",
    ),
    ("train-batch-size-0", TRAIN, ["{bin}", MODEL, "--batch-size", "0"], "0: must be at least 1"),
    ("train-max-tokens-0", TRAIN, ["{bin}", MODEL, "--max-tokens", "0"], "--max-tokens: 0: must be at least 1"),
    (
        "train-max-update-negative",
        TRAIN,
        ["{bin}", MODEL, "--max-update", "-1"],
        "--max-update: -1: must be at least 0",
    ),
    ("train-max-epoch-negative", TRAIN, ["{bin}", MODEL, "--max-epoch", "-2"], "--max-epoch: -2: must be at least 0"),
    (
        "train-save-interval-updates-negative",
        TRAIN,
        ["{bin}", MODEL, "--save-interval-updates", "-3"],
        "--save-interval-updates: -3: must be at least 0",
    ),
    (
        "train-save-interval-0",
        TRAIN,
        ["{bin}", MODEL, "--save-interval", "0"],
        "--save-interval: 0: must be at least 1",
    ),
    (
        "train-validate-interval-updates-negative",
        TRAIN,
        ["{bin}", MODEL, "--validate-interval-updates", "-1"],
        "must be at least 0",
    ),
    (
        "train-keep-last-epochs-below-minus-one",
        TRAIN,
        ["{bin}", MODEL, "--keep-last-epochs", "-2"],
        "--keep-last-epochs: -2: must be at least -1",
    ),
    ("train-log-interval-0", TRAIN, ["{bin}", MODEL, "--log-interval", "0"], "--log-interval: 0: must be at least 1"),
    (
        "train-empty-train-split",
        TRAIN,
        ["{bad}/empty_split", MODEL, "--save-dir", "{root}/fresh_empty"],
        "split gives no batch in epoch 1",
    ),
    (
        "preprocess-blank-lines",
        PREPROCESS,
        ["--only-source", "--trainpref", "{bad}/blank.txt", "--destdir", "{root}/new"],
        "no token (blank lines only)",
    ),
    (
        "preprocess-blank-valid",
        PREPROCESS,
        [
            "--only-source",
            "--trainpref",
            "{bad}/train.txt",
            "--validpref",
            "{bad}/blank.txt",
            "--destdir",
            "{root}/new",
        ],
        "no token",
    ),
    (
        "preprocess-nul-bytes",
        PREPROCESS,
        ["--only-source", "--trainpref", "{bad}/nul.txt", "--destdir", "{root}/new"],
        "NUL byte(s), the first at byte 7 (line 2)",
    ),
    # --- checked before training (item 6) ------------------------------------------------------
    (
        "train-save-dir-is-a-file",
        TRAIN,
        ["{bin}", MODEL, "--save-dir", "{bad}/a_file"],
        "--save-dir {bad}/a_file: is a file, not a folder",
    ),
    ("train-save-dir-symlink-loop", TRAIN, ["{bin}", MODEL, "--save-dir", "{bad}/loop"], "symlink"),
    (
        "train-tensorboard-dir-is-a-file",
        TRAIN,
        ["{bin}", MODEL, "--save-dir", "{root}/fresh_tb", "--tensorboard-logdir", "{bad}/a_file"],
        "--tensorboard-logdir {bad}/a_file: is a file, not a folder",
    ),
    (
        "train-log-file-under-a-file",
        TRAIN,
        ["{bin}", MODEL, "--save-dir", "{root}/fresh_log", "--log-file", "{bad}/a_file/train.log"],
        "its folder {bad}/a_file is a file",
    ),
    ("train-log-file-is-a-folder", TRAIN, ["{bin}", MODEL, "--log-file", "{bad}"], "is a folder, not a file"),
    (
        "eval-log-file-under-a-file",
        EVAL,
        ["{bin}", "--path", "{save}/checkpoint_last.pt", "--log-file", "{bad}/a_file/eval.log"],
        "its folder {bad}/a_file is a file",
    ),
    (
        "train-token-id-past-dictionary",
        TRAIN,
        ["{bad}/cut_dict", MODEL, "--save-dir", "{root}/fresh_cut"],
        "is outside the dictionary's",
    ),
    (
        "eval-token-id-past-dictionary",
        EVAL,
        ["{bad}/corrupt_word", "--path", "{save}/checkpoint_last.pt", "--gen-subset", "valid"],
        "token id 250 (at token 3)",
    ),
    # --- one line for the rest (item 7) --------------------------------------------------------
    ("eval-tensor-pt", EVAL, ["{bin}", "--path", "{bad}/tensor.pt"], "not a checkpoint (it holds a Tensor"),
    ("eval-list-pt", EVAL, ["{bin}", "--path", "{bad}/list.pt"], "not a checkpoint (it holds a list"),
    ("resume-tensor-pt", TRAIN, ["{bin}", MODEL, "--restore-file", "{bad}/tensor.pt"], "not a checkpoint"),
    (
        "finetune-tensor-pt",
        TRAIN,
        ["{bin}", MODEL, "--save-dir", "{root}/fresh_ft", "--finetune-from-model", "{bad}/tensor.pt"],
        "not a checkpoint",
    ),
    (
        "export-tensor-pt",
        EXPORT,
        ["--path", "{bad}/tensor.pt", "--format", "safetensors", "--out", "{root}/export_out"],
        "not a checkpoint",
    ),
    (
        "export-forged-hf-bin",
        EXPORT,
        ["--from", "hf", "--path", "{bad}/hf_forged", "--out", "{root}/hf_out"],
        "cannot load the model's weights (UnpicklingError",
    ),
]


def test_catalogue_is_large_and_covers_every_cli():
    assert len(CASES) >= 30
    assert {module for _, module, _, _ in CASES} == set(PROGS)
    assert len({name for name, *_ in CASES}) == len(CASES)


@pytest.mark.parametrize("name,module,argv,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, module, argv, fragment, prepared, tmp_path):
    check_bad_input(module, argv, fragment, prepared, tmp_path)


# --- what is not a refusal: interruptions, warnings, leftovers (issue 19, item 7) -------------------


def _train_until(args, update: int):
    """A toolkit-train process, returned once it logged ``update`` (its stdout lines so far)."""
    proc = processes.start(
        [sys.executable, "-m", TRAIN, *args],
        cwd=H.REPO_ROOT,
        env=H.subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if f'"num_updates": "{update}"' in line:
            return proc, lines
    raise AssertionError(proc.stderr.read()[-3000:])


def _one_line_end(proc, prog: str = "toolkit-train", output=None):
    out, err = output if output is not None else proc.communicate(timeout=600)
    assert "Traceback" not in out + err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"{prog}: error: "), err[-3000:]
    return lines[-1]


def test_ctrl_c_in_training_is_one_line_with_the_update_and_the_saved_checkpoint(prepared, tmp_path):
    save = tmp_path / "s"
    proc, _ = _train_until(
        [
            prepared["bin"],
            *H.model_args(str(save)),
            "--save-interval-updates",
            "2",
            "--disable-validation",
            "--max-update",
            "100000",
        ],
        3,
    )
    last = _one_line_end(proc, output=processes.interrupt(proc))
    assert proc.returncode == 130
    found = re.fullmatch(r"toolkit-train: error: interrupted at update (\d+); checkpoint_last.pt is update (\d+)", last)
    assert found, last
    stopped, saved = int(found.group(1)), int(found.group(2))
    assert 2 <= saved <= stopped and saved % 2 == 0
    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    assert state["extra_state"]["trainer"]["num_updates"] == saved  # what the line says is what is on disk


def test_a_killed_data_loader_worker_is_one_line(prepared, tmp_path):
    args = [
        prepared["bin"],
        *H.model_args(str(tmp_path / "s")),
        "--num-workers",
        "2",
        "--disable-validation",
        "--max-update",
        "100000",
        "--no-save",
    ]
    proc, _ = _train_until(args, 2)
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        workers = [int(p) for p in f.read().split()]
    assert workers, "no DataLoader worker found"
    os.kill(workers[0], signal.SIGKILL)
    last = _one_line_end(proc)
    assert proc.returncode == 1
    assert "a data loader worker died at update" in last and "no checkpoint_last.pt saved yet" in last, last


def test_interactive_warns_about_invalid_utf8_and_nul_on_its_input(prepared, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"w1 \xff\xfe w2\nw3\x00w4\nw5\n")
    # Not run_forked: a child forked from the suite inherits what earlier tests left behind (multiprocessing's
    # descriptor-sharing state), which once printed a traceback that is not ours. run_cli starts it clean (a
    # fresh interpreter, or a child of the fork server, which never runs a test).
    run = run_cli(
        INTERACTIVE,
        [
            prepared["bin"],
            "--path",
            f"{prepared['save']}/checkpoint_last.pt",
            "--input",
            str(prompts),
            "--beam",
            "1",
            "--max-len-b",
            "2",
            "--cpu",
        ],
    )
    code, out, err = run.returncode, run.stdout, run.stderr
    assert code == 0, err[-2000:]
    warnings = [line for line in (out + err).splitlines() if "invalid UTF-8 byte(s) or NUL" in line]
    assert len(warnings) == 2 and "input line 1: 2 invalid" in warnings[0] and "input line 2: 1" in warnings[1]
    assert "Traceback" not in out + err and "S-2\tw5" in out


def test_a_killed_preprocess_leaves_a_temp_folder_that_the_next_run_removes(prepared, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftovers = {}
    for name, owner in (
        ("dead", f"{socket.gethostname()} {dead.pid}"),
        ("alive", f"{socket.gethostname()} {os.getpid()}"),
        ("elsewhere", f"another-host {dead.pid}"),
    ):
        folder = tmp_path / f".bin.{name}1234.tmp"
        folder.mkdir()
        (folder / ".preprocess.owner").write_text(owner + "\n")
        (folder / "train.bin").write_bytes(b"\0" * 1000)
        leftovers[name] = folder
    code, out, err = run_forked(
        PREPROCESS,
        ["--only-source", "--trainpref", f"{prepared['bad']}/train.txt", "--destdir", str(tmp_path / "bin")],
        str(tmp_path),
    )
    assert code == 0, err[-2000:]
    assert not leftovers["dead"].exists()
    assert leftovers["alive"].exists() and leftovers["elsewhere"].exists()  # a running or unknown writer's
    log = (tmp_path / "bin" / "preprocess.log").read_text()
    assert log.rstrip().endswith(f"Wrote preprocessed data to {tmp_path / 'bin'}")
    assert not (tmp_path / "bin" / ".preprocess.owner").exists()


def test_disk_full_while_copying_to_checkpoint_last_names_that_file(tmp_path, monkeypatch):
    import contextlib
    import errno

    from toolkit.checkpoint import consolidated
    from toolkit.core.errors import UserError

    real = consolidated.atomic_write

    @contextlib.contextmanager
    def full_at_last(path, mode="w", **kwargs):
        if path.endswith("checkpoint_last.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        with real(path, mode, **kwargs) as f:
            yield f

    monkeypatch.setattr(consolidated, "atomic_write", full_at_last)
    with pytest.raises(UserError) as error:
        consolidated.write_checkpoint({"x": torch.zeros(2)}, str(tmp_path), ["checkpoint1.pt", "checkpoint_last.pt"])
    assert str(error.value).startswith(f"could not write {tmp_path / 'checkpoint_last.pt'}: No space left")
    assert (tmp_path / "checkpoint1.pt").exists()


def test_fairseqs_zero_meanings_still_parse():
    """--max-update 0 / --max-epoch 0 (no limit), --save-interval-updates 0 (off), --keep-* -1 (keep all)."""
    from toolkit.train.resolve import parse_train_config

    cfg = parse_train_config(
        [
            "data",
            "--max-update",
            "0",
            "--max-epoch",
            "0",
            "--save-interval-updates",
            "0",
            "--keep-last-epochs",
            "-1",
            "--keep-interval-updates",
            "-1",
            "--patience",
            "-1",
            "--num-workers",
            "0",
            "--batch-size",
            "1",
        ]
    )
    assert (cfg.optimization.max_update, cfg.optimization.max_epoch, cfg.checkpoint.save_interval_updates) == (0, 0, 0)
    assert (cfg.checkpoint.keep_last_epochs, cfg.checkpoint.patience, cfg.dataset.num_workers) == (-1, -1, 0)


def test_ctrl_c_in_preprocess_is_one_line_and_leaves_nothing(prepared, tmp_path, monkeypatch):
    """Ctrl-C while binarizing (raised where the workers' results are collected): exit 130, no temp folder."""
    from toolkit.data import preprocess

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(preprocess, "_binarize_step", interrupted)
    code, out, err = run_forked(
        PREPROCESS,
        ["--only-source", "--trainpref", f"{prepared['bad']}/train.txt", "--destdir", str(tmp_path / "bin")],
        str(tmp_path),
    )
    assert code == 130 and "Traceback" not in out + err
    assert err.strip().splitlines()[-1].startswith("toolkit-preprocess: error: interrupted; nothing was written")
    assert sorted(os.listdir(tmp_path)) == ["stderr", "stdout"]  # no data-bin, no temporary folder
