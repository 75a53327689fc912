"""Nothing is lost through a symlink or a merge into its own parts, YAML is bounded, no wrong number comes
with exit 0, and nothing fails after the work is done.

(The command-line refusals are in ``tests/integration/test_bad_inputs_locks_and_bounds.py``.)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import threading
import time

import pytest

from tests.helpers.preprocess import expect_error, run
from toolkit.core import folder_lock
from toolkit.core.errors import UserError
from toolkit.core.fileio import atomic_write


# --- 5. data lost -------------------------------------------------------------------------------------


@pytest.mark.parametrize("lock_name", [folder_lock.SAVE_DIR_LOCK, ".bin.lock"])
def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_kept(tmp_path, lock_name):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    link = tmp_path / lock_name
    os.symlink(target, link)
    with pytest.raises(UserError, match="is a symbolic link or not a plain file; a lock is never followed"):
        with folder_lock.hold(str(link), "--save-dir x", "toolkit-train"):
            pass
    assert target.read_text() == "keep me\n" and os.path.islink(link)
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    with pytest.raises(UserError, match="symbolic link"):
        with folder_lock.hold(str(dangling), "--destdir d", "toolkit-preprocess"):
            pass
    assert not os.path.exists(tmp_path / "nowhere")


def test_a_lock_replaced_while_held_is_not_removed_by_the_holder(tmp_path):
    path = str(tmp_path / folder_lock.SAVE_DIR_LOCK)
    with folder_lock.hold(path, "--save-dir x", "toolkit-train"):
        assert json.loads(open(path).read())["pid"] == os.getpid()
        os.unlink(path)
        os.symlink(tmp_path / "other", path)
    assert os.path.islink(path)  # not ours: left alone


def _take_like_another_run(path, pid: int, after_s: float, fds: list) -> threading.Thread:
    """A thread that, after ``after_s``, puts a complete lock file naming ``pid`` at ``path`` the way a taker
    does (written, locked, renamed into place) and keeps it locked through ``fds``."""

    def put():
        time.sleep(after_s)
        fd = os.open(f"{path}.other", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({"pid": pid, "host": socket.gethostname(), "prog": "toolkit-train"}).encode())
        fds.append(fd)
        os.rename(f"{path}.other", path)

    thread = threading.Thread(target=put)
    thread.start()
    return thread


@pytest.mark.parametrize("found", ["empty", "a holder that has exited"])
def test_a_locked_file_without_a_live_holder_is_looked_at_again_until_it_names_one(tmp_path, monkeypatch, found):
    """A second writer that finds the lock file locked but empty (its taker between lock and write), or locked
    and naming an exited process (a taker replacing a killed run's file), waits for the holder's name."""
    monkeypatch.setattr(folder_lock, "UNSETTLED_HOLDER_WAIT_S", 60.0)
    path = str(tmp_path / folder_lock.SAVE_DIR_LOCK)
    exited = subprocess.Popen(["true"])
    exited.wait()
    being_taken = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(being_taken, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if found != "empty":
        os.write(being_taken, json.dumps({"pid": exited.pid, "host": socket.gethostname()}).encode())
    fds = []
    thread = _take_like_another_run(path, os.getpid(), 0.05, fds)
    try:
        with pytest.raises(UserError, match=rf"in use by toolkit-train \(pid {os.getpid()} on host "):
            with folder_lock.hold(path, "--save-dir x", "toolkit-train"):
                pass
    finally:
        thread.join()
        for fd in [being_taken, *fds]:
            os.close(fd)
    assert os.listdir(tmp_path) == [folder_lock.SAVE_DIR_LOCK]  # no prepared file left behind


def test_a_lock_file_reaches_its_path_locked_and_naming_its_holder(tmp_path, monkeypatch):
    """The taker links (or renames) the lock file into place only once it is locked and names the taker, so a
    second writer never finds it unlocked (and takes it too) nor without a holder; a killed run's is replaced."""
    path = str(tmp_path / folder_lock.SAVE_DIR_LOCK)
    seen = []

    def checked(move):
        def at_the_path(src, dst):
            probe = os.open(src, os.O_RDONLY)
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append((move.__name__, json.loads(os.pread(probe, 4096, 0))["pid"]))
            os.close(probe)
            move(src, dst)

        return at_the_path

    monkeypatch.setattr(folder_lock.os, "link", checked(os.link))
    monkeypatch.setattr(folder_lock.os, "rename", checked(os.rename))
    with folder_lock.hold(path, "--save-dir x", "toolkit-train"):
        pass
    with open(path, "w") as killed_runs:  # left unlocked by a run killed while it held it
        killed_runs.write(json.dumps({"pid": 1, "host": socket.gethostname()}))
    with folder_lock.hold(path, "--save-dir x", "toolkit-train"):
        assert json.loads(open(path).read())["pid"] == os.getpid()
    assert seen == [("link", os.getpid()), ("link", os.getpid()), ("rename", os.getpid())]
    assert os.listdir(tmp_path) == []


def test_atomic_write_never_reopens_its_temporary_name(tmp_path, monkeypatch):
    """The block writes through mkstemp's own descriptor: a symlink put at the temporary name is not followed."""
    import tempfile

    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    real_mkstemp = tempfile.mkstemp

    def mkstemp_then_swap(*a, **k):
        fd, name = real_mkstemp(*a, **k)
        os.unlink(name)
        os.symlink(victim, name)  # what an attacker could do between mkstemp and a reopen
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_swap)
    with atomic_write(str(tmp_path / "out.txt")) as f:
        f.write("new\n")
    assert victim.read_text() == "keep\n"


