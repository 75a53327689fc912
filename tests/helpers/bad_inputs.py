"""The bad-input catalogue's machinery, shared by tests/integration/test_bad_inputs*.py.

The prepared files (data-bins, checkpoints, forged and damaged inputs), a forked runner that gives a
command's real exit status and stderr in seconds, and the promise every case is checked against.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
import traceback

import numpy as np
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.checkpoints import Payload
from toolkit.checkpoint import integrity

TRAIN, EVAL, CONSOLIDATE, PREPROCESS = (
    "toolkit_cli.train",
    "toolkit_cli.eval_lm",
    "toolkit_cli.consolidate",
    "toolkit_cli.preprocess",
)
GENERATE, INTERACTIVE, EXPORT = "toolkit_cli.generate", "toolkit_cli.interactive", "toolkit_cli.export"
PROGS = {
    TRAIN: "toolkit-train",
    EVAL: "toolkit-eval-lm",
    CONSOLIDATE: "toolkit-consolidate",
    PREPROCESS: "toolkit-preprocess",
    GENERATE: "toolkit-generate",
    INTERACTIVE: "toolkit-interactive",
    EXPORT: "toolkit-export",
}
#: commands whose refusals are catalogued only in the later modules (test_bad_inputs.py covers all of PROGS)
MORE_PROGS = {"toolkit_cli.plan": "toolkit-plan", "toolkit_cli.eval_harness": "toolkit-eval-harness"}
NAN_GEN = ["--path", "{bad}/nan.pt", "--beam", "1", "--max-len-b", "3", "--cpu"]
MODEL = "{model}"  # the tiny model's flags with --save-dir {save}, expanded below


def prog_of(module: str) -> str:
    return PROGS.get(module) or MORE_PROGS[module]


# --- the prepared files ---------------------------------------------------------------------------


def _copy_bin(src, dst):
    shutil.copytree(src, dst)
    return dst


def _damaged_bins(data_bin, bad):
    p = _copy_bin(data_bin, f"{bad}/truncated_idx")
    os.truncate(f"{p}/valid.idx", os.path.getsize(f"{p}/valid.idx") - 5)
    os.truncate(f"{p}/train.idx", os.path.getsize(f"{p}/train.idx") - 5)
    p = _copy_bin(data_bin, f"{bad}/short_idx")
    os.truncate(f"{p}/train.idx", 12)
    p = _copy_bin(data_bin, f"{bad}/magic_idx")
    with open(f"{p}/train.idx", "r+b") as f:
        f.write(b"NOTMAGIC!")
    p = _copy_bin(data_bin, f"{bad}/missing_bin")
    os.unlink(f"{p}/train.bin")
    with open(f"{data_bin}/dict.txt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    for name, extra in (("dict_dup", lines[0] + "\n"), ("dict_line", "lonelyword\n")):
        p = _copy_bin(data_bin, f"{bad}/{name}")
        with open(f"{p}/dict.txt", "a", encoding="utf-8") as f:
            f.write(extra)
    p = _copy_bin(data_bin, f"{bad}/shuffled")  # same size, another order
    with open(f"{p}/dict.txt", "w", encoding="utf-8") as f:
        f.write("\n".join(reversed(lines)) + "\n")


def _bad_checkpoints(bad, sharded, marker, save):
    with open(f"{bad}/forged.pt", "wb") as f:
        torch.save({"cfg": {"arch": "transformer_lm"}, "model": Payload(marker)}, f)
    torch.save(
        {
            "cfg": {"common": {"seed": 1}, "model": {"_name": "transformer_lm"}, "task": {"data": "x"}},
            "model": {},
            "optimizer_history": [{"num_updates": 3}],
            "extra_state": {},
        },
        f"{bad}/fairseq.pt",
    )
    torch.save({"args": argparse.Namespace(arch="transformer_lm"), "model": {}}, f"{bad}/fairseq_args.pt")
    with open(f"{bad}/corrupt.pt", "wb") as f:
        f.write(os.urandom(4096))
    open(f"{bad}/empty.pt", "wb").close()
    shutil.copytree(f"{sharded}/checkpoint_last", f"{bad}/forged_sharded")
    with open(f"{bad}/forged_sharded/.metadata", "wb") as f:
        pickle.dump(Payload(marker), f)
    shutil.copytree(f"{sharded}/checkpoint_last", f"{bad}/forged_meta")
    with open(f"{bad}/forged_meta/meta.pt", "wb") as f:
        torch.save({"format": Payload(marker)}, f)
    for forged in ("forged_sharded", "forged_meta"):  # checksums rewritten too: the allowlist must refuse them
        integrity.write_folder_checksums(f"{bad}/{forged}")
    shutil.copytree(f"{sharded}/checkpoint_last", f"{bad}/incomplete_sharded")
    os.unlink(f"{bad}/incomplete_sharded/.metadata")
    open(f"{bad}/empty.txt", "w").close()
    with open(f"{bad}/train.txt", "w") as f:
        f.write("a b c\nd e\n")
    torch.save(torch.zeros(3), f"{bad}/tensor.pt")
    torch.save([1, 2], f"{bad}/list.pt")
    _nan_checkpoint(f"{save}/checkpoint_last.pt", f"{bad}/nan.pt")
    _forged_hf_folder(f"{bad}/hf_forged", marker)


def _text_inputs(bad):
    with open(f"{bad}/blank.txt", "w") as f:
        f.write("\n  \n\n")
    with open(f"{bad}/nul.txt", "wb") as f:
        f.write(b"a b c\nd\0e\n")
    with open(f"{bad}/prompts.txt", "w") as f:
        f.write("w1 w2\n")
    with open(f"{bad}/a_file", "w") as f:
        f.write("not a folder\n")
    os.symlink(f"{bad}/loop", f"{bad}/loop")


def _nan_checkpoint(src, dst):
    """One NaN weight (a bias every position adds, then normalizes): every score of the model is NaN."""
    state = torch.load(src, weights_only=True)
    state["model"]["layers.0.fc2.bias"][0] = float("nan")
    torch.save(state, dst)


def _forged_hf_folder(folder, marker):
    """A transformers GPT-2 folder whose pytorch_model.bin would run a command if unpickled freely."""
    import transformers

    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32).save_pretrained(folder)
    with open(f"{folder}/pytorch_model.bin", "wb") as f:
        torch.save({"transformer.wte.weight": Payload(marker)}, f)


def _data_bins_for_checks(data_bin, bad):
    """An empty split (train and test), a cut dictionary, a corrupted word in a split."""
    from tests.helpers.lm_fixtures import write_split
    from toolkit.data.dictionary import Dictionary
    from toolkit.data.indexed_dataset import MMapIndexedDataset

    size = len(Dictionary.load(f"{data_bin}/dict.txt"))
    p = _copy_bin(data_bin, f"{bad}/empty_split")
    for split in ("train", "test"):
        write_split(f"{p}/{split}", [], size)
    p = _copy_bin(data_bin, f"{bad}/cut_dict")
    with open(f"{p}/dict.txt", encoding="utf-8") as f:
        head = f.read().splitlines()[:4]
    with open(f"{p}/dict.txt", "w", encoding="utf-8") as f:
        f.write("\n".join(head) + "\n")
    p = _copy_bin(data_bin, f"{bad}/corrupt_word")
    dtype = MMapIndexedDataset(f"{p}/valid").dtype
    with open(f"{p}/valid.bin", "r+b") as f:
        f.seek(3 * dtype.itemsize)
        f.write(np.array([250], dtype=dtype).tobytes())  # past the tiny dictionary, within uint8


def prepare(root: str):
    """The catalogue's files under ``root`` (two 2-update trainings, then the damaged and forged inputs);
    yields their paths (a generator: the fixture in tests/integration/conftest.py owns the lifetime)."""
    data_bin = H.make_lm_data_bin(f"{root}/bin")
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                TRAIN,
                data_bin,
                *H.model_args(f"{root}/{name}"),
                "--max-update",
                "2",
                "--disable-validation",
                *extra,
            ],
            cwd=H.REPO_ROOT,
            env=H.subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, extra in (("save", []), ("sharded", ["--use-sharded-state"]))
    ]  # both at once
    _warm_up()
    for run in runs:
        assert run.wait(timeout=300) == 0, run.stderr.read()[-3000:]
    bad = f"{root}/bad"
    os.makedirs(bad)
    _damaged_bins(data_bin, bad)
    _data_bins_for_checks(data_bin, bad)
    _text_inputs(bad)
    _bad_checkpoints(bad, f"{root}/sharded", f"{root}/MARKER", f"{root}/save")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    paths = {
        "root": root,
        "bin": data_bin,
        "save": f"{root}/save",
        "sharded": f"{root}/sharded",
        "bad": bad,
        "port": str(listener.getsockname()[1]),
    }
    yield paths
    listener.close()


def _warm_up() -> None:
    """What every child would redo: imports, the registries, the CPU's measured peak (cached per process)."""
    from toolkit.core import registry
    from toolkit.logging import throughput

    for module in PROGS:
        importlib.import_module(module)
    registry.import_all_components()
    with torch.device("meta"):
        torch.nn.Embedding(8, 8)
    throughput.measure_cpu_peak_flops(torch.float32, threads=1)


