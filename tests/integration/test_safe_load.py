"""Forged checkpoints never run code: every entry point refuses them with one line.

Each forgery holds a pickle whose ``__reduce__`` would run ``touch MARKER``; after each
command the marker must not exist, the exit status is non-zero and stderr is one
``prog: error: ...`` line without a traceback.
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.helpers.checkpoints import Payload
from tests.helpers.cli import run_cli, train
from tests.helpers.dist_helpers import make_lm_data_bin
from toolkit.checkpoint import integrity, safe_pickle
from toolkit.core.errors import UserError


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return make_lm_data_bin(str(tmp_path_factory.mktemp("safe") / "bin"))


@pytest.fixture(scope="module")
def sharded_run(data_bin, tmp_path_factory):
    save = tmp_path_factory.mktemp("sharded")
    train(data_bin, str(save), "--max-update", "2", "--use-sharded-state", "--disable-validation")
    consolidated = run_cli("toolkit_cli.consolidate", [str(save / "checkpoint_last")])
    assert consolidated.returncode == 0, consolidated.stderr
    return str(save)


def one_error_line(run, prog: str) -> str:
    assert run.returncode != 0
    assert "Traceback" not in run.stderr and "Traceback" not in run.stdout, run.stderr[-3000:]
    lines = [
        line for line in run.stderr.splitlines() if line.strip() and "Warning" not in line and not line.startswith("  ")
    ]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), run.stderr[-3000:]
    return lines[0]


def copy_run(sharded_run, tmp_path) -> str:
    save = str(tmp_path / "save")
    shutil.copytree(sharded_run, save)
    return save


def forge_metadata(folder: str, marker: str) -> None:
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(Payload(marker), f)


def forge_dcp_item(folder: str, marker: str) -> None:
    """A valid DCP folder whose optimizer hyperparameter (a non-tensor item) is the payload."""
    state = safe_pickle.dcp_to_state_dict(folder)
    state["optim"]["param_groups"][0]["lr"] = Payload(marker)
    for name in os.listdir(folder):
        if name != "meta.pt":
            os.unlink(os.path.join(folder, name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=folder)


def forge_torch_file(path: str, marker: str) -> None:
    with open(path, "wb") as f:
        torch.save({"cfg": {"arch": "transformer_lm"}, "model": Payload(marker)}, f)


def test_real_dcp_metadata_reads_through_the_allowlist(sharded_run):
    folder = os.path.join(sharded_run, "checkpoint_last")
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        safe = safe_pickle.read_dcp_metadata(f, ".metadata")
    reference = dcp.FileSystemReader(folder).read_metadata()  # torch's own (unrestricted) reader
    assert safe.state_dict_metadata == reference.state_dict_metadata
    assert safe.storage_data == reference.storage_data
    full = safe_pickle.dcp_to_state_dict(folder)
    consolidated = torch.load(os.path.join(sharded_run, "checkpoint_last.pt"), weights_only=True)
    for k, v in consolidated["model"].items():
        assert torch.equal(full["model"][k], v), k


@pytest.mark.parametrize("forgery", ["metadata", "dcp_item", "meta_pt"])
def test_forged_sharded_checkpoint(forgery, data_bin, sharded_run, tmp_path):
    save = copy_run(sharded_run, tmp_path)
    folder = os.path.join(save, "checkpoint_last")
    marker = str(tmp_path / "MARKER")
    os.unlink(os.path.join(save, "checkpoint_last.pt"))  # the sharded folder is what resume loads
    if forgery == "metadata":
        forge_metadata(folder, marker)
    elif forgery == "dcp_item":
        forge_dcp_item(folder, marker)
    else:
        forge_torch_file(os.path.join(folder, "meta.pt"), marker)
    integrity.write_folder_checksums(folder)  # a forger who rewrites the checksums: the allowlist must still hold
    resumed = train(data_bin, save, "--max-update", "4", "--use-sharded-state", "--disable-validation", check=False)
    line = one_error_line(resumed, "toolkit-train")
    consolidated = run_cli("toolkit_cli.consolidate", [folder, "-o", str(tmp_path / "out.pt")])
    line2 = one_error_line(consolidated, "toolkit-consolidate")
    for text in (line, line2):
        assert "refusing to load: unexpected object" in text and "system" in text, text
    assert not os.path.exists(marker)
    assert not os.path.exists(tmp_path / "out.pt")


def test_forged_consolidated_checkpoint(data_bin, sharded_run, tmp_path):
    marker = str(tmp_path / "MARKER")
    ckpt = str(tmp_path / "checkpoint_best.pt")
    forge_torch_file(ckpt, marker)
    ev = run_cli("toolkit_cli.eval_lm", [data_bin, "--path", ckpt])
    assert "refusing to load: unexpected object posix.system" in one_error_line(ev, "toolkit-eval-lm")
    resumed = train(data_bin, str(tmp_path / "s"), "--restore-file", ckpt, check=False)
    assert "refusing to load: unexpected object posix.system" in one_error_line(resumed, "toolkit-train")
    from toolkit.inference.hub_utils import from_pretrained

    with pytest.raises(UserError, match="refusing to load: unexpected object"):
        from_pretrained(str(tmp_path), "checkpoint_best.pt", data_bin)
    assert not os.path.exists(marker)
