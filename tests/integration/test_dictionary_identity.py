"""A checkpoint refuses a data-bin whose dict.txt has the same size but other symbols or order."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.cli import run_cli
from toolkit.data.dictionary import Dictionary
from toolkit.core.errors import UserError


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("dictid")
    data_bin = H.make_lm_data_bin(str(root / "bin"))
    proc = H.run_train([data_bin] + H.model_args(str(root / "save")) + ["--max-update", "2", "--disable-validation"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Same size, same binarized ids, another order: the "perplexity 14,049 instead of 550".
    shuffled = str(root / "shuffled")
    shutil.copytree(data_bin, shuffled)
    d = Dictionary.load(os.path.join(data_bin, "dict.txt"))
    with open(os.path.join(shuffled, "dict.txt"), "w", encoding="utf-8") as f:
        for sym in reversed(d.symbols[d.nspecial :]):
            f.write(f"{sym} 1\n")
    return data_bin, shuffled, str(root / "save" / "checkpoint_last.pt")


def test_checkpoint_records_the_hash(trained):
    data_bin, _, ckpt = trained
    state = torch.load(ckpt, weights_only=True)
    assert state["extra_state"]["dictionary_hash"] == Dictionary.load(os.path.join(data_bin, "dict.txt")).symbols_hash()


def test_eval_resume_and_hub_refuse_another_dictionary(trained, tmp_path):
    data_bin, shuffled, ckpt = trained
    ours = Dictionary.load(os.path.join(data_bin, "dict.txt")).symbols_hash()
    theirs = Dictionary.load(os.path.join(shuffled, "dict.txt")).symbols_hash()
    expected = f"trained with dictionary {ours} but {os.path.join(shuffled, 'dict.txt')} is {theirs}"
    ev = run_cli("toolkit_cli.eval_lm", [shuffled, "--path", ckpt, "--gen-subset", "valid"])
    assert ev.returncode == 1 and expected in ev.stderr.strip().splitlines()[-1], ev.stderr[-2000:]
    assert "Traceback" not in ev.stderr
    save = tmp_path / "save"
    shutil.copytree(os.path.dirname(ckpt), save)
    resumed = H.run_train([shuffled] + H.model_args(str(save)) + ["--max-update", "4", "--disable-validation"])
    assert resumed.returncode == 1 and expected in resumed.stderr.strip().splitlines()[-1], resumed.stderr[-2000:]
    from toolkit.inference.hub_utils import from_pretrained

    with pytest.raises(UserError, match=expected):
        from_pretrained(os.path.dirname(ckpt), "checkpoint_last.pt", shuffled)


def test_checkpoint_without_hash_loads_with_a_warning(trained, tmp_path):
    data_bin, _, ckpt = trained
    state = torch.load(ckpt, weights_only=True)
    del state["extra_state"]["dictionary_hash"]
    old = str(tmp_path / "old.pt")
    torch.save(state, old)
    ev = run_cli("toolkit_cli.eval_lm", [data_bin, "--path", old, "--gen-subset", "valid"])
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert "records no dictionary hash" in ev.stdout + ev.stderr