def test_merge_into_a_destdir_holding_its_parts_is_refused(tmp_path, capsys, wikitext_dir):
    valid = os.path.join(wikitext_dir, "wiki.valid.tokens")
    run("--trainpref", valid, "--dict-only", "--destdir", tmp_path / "dict")
    for shard in range(2):
        run(
            "--trainpref",
            valid,
            "--srcdict",
            tmp_path / "dict" / "dict.txt",
            "--num-shards",
            2,
            "--shard-id",
            shard,
            "--destdir",
            tmp_path / "big" / str(shard),
        )
    before = sorted(os.listdir(tmp_path / "big" / "0"))
    expect_error(
        capsys,
        ["--merge", f"{tmp_path}/big/*", "--destdir", tmp_path / "big", "--overwrite"],
        "holds the input",
        "which --overwrite would delete",
    )
    expect_error(
        capsys, ["--merge", f"{tmp_path}/big/*", "--destdir", tmp_path / "big" / "1", "--overwrite"], "holds the input"
    )
    assert sorted(os.listdir(tmp_path / "big" / "0")) == before and os.path.isdir(tmp_path / "big" / "1")
    run("--merge", f"{tmp_path}/big/*", "--destdir", tmp_path / "merged")  # elsewhere: as before


# --- 6. hangs: every YAML load is bounded -------------------------------------------------------------


def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\ncommon:\n  seed: *a{levels - 1}\n"


def test_an_alias_bomb_is_refused_before_it_is_read(tmp_path):
    from toolkit.compat.fairseq.yaml_config import load_config_file

    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    with pytest.raises(UserError, match=r"--config .*bomb.yaml: its aliases \(\*name\) expand to more than 100,000"):
        load_config_file(str(path))
    path.write_text("a: &a [1, *a]\n")
    with pytest.raises(UserError, match="a value that contains itself"):
        load_config_file(str(path))
    path.write_text("common: &c {seed: 3}\ncheckpoint: {save_dir: x}\nother: *c\n")  # a few aliases: fine
    assert load_config_file(str(path))["other"] == {"seed": 3}


def test_hydra_composition_and_overrides_are_bounded_too(tmp_path):
    pytest.importorskip("hydra")
    from toolkit.compat.fairseq.hydra_compose import compose

    (tmp_path / "model").mkdir()
    (tmp_path / "config.yaml").write_text("defaults:\n  - model: small\ncommon: {seed: 1}\n")
    (tmp_path / "model" / "small.yaml").write_text(_alias_bomb())
    with pytest.raises(UserError, match=r"small.yaml: its aliases"):
        compose(str(tmp_path), "config", [])
    (tmp_path / "model" / "small.yaml").write_text("decoder_layers: 2\n")
    assert compose(str(tmp_path), "config", [])[0]["common"] == {"seed": 1}
    bomb_value = "{" + ", ".join(_alias_bomb().splitlines()[:9]) + "}"
    with pytest.raises(UserError, match="its aliases"):
        compose(None, "config", [f"common.seed={bomb_value}"])


