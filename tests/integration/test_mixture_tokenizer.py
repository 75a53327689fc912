"""An imported Llama fine-tuned with ``--data-mixture`` keeps its tokenizer (issue 35, item 1).

The import's logged fine-tune command with ``--data-mixture a=BIN1:0.7,b=BIN2:0.3`` (data-bins binarized with the
import's command): ``--format hf`` writes the model's own tokenizer (``AutoTokenizer`` ids of the original folder,
not a WordLevel over dict.txt); ``ToolkitLM`` with no data folder reads text with it and equals ``lm_eval --model
hf`` (default model_args) on the export, request by request; ``toolkit-eval-lm``, ``toolkit-validate`` and the hub
accept a data folder with the model's dictionary, and refuse one of another dictionary in one line.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
lm_eval = pytest.importorskip("lm_eval")

from tests.helpers import preprocess  # noqa: E402
from tests.helpers.cli import run_cli  # noqa: E402
from tests.helpers.hf_llama import make_hf  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402

TEXTS = ["The tower is w3 w17", "w3 w17 w59 w0", "w1 w2 w40 w40 w7 w12", ""]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    make_hf(str(root / "hf"), "llama")
    run = run_cli("toolkit_cli.export", ["--from", "hf", "--path", str(root / "hf"), "--out", str(root / "ours")])
    assert run.returncode == 0, run.stderr[-2000:]
    flags = re.search(r"fine-tune with: toolkit-train DATA (.*)$", run.stdout + run.stderr, re.M).group(1).split()
    rng = random.Random(0)
    for name in ("a", "b"):
        lines = [" ".join(f"w{rng.randrange(60)}" for _ in range(rng.randint(5, 30))) for _ in range(40)]
        (root / f"{name}.txt").write_text("\n".join(lines) + "\n")
        preprocess.run(
            "--trainpref",
            root / f"{name}.txt",
            "--validpref",
            root / f"{name}.txt",
            "--destdir",
            root / f"bin{name}",
            "--srcdict",
            root / "ours" / "dict.txt",
            "--bpe",
            "hf_byte_bpe",
            "--bpe-model",
            root / "ours" / "tokenizer.json",
            "--workers",
            "1",
        )
    (root / "other.txt").write_text("a b c\nb c d\n")
    preprocess.run(
        "--trainpref",
        root / "other.txt",
        "--validpref",
        root / "other.txt",
        "--destdir",
        root / "other",
        "--workers",
        "1",
    )
    run = run_cli(
        "toolkit_cli.train",
        [
            "--data-mixture",
            f"a={root / 'bina'}:0.7,b={root / 'binb'}:0.3",
            *flags,
            "--save-dir",
            str(root / "ft"),
            "--optimizer",
            "adam",
            "--lr",
            "0.001",
            "--batch-size",
            "4",
            "--max-update",
            "2",
            "--cpu",
            "--num-workers",
            "0",
            "--disable-validation",
            "--no-epoch-checkpoints",
        ],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ckpt = str(root / "ft" / "checkpoint_last.pt")
    run_export(ExportConfig(path=ckpt, format="hf", out=str(root / "export")))
    return dict(root=root, ckpt=ckpt, tok=transformers.AutoTokenizer.from_pretrained(str(root / "hf")))


def test_hf_export_writes_the_models_own_tokenizer(tuned):
    """The file itself (the test tokenizer is word-level, so a WordLevel over dict.txt gives its ids too)."""
    own = (tuned["root"] / "ours" / "tokenizer.json").read_bytes()  # the import's: AutoTokenizer's build
    assert (tuned["root"] / "export" / "tokenizer.json").read_bytes() == own
    exported = transformers.AutoTokenizer.from_pretrained(str(tuned["root"] / "export"))
    assert [exported(t)["input_ids"] for t in TEXTS] == [tuned["tok"](t)["input_ids"] for t in TEXTS]


def test_harness_reads_the_models_tokenizer_and_equals_hf_on_the_export(tuned):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from toolkit.evaluation.harness import ToolkitLM

    ours = ToolkitLM(path=tuned["ckpt"], device="cpu")
    assert [ours.tok_encode(t) for t in TEXTS] == [tuned["tok"](t)["input_ids"] for t in TEXTS]
    hf = HFLM(pretrained=str(tuned["root"] / "export"), batch_size=8, device="cpu")
    pairs = [(TEXTS[i], " " + TEXTS[i + 1].split()[0]) for i in range(len(TEXTS) - 2)]
    requests = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    for x, y in zip(ours.loglikelihood(requests), hf.loglikelihood(requests)):
        assert abs(x[0] - y[0]) < 1e-4 and x[1] == y[1]
    docs = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(TEXTS[:-1])]
    for x, y in zip(ours.loglikelihood_rolling(docs), hf.loglikelihood_rolling(docs)):
        assert abs(x - y) < 1e-4


@pytest.mark.parametrize("command", ["eval_lm", "validate"])
def test_consumers_accept_a_data_folder_of_the_models_dictionary(tuned, command):
    split = ["--gen-subset", "valid"] if command == "eval_lm" else ["--valid-subset", "valid"]
    run = run_cli(f"toolkit_cli.{command}", [str(tuned["root"] / "bina"), "--path", tuned["ckpt"], "--cpu", *split])
    assert run.returncode == 0, run.stderr[-2000:]
    run = run_cli(f"toolkit_cli.{command}", [str(tuned["root"] / "other"), "--path", tuned["ckpt"], "--cpu", *split])
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and "dict.txt" in lines[0], run.stderr[-2000:]


def test_hub_with_a_source_data_bin_reads_text_as_the_tokenizer(tuned):
    from toolkit.inference.hub_utils import from_pretrained

    lm = from_pretrained(
        str(tuned["root"] / "ft"), "checkpoint_last.pt", data_name_or_path=str(tuned["root"] / "bina"), device="cpu"
    )
    assert [lm.encode(t).tolist() for t in TEXTS] == [tuned["tok"](t)["input_ids"] for t in TEXTS]
    assert torch.isfinite(lm.score(TEXTS[1])["positional_scores"]).all()
