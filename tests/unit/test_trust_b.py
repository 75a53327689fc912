"""Issue 35 items 5-8 (trust round four): nothing lost through a symlink or a merge into its own parts,
no unbounded YAML, no wrong number with exit 0, no failure after the work is done.

(The command-line refusals are in ``tests/integration/test_bad_inputs_trust_b.py``.)
"""
from __future__ import annotations

import json
import os

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
        run("--trainpref", valid, "--srcdict", tmp_path / "dict" / "dict.txt", "--num-shards", 2, "--shard-id", shard,
            "--destdir", tmp_path / "big" / str(shard))
    before = sorted(os.listdir(tmp_path / "big" / "0"))
    expect_error(capsys, ["--merge", f"{tmp_path}/big/*", "--destdir", tmp_path / "big", "--overwrite"],
                 "holds the input", "which --overwrite would delete")
    expect_error(capsys, ["--merge", f"{tmp_path}/big/*", "--destdir", tmp_path / "big" / "1", "--overwrite"],
                 "holds the input")
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
