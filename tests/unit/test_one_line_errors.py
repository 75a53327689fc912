"""In-process: what could print a traceback or many lines says one line, and what a killed run left is cleaned.

(The command-line refusals are in ``tests/integration/test_bad_inputs_hf_folders_and_cli.py``.)
"""

from __future__ import annotations

import os
import time

import pytest

from toolkit.core.errors import UserError


# --- 9. tracebacks ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.helpers.hf_llama import make_hf

    folder = str(tmp_path_factory.mktemp("hf") / "good")
    make_hf(folder, "llama")
    return folder


def _malformed_names():
    try:
        from tests.helpers.hf_llama import MALFORMED
    except ImportError:  # no transformers: the fixture skips
        return ["none"]
    return sorted(MALFORMED)


@pytest.mark.parametrize("name", _malformed_names())
def test_every_malformed_file_of_an_hf_folder_is_one_user_error_naming_it(llama_folder, name, tmp_path):
    from tests.helpers.hf_llama import MALFORMED, malformed_copy
    from toolkit.export.api import ExportConfig, run_export

    folder = malformed_copy(llama_folder, str(tmp_path / name), name)
    _, file, fragment = MALFORMED[name]
    with pytest.raises(UserError) as e:
        run_export(ExportConfig(path=folder, out=str(tmp_path / "out"), import_from="hf"))
    message = str(e.value)
    assert message.startswith(os.path.join(folder, file) + ": ") and fragment in message, message
    assert "\n" not in message and not os.path.exists(tmp_path / "out")


def test_the_hf_readers_guard_parses_only(tmp_path):
    """``malformed_file`` turns parse errors into one line naming the file; anything else passes through."""
    from toolkit.core.errors import malformed_file, read_json_object

    with pytest.raises(UserError, match=r"^f.json: no 'k'; redo it$"):
        with malformed_file("f.json", "redo it"):
            {}["k"]
    with pytest.raises(MemoryError):
        with malformed_file("f.json", "redo it"):
            raise MemoryError()
    path = tmp_path / "x.json"
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(UserError, match="x.json: UnicodeDecodeError"):
        read_json_object(str(path), "redo it")
    path.write_text('"text"')
    with pytest.raises(UserError, match="holds a JSON str, not an object"):
        read_json_object(str(path), "redo it")


def test_plan_sizes_beyond_any_machine_are_one_line():
    from toolkit.plan.hardware import parse_bytes

    assert parse_bytes("80GiB", "--gpu-memory") == 80 << 30
    for text in ("1e400", "1e30TiB"):
        with pytest.raises(UserError, match=f"--gpu-memory {text}: must be between 1 byte and 1PiB"):
            parse_bytes(text, "--gpu-memory")


@pytest.mark.parametrize(
    "value,ok",
    [
        ("0.5", True),
        ("10", True),
        ("0", False),
        ("-3", False),
        ("2.5", False),
        ("inf", False),
        ("nan", False),
        ("x", False),
    ],
)
def test_harness_limit_is_checked_at_parse_time(value, ok):
    import argparse

    from toolkit.evaluation.harness_main import example_limit

    if ok:
        assert example_limit(value) == float(value)
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            example_limit(value)