# --- 7. wrong numbers with exit 0: every count and float flag bounded at parse time --------------------


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--batch-size", "0"], "argument --batch-size-valid/--batch-size/--max-sentences: 0: must be at least 1"),
        (["--batch-size", "-3"], "-3: must be at least 1"),
        (["--max-tokens", "0"], "0: must be at least 1"),
        (["--log-interval", "0"], "0: must be at least 1"),
    ],
)
def test_validate_counts_are_bounded(argv, fragment, capsys):
    from toolkit_cli.validate import cli_main

    with pytest.raises(SystemExit) as e:
        cli_main(["data", "--path", "x.pt", *argv])
    assert e.value.code == 1 and fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--tokens-per-sample", "0"], "--tokens-per-sample: 0: must be at least 1"),
        (["--dropout", "1.5"], "--dropout: 1.5: must be in [0, 1)"),
        (["--dropout", "nan"], "--dropout: nan: must be a finite number"),
        (["--lr", "0.1,nan"], "--lr: 0.1,nan: every value must be a finite number"),
        (["--decoder-layers", "0"], "--decoder-layers: 0: must be at least 1"),
        (["--clip-norm", "inf"], "--clip-norm: inf: must be a finite number"),
    ],
)
def test_train_counts_and_floats_are_bounded(argv, fragment, capsys):
    from toolkit.train.resolve import parse_train_config

    with pytest.raises(SystemExit):
        parse_train_config(["data", "--arch", "transformer_lm", *argv])
    assert fragment in capsys.readouterr().err


def test_no_float_flag_takes_nan_or_inf():
    """The class: every float option of every component and command refuses nan and inf at parse time
    (a float field without its own type gets ``finite_float``)."""
    import argparse
    import dataclasses

    from toolkit.config import TrainConfig, options
    from toolkit.core import registry
    from toolkit.inference.eval_lm_main import EvalLMConfig
    from toolkit.train.validate import ValidateConfig

    registry.import_all_components()
    configs = [ValidateConfig, EvalLMConfig]
    configs += [f.type for f in dataclasses.fields(TrainConfig) if dataclasses.is_dataclass(f.type)]
    for reg in (
        registry.TASK_REGISTRY,
        registry.MODEL_REGISTRY,
        registry.CRITERION_REGISTRY,
        registry.OPTIMIZER_REGISTRY,
        registry.LR_SCHEDULER_REGISTRY,
        registry.TOKENIZER_REGISTRY,
    ):
        configs += [e.config for e in reg.entries.values() if e.config]
    checked = 0
    for config in configs:
        parser = argparse.ArgumentParser()
        options.add_dataclass_options(parser, config)
        for action in parser._actions:
            if action.type is None or not action.option_strings or action.choices:
                continue
            try:
                if not isinstance(action.type("1.5"), float):
                    continue  # not a float flag
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                continue
            for bad in ("nan", "inf"):
                try:
                    action.type(bad)
                except (ValueError, argparse.ArgumentTypeError):
                    continue
                pytest.fail(f"{config.__name__} {action.option_strings[0]} takes {bad}")
            checked += 1
    assert checked > 30


def test_the_planner_refuses_what_training_refuses():
    from toolkit.plan.hardware import hardware_from_args, split_hardware_args
    from toolkit.plan.setup import Setup

    for argv, fragment in (
        (["--gpu-tflops", "nan"], "must be a finite number"),
        (["--compute-efficiency", "5"], "must be in (0, 1]"),
        (["--gpu-memory", "0"], "must be between 1 byte and 1PiB"),
        (["--host-memory", "1e400"], "must be between 1 byte and 1PiB"),
        (["--gpus-per-node", "0"], "must be at least 1"),
    ):
        with pytest.raises(UserError, match=__import__("re").escape(fragment)):
            hardware_from_args(split_hardware_args(argv)[0])
    assert hardware_from_args(split_hardware_args(["--compute-efficiency", "1"])[0]).compute_efficiency == 1.0
    import dataclasses

    fields = {f.name: None for f in dataclasses.fields(Setup)}
    base = dict(fields, world=8, mp=3, cp=1, ep=1, pp=1, fsdp=True, strategy="full_shard", shard_group_size=None)
    with pytest.raises(UserError, match="--model-parallel-size 3: must divide the world size 8"):
        Setup(**base).layout(gpus_per_node=8)  # the planner's check is the mesh's own (ParallelDims)
    Setup(**dict(base, mp=4)).layout(gpus_per_node=8)
    with pytest.raises(UserError, match="--shard-group-size 3: must divide the 8 data-parallel ranks"):
        Setup(**dict(base, mp=1, strategy="hybrid_shard", shard_group_size=3)).layout(gpus_per_node=8)


