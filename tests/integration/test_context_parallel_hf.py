"""Issue 33's "done when" on an IMPORTED model: a random ``LlamaForCausalLM`` saved by transformers with its
tokenizer, imported with ``toolkit-export --from hf``, fine-tuned on text binarized with that tokenizer.

dp 2 x cp 2 (4 gloo ranks, FSDP2) logs the losses of one process with ``--update-freq 2``, plain and with
``--document-attention-mask --reset-position-ids``; TP 2 x CP 2 (one replica) with ``--update-freq 2`` too.
The imported model brings what a random ``llama_tiny`` does not: GQA, Llama 3.1's rotary scaling, the
imported weights and vocabulary. Five launches in all (the one-process plain run serves both plain layouts).
The layout's own checks (windows, padding, resume, bf16) are in tests/integration/test_context_parallel.py.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests.helpers import dist_helpers as H  # noqa: E402
from tests.helpers.dist_helpers import assert_logged_losses_match  # noqa: E402
from tests.helpers.hf_llama import make_hf  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402

UPDATES = 3
DOCUMENTS = ["--document-attention-mask", "--reset-position-ids"]
#: the imported folder's shapes (tests/helpers/hf_llama.py SHAPES and KINDS["llama"]) as toolkit-train flags
IMPORTED_LLAMA = [
    "--arch",
    "llama",
    "--decoder-ffn-embed-dim",
    "96",
    "--decoder-kv-heads",
    "2",
    "--rms-norm-eps",
    "1e-06",
    "--max-target-positions",
    "64",
    "--rope-theta",
    "500000.0",
    "--rope-scaling-factor",
    "8.0",
    "--rope-original-max-positions",
    "16",
]


def imported_model_and_data(root):
    """(data-bin binarized with the imported tokenizer, the imported checkpoint). The vocabulary has one unused
    row (64, not the tokenizer's 63): with TP, FSDP2 over the other axis (cp, or dp_shard: TP 2 x dp 2 fails the
    same way) places the embedding and output rows as a ``_StridedShard``, and torch's ``distribute_tensor`` of
    the full imported state dict asserts that they split evenly, so 63 rows fail to load at TP 2 x CP 2
    (dp 2 x cp 2 and TP 2 alone load them; real vocabularies, 128256 or 151936, divide)."""
    make_hf(str(root / "hf"), "llama", vocab_size=64)
    run_export(ExportConfig(path=str(root / "hf"), out=str(root / "ours"), import_from="hf"))
    rng = np.random.default_rng(0)
    lines = [" ".join(f"w{i}" for i in rng.integers(0, 60, rng.integers(5, 30))) for _ in range(220)]
    (root / "train.txt").write_text("\n".join(lines[:200]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[200:]) + "\n")
    proc = H.run_train(
        [
            "--only-source",
            "--trainpref",
            str(root / "train.txt"),
            "--validpref",
            str(root / "valid.txt"),
            "--destdir",
            str(root / "bin"),
            "--srcdict",
            str(root / "ours" / "dict.txt"),
            "--bpe",
            "hf_byte_bpe",
            "--bpe-model",
            str(root / "ours" / "tokenizer.json"),
        ],
        module="toolkit_cli.preprocess",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return str(root / "bin"), str(root / "ours" / "model.pt")


def finetune(data, model, save_dir, *flags):
    """T 64 (the imported max_position_embeddings), 4 rows a batch, lr 1e-3 from the imported weights."""
    proc = H.run_train(
        [
            data,
            *IMPORTED_LLAMA,
            "--task",
            "language_modeling",
            "--tokens-per-sample",
            "64",
            "--sample-break-mode",
            "none",
            "--restore-file",
            model,
            "--reset-optimizer",
            "--batch-size",
            "4",
            "--optimizer",
            "adam",
            "--lr",
            "0.001",
            "--seed",
            "3",
            "--max-update",
            str(UPDATES),
            "--cpu",
            "--num-workers",
            "0",
            "--disable-validation",
            "--log-format",
            "json",
            "--log-interval",
            "1",
            "--no-save",
            "--save-dir",
            str(save_dir),
            *flags,
        ],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loaded checkpoint" in proc.stdout
    return H.losses(proc.stdout)


def test_imported_llama_dp2_cp2_and_tp2_cp2_equal_one_process(tmp_path):
    data, model = imported_model_and_data(tmp_path)
    cp4 = ["--distributed-world-size", "4", "--context-parallel-size", "2", "--ddp-backend", "fully_sharded"]
    for name, flags in (("plain", []), ("documents", DOCUMENTS)):
        one = finetune(data, model, tmp_path / f"{name}-one", *flags, "--update-freq", "2")
        dp_cp = finetune(data, model, tmp_path / f"{name}-dp-cp", *flags, *cp4)
        assert_logged_losses_match(dp_cp, one, range(1, UPDATES + 1))
        if name == "plain":
            tp_cp = finetune(data, model, tmp_path / "tp-cp", *cp4, "--model-parallel-size", "2", "--update-freq", "2")
            assert_logged_losses_match(tp_cp, one, range(1, UPDATES + 1))