def tree_hashes(root: str) -> dict:
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):  # e.g. the symlink loop: its target is what must not change
                out[os.path.relpath(path, root)] = "-> " + os.readlink(path)
                continue
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def expand(argv, paths):
    out = []
    for a in argv:
        if a == MODEL:
            out += H.model_args(paths["save"])
        else:
            out.append(a.format(**paths))
    return out


CASE_TIMEOUT_S = 300  # a refusal comes before any work: a case still running by then has started training


def _wait_or_kill(pid: int, timeout: float, err_path: str) -> int:
    """The child's wait status; a child still running after ``timeout`` seconds is killed and the test fails."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            with open(err_path) as f:
                raise AssertionError(f"not refused: still running after {timeout:.0f} s\n{f.read()[-2000:]}")
        time.sleep(0.05)


def run_forked(module: str, argv, out_dir: str):
    """Run ``module.cli_main(argv)`` in a forked child with stdout/stderr to files; (status, stdout, stderr)."""
    out_path, err_path = f"{out_dir}/stdout", f"{out_dir}/stderr"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.dup2(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
            os.environ.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": H.REPO_ROOT})
            torch.set_num_threads(1)
            sys.argv = [prog_of(module), *argv]
            importlib.import_module(module).cli_main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # what an uncaught exception would print
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    status = _wait_or_kill(pid, CASE_TIMEOUT_S, err_path)
    with open(out_path, errors="replace") as f, open(err_path, errors="replace") as g:
        return os.waitstatus_to_exitcode(status), f.read(), g.read()


def check_bad_input(module, argv, fragment, prepared, tmp_path):
    """The catalogue's promise for one case: exit 1 (argparse errors too), one ``prog: error:`` line holding the
    fragment, no traceback, every prepared file byte-identical, the forged pickle never run."""
    before = tree_hashes(prepared["root"])
    code, out, err = run_forked(module, expand(argv, prepared), str(tmp_path))
    assert code == 1, f"exit {code}\n{out[-2000:]}\n{err[-2000:]}"
    assert "Traceback" not in out + err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"{prog_of(module)}: error: "), err[-3000:]
    assert fragment.format(**prepared) in lines[-1], lines[-1]
    assert sum("error" in line for line in lines) == 1, err[-3000:]
    assert tree_hashes(prepared["root"]) == before  # nothing written, nothing damaged
    assert not os.path.exists(f"{prepared['root']}/MARKER")