# --- 7. wrong numbers with exit 0: inputs accepted in part, weights that overflow ---------------------


def _records(n: int) -> bytes:
    return b"".join(json.dumps({"text": f"record {i} " + "w " * (i % 13)}).encode() + b"\n" for i in range(n))


@pytest.mark.parametrize("suffix", [".jsonl.zst", ".jsonl.gz"])
def test_a_truncated_compressed_jsonl_is_refused(tmp_path, suffix):
    import gzip

    from toolkit.data.record_inputs import RecordOptions, RecordReport, jsonl_texts

    data = _records(3000)
    if suffix.endswith(".zst"):
        zstd = pytest.importorskip("zstandard")
        whole = zstd.ZstdCompressor().compress(data[:40000]) + zstd.ZstdCompressor().compress(data[40000:])
    else:
        whole = gzip.compress(data)
    full, cut = tmp_path / f"full{suffix}", tmp_path / f"cut{suffix}"
    full.write_bytes(whole)
    cut.write_bytes(whole[: len(whole) // 2])
    assert len(list(jsonl_texts(str(full), RecordOptions(), RecordReport(str(full))))) == 3000  # two frames
    with pytest.raises(UserError, match=r"cut\.jsonl\..*: cannot be read as .*(truncated|end-of-stream marker)"):
        list(jsonl_texts(str(cut), RecordOptions(), RecordReport(str(cut))))


def test_mixture_weights_that_overflow_a_sum_keep_their_shares(tmp_path):
    from toolkit.data.mixture import parse_mixture, source_counts

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    sources = parse_mixture(f"a={tmp_path}/a:1e308,b={tmp_path}/b:1e308")
    assert [s.weight for s in sources] == [0.5, 0.5]
    assert list(source_counts([s.weight for s in sources], 100)) == [50, 50]
    sources = parse_mixture(f"a={tmp_path}/a:3e307,b={tmp_path}/b:1.7976931348623157e308")
    assert sum(s.weight for s in sources) == pytest.approx(1.0) and all(s.weight > 0.1 for s in sources)
    with pytest.raises(UserError, match="the weight of b is too small next to the others"):
        parse_mixture(f"a={tmp_path}/a:1e308,b={tmp_path}/b:1e-300")
    for bad in ("nan", "inf", "-1", "0"):
        with pytest.raises(UserError, match="must be a positive number"):
            parse_mixture(f"a={tmp_path}/a:1,b={tmp_path}/b:{bad}")


def test_the_write_probe_never_follows_a_symlink(tmp_path):
    import socket

    from toolkit.core.preflight import check_writable_folder

    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    os.symlink(victim, tmp_path / f".write_probe.{socket.gethostname()}.{os.getpid()}")
    with pytest.raises(UserError, match="--save-dir"):
        check_writable_folder("--save-dir", str(tmp_path))
    assert victim.read_text() == "keep\n"
    check_writable_folder("--save-dir", str(tmp_path / "fresh"))
    assert os.listdir(tmp_path / "fresh") == []


# --- 8. late failures ---------------------------------------------------------------------------------


def test_harness_output_path_is_checked_before_the_evaluation(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from toolkit.evaluation import harness_main

    def never(*a, **k):
        raise AssertionError("evaluated before --output-path was checked")

    monkeypatch.setattr(harness_main, "task_manager", never)
    monkeypatch.setattr(harness_main, "evaluate", never)
    for out, fragment in (
        (tmp_path / "no_such" / "r.json", "does not exist; create it first"),
        (tmp_path, "is a folder; give a file name"),
    ):
        cfg = harness_main.EvalHarnessConfig(path="x.pt", tasks="t", output_path=str(out))
        with pytest.raises(UserError, match=f"--output-path {out}: .*{fragment}"):
            harness_main.run(cfg)
    assert os.listdir(tmp_path) == []
