"""The toolkit against real fairseq 0.12.2, on the shared WikiText-2 split: the same numbers, both ways.

Needs the fairseq built by ``setup.sh`` (``$FAIRSEQ_HOME``, default ~/.cache/toolkit/fairseq-0.12.2).
Runs, in a work folder (default /tmp/fairseq-parity):

1. ``fairseq-preprocess`` and ``toolkit-preprocess`` on the same corpus: the data-bins must be byte-identical;
2. ``fairseq-train``: a small ``transformer_lm`` (2 layers; decoder_input/output_dim left at fairseq's
   512 default, so the checkpoint has ``project_in_dim``/``project_out_dim``);
3. that fairseq checkpoint scored by ``fairseq-eval-lm`` and by ``toolkit-eval-lm``: plain, with
   ``--context-window``, with ``--sample-break-mode eos``, with ``--add-bos-token``;
4. the other way: ``toolkit-train`` a small model, ``toolkit-consolidate --to-fairseq``, scored by
   ``fairseq-eval-lm`` (fairseq's ``load_model_ensemble``) and by ``toolkit-eval-lm`` on our checkpoint;
5. ``toolkit-train --finetune-from-model`` the fairseq checkpoint for 2 updates.

Prints a table, then one JSON line; exits 1 when any perplexity differs by more than 0.1% (``--tolerance``).

    bash benchmarks/fairseq_parity/setup.sh && python -m benchmarks.fairseq_parity.parity

Both tools run as commands in their own interpreters: fairseq's from ``$FAIRSEQ_HOME``'s venv with
``PYTHONPATH`` set to that home (its ``sitecustomize.py`` shim, ``shim_sitecustomize.py``, loads from there) and
its ``src`` (fairseq's unmodified source), the toolkit's with ``PYTHONPATH`` set to this checkout. That
environment of the child processes is the only path set up here; this script's own imports need none.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Dict, List

from benchmarks.timing import REPO, now

DATA = REPO.parent / "shared" / "data" / "wikitext-2-mini"
MODEL = [
    "--arch",
    "transformer_lm",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "64",
    "--decoder-ffn-embed-dim",
    "256",
    "--decoder-attention-heads",
    "4",
]
TRAIN = [
    "--task",
    "language_modeling",
    "--tokens-per-sample",
    "64",
    "--max-tokens",
    "1024",
    "--optimizer",
    "adam",
    "--adam-betas",
    "(0.9, 0.98)",
    "--lr",
    "0.002",
    "--lr-scheduler",
    "inverse_sqrt",
    "--warmup-updates",
    "10",
    "--cpu",
    "--seed",
    "1",
    "--no-epoch-checkpoints",
    "--log-format",
    "json",
    "--log-interval",
    "10",
    "--num-workers",
    "0",
    "--disable-validation",
]
PERPLEXITY = re.compile(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)")


def run(cmd: List[str], env: Dict[str, str], log: pathlib.Path) -> str:
    print("+", " ".join(cmd), flush=True)
    started = now()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write_text(proc.stdout)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}) after {now() - started:.0f}s; see {log}:\n{proc.stdout[-2000:]}")
    return proc.stdout


class Runner:
    def __init__(self, work: pathlib.Path, fairseq_home: pathlib.Path):
        self.work = work
        self.fairseq_python = str(fairseq_home / "venv" / "bin" / "python")
        self.fairseq_env = dict(os.environ, PYTHONPATH=f"{fairseq_home}:{fairseq_home / 'src'}")
        self.toolkit_env = dict(os.environ, PYTHONPATH=str(REPO))
        self.n = 0

    def fairseq(self, tool: str, *args: str) -> str:
        self.n += 1
        return run(
            [self.fairseq_python, "-m", f"fairseq_cli.{tool}", *args],
            self.fairseq_env,
            self.work / f"{self.n:02d}-fairseq-{tool}.log",
        )

    def toolkit(self, tool: str, *args: str) -> str:
        self.n += 1
        return run(
            [sys.executable, "-m", f"toolkit_cli.{tool}", *args],
            self.toolkit_env,
            self.work / f"{self.n:02d}-toolkit-{tool}.log",
        )


def perplexity(output: str) -> float:
    found = PERPLEXITY.findall(output)
    if not found:
        sys.exit(f"no 'Loss (base 2): ..., Perplexity: ...' line in:\n{output[-2000:]}")
    return float(found[-1][1])


def preprocess_both(r: Runner) -> bool:
    splits = [
        "--trainpref",
        str(DATA / "wiki.train.tokens"),
        "--validpref",
        str(DATA / "wiki.valid.tokens"),
        "--testpref",
        str(DATA / "wiki.test.tokens"),
        "--workers",
        "1",
        "--only-source",
    ]
    r.fairseq("preprocess", *splits, "--destdir", str(r.work / "fairseq-bin"))
    r.toolkit("preprocess", *splits, "--destdir", str(r.work / "toolkit-bin"))
    names = [f"{s}.{e}" for s in ("train", "valid", "test") for e in ("bin", "idx")] + ["dict.txt"]
    same = [filecmp.cmp(r.work / "fairseq-bin" / n, r.work / "toolkit-bin" / n, shallow=False) for n in names]
    return all(same)


def score_both(r: Runner, data: str, fairseq_ckpt: str, toolkit_ckpt: str, extra: List[str]) -> Dict[str, float]:
    common = ["--gen-subset", "test", "--tokens-per-sample", "64", "--max-tokens", "4096", "--cpu", *extra]
    return {
        "fairseq": perplexity(r.fairseq("eval_lm", data, "--path", fairseq_ckpt, *common)),
        "toolkit": perplexity(r.toolkit("eval_lm", data, "--path", toolkit_ckpt, *common)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="/tmp/fairseq-parity")
    parser.add_argument(
        "--fairseq-home",
        default=os.environ.get("FAIRSEQ_HOME", str(pathlib.Path.home() / ".cache" / "toolkit" / "fairseq-0.12.2")),
    )
    parser.add_argument("--updates", type=int, default=40, help="training updates of each model")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest relative perplexity difference")
    args = parser.parse_args()
    work = pathlib.Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    r = Runner(work, pathlib.Path(args.fairseq_home))
    data = str(work / "fairseq-bin")
    results = {"data_bin_identical": preprocess_both(r)}

    fs_save = work / "fairseq-ckpt"
    r.fairseq("train", data, *MODEL, *TRAIN, "--max-update", str(args.updates), "--save-dir", str(fs_save))
    fs_ckpt = str(fs_save / "checkpoint_last.pt")
    rows = {
        "fairseq checkpoint": score_both(r, data, fs_ckpt, fs_ckpt, []),
        "fairseq checkpoint, --context-window 32": score_both(r, data, fs_ckpt, fs_ckpt, ["--context-window", "32"]),
        "fairseq checkpoint, --sample-break-mode eos": score_both(
            r, data, fs_ckpt, fs_ckpt, ["--sample-break-mode", "eos"]
        ),
        "fairseq checkpoint, --add-bos-token --context-window 16": score_both(
            r, data, fs_ckpt, fs_ckpt, ["--add-bos-token", "--context-window", "16"]
        ),
    }

    tk_save = work / "toolkit-ckpt"
    r.toolkit("train", data, *MODEL, *TRAIN, "--max-update", str(args.updates), "--save-dir", str(tk_save))
    exported = str(work / "toolkit-as-fairseq.pt")
    r.toolkit("consolidate", str(tk_save / "checkpoint_last.pt"), "--to-fairseq", exported)
    rows["toolkit checkpoint, --to-fairseq"] = score_both(r, data, exported, str(tk_save / "checkpoint_last.pt"), [])
    r.toolkit(
        "train",
        data,
        *MODEL,
        *TRAIN,
        "--max-update",
        "2",
        "--save-dir",
        str(work / "finetuned"),
        "--finetune-from-model",
        fs_ckpt,
    )
    results["finetune_from_fairseq_checkpoint"] = (work / "finetuned" / "checkpoint_last.pt").exists()
    report(rows, results, args.tolerance)


def report(rows: Dict[str, Dict[str, float]], results: Dict[str, object], tolerance: float) -> None:
    print(f"\n{'case':45s} {'fairseq ppl':>12s} {'toolkit ppl':>12s} {'rel. diff':>10s}")
    worst = 0.0
    for name, ppl in rows.items():
        diff = abs(ppl["toolkit"] - ppl["fairseq"]) / ppl["fairseq"]
        worst = max(worst, diff)
        print(f"{name:45s} {ppl['fairseq']:12.2f} {ppl['toolkit']:12.2f} {diff:10.5%}")
    trained = (rows["fairseq checkpoint"]["fairseq"], rows["toolkit checkpoint, --to-fairseq"]["fairseq"])
    print(
        f"the same training command, test ppl (informational: different initial weights and batch order): "
        f"fairseq-train {trained[0]:.2f}, toolkit-train {trained[1]:.2f}"
    )
    print(
        f"data-bins byte-identical: {results['data_bin_identical']}; "
        f"--finetune-from-model on fairseq's checkpoint: {results['finetune_from_fairseq_checkpoint']}"
    )
    ok = worst <= tolerance and all(results.values())
    print(json.dumps({"rows": rows, **results, "worst_relative_diff": worst, "tolerance": tolerance, "ok": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