def test_a_failing_ranks_line_is_torchruns_root_cause(tmp_path, monkeypatch, capsys):
    """torchrun reads the rank's error file for its failure report: the line, not "To enable traceback see"."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from toolkit.core.errors import print_error_line

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    print_error_line("toolkit-train", "--save-dir x: bad\nreally")
    line = "toolkit-train: error: --save-dir x: bad really"
    assert capsys.readouterr().err == line + "\n"
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message["message"] == line


# --- 10. smaller -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module",
    [
        "toolkit_cli.train",
        "toolkit_cli.eval_lm",
        "toolkit_cli.generate",
        "toolkit_cli.preprocess",
        "toolkit_cli.export",
        "toolkit_cli.plan",
        "toolkit_cli.eval_harness",
        "toolkit_cli.consolidate",
        "toolkit_cli.validate",
        "toolkit_cli.interactive",
    ],
)
def test_argparse_errors_are_one_line_and_exit_1(module, capsys):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).cli_main(["--no-such-flag"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.splitlines()) == 1 and ": error: " in err, err


def _killed_launcher_with_a_rank(lock: str) -> int:
    """A launcher that takes the lock, forks a rank and dies without releasing anything; the rank's PID (it keeps
    the lock: the flock is on the open file it inherited)."""
    from toolkit.core import folder_lock

    read, write = os.pipe()
    launcher = os.fork()
    if launcher == 0:
        with folder_lock.hold(lock, "--save-dir x", "toolkit-train"):
            rank = os.fork()
            if rank == 0:
                os.close(write)
                time.sleep(120)
                os._exit(0)
            os.write(write, str(rank).encode())
            os._exit(0)  # killed: no finally runs
    os.close(write)
    os.waitpid(launcher, 0)
    with os.fdopen(read) as f:
        return int(f.read())


def test_lock_refusal_names_the_orphaned_rank_not_the_dead_launcher(tmp_path, monkeypatch):
    from toolkit.core import folder_lock

    monkeypatch.setattr(folder_lock, "UNSETTLED_HOLDER_WAIT_S", 0.05)  # a dead holder is looked at again this long
    lock = str(tmp_path / folder_lock.SAVE_DIR_LOCK)
    rank = _killed_launcher_with_a_rank(lock)
    try:
        with pytest.raises(UserError) as e:
            with folder_lock.hold(lock, "--save-dir x", "toolkit-train"):
                pass
        message = str(e.value)
        assert message.startswith(f"--save-dir x: in use by process {rank} (started by toolkit-train (pid "), message
        assert f"which has exited: an orphaned rank; stop it with kill {rank})" in message, message
    finally:
        os.kill(rank, 9)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the rank gone (reparented: not ours to reap), the lock is free
        try:
            with folder_lock.hold(lock, "--save-dir x", "toolkit-train"):
                break
        except UserError:
            time.sleep(0.1)
    else:
        raise AssertionError("the lock was not released when its rank died")


def test_an_escaped_nul_in_a_record_is_skipped_like_a_raw_one(tmp_path, caplog):
    from toolkit.data.record_inputs import RecordOptions, write_as_documents

    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"text": "a b"}\n{"text": "c\\u0000d"}\n{"text": "e\x00f"}\n{"text": "g"}\n')
    out = tmp_path / "out.txt"
    report = write_as_documents("jsonl", str(path), str(out), RecordOptions(), "--trainpref r.jsonl")
    assert out.read_bytes() == b"a b\0g\0" and report.written == 2
    assert report.bad == {"holds a NUL character": 1, "not a JSON object": 1}


def test_a_killed_preprocess_leaves_no_record_text_behind(tmp_path):
    """The text of a killed run's records (as big as its inputs) is removed by the next run into the folder."""
    from toolkit.data.preprocess import PreprocessConfig, inputs_as_documents

    path = tmp_path / "r.jsonl"
    path.write_text('{"text": "a b"}\n')
    cfg = PreprocessConfig(only_source=True, trainpref=str(path), destdir=str(tmp_path / "bin"))
    splits = [("train", "--trainpref", str(path))]
    pid = os.fork()
    if pid == 0:  # a run killed while its records are text: no finally runs
        with inputs_as_documents(cfg, splits):
            os._exit(0)
    os.waitpid(pid, 0)
    left = [n for n in os.listdir(tmp_path) if n.endswith(".inputs.tmp")]
    assert len(left) == 1
    with inputs_as_documents(cfg, splits) as (_, converted):
        assert os.path.isfile(converted[0][2])
        assert not os.path.exists(tmp_path / left[0])  # removed before this run wrote its own
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".inputs.tmp")]


def test_setup_task_after_the_eval_lm_parser(tmp_path):
    """fairseq's script shape: eval-lm's ``--tokens-per-sample`` not given (None) is the task's default."""
    from tests.helpers import dist_helpers as H
    from toolkit import options, tasks

    data_bin = H.make_lm_data_bin(str(tmp_path / "bin"))
    args = options.parse_args_and_arch(options.get_eval_lm_parser(), [data_bin, "--path", "x.pt"])
    task = tasks.setup_task(args)
    assert task.cfg.tokens_per_sample == 1024 and len(task.dictionary) > 4
