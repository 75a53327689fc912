"""Hugging Face Llama-family folders through the command line: ``toolkit-export --from hf`` imports and refuses a
folder without tokenizer.json in one line; a Qwen3 folder (also with a local layer), a sliding-window Mistral one, an OLMo 2 one and a Gemma 3 one go in and back out
(``--format hf``) as the same class with the same logits; text binarized with the imported tokenizer continues
training from the imported checkpoint, and the trained model exports back to a folder transformers loads.

The in-process round trips (ids, log-probs, generation, exports) are in tests/unit/test_llama_hf.py.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.helpers.hf_llama import make_hf  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402


def tokenizer(folder):
    """The folder's tokenizer.json as saved (AutoTokenizer would rebuild a Qwen2 folder's as Qwen2's BPE,
    which this word-level test tokenizer is not)."""
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))


def test_the_command_imports_and_refuses_in_one_line(tmp_path):
    from tests.helpers.cli import run_cli

    make_hf(str(tmp_path / "hf"), "llama")
    run = run_cli(
        "toolkit_cli.export", ["--from", "hf", "--path", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]
    )
    assert run.returncode == 0, run.stderr
    assert "converted to --arch llama" in run.stdout + run.stderr
    os.remove(tmp_path / "hf" / "tokenizer.json")
    run = run_cli("toolkit_cli.export", ["--from", "hf", "--path", str(tmp_path / "hf"), "--out", str(tmp_path / "x")])
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("toolkit-export: error: --path ")
    assert "no tokenizer.json" in run.stderr and not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("kind", ["qwen3", "mistral_window", "qwen3_window", "olmo2", "gemma3"])
def test_qwen3_and_windowed_mistral_go_in_and_back_out_through_the_command(tmp_path, kind):
    from tests.helpers.cli import run_cli

    hf = make_hf(str(tmp_path / "hf"), kind)
    run = run_cli(
        "toolkit_cli.export", ["--from", "hf", "--path", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]
    )
    assert run.returncode == 0, run.stderr
    family = {"olmo2": "olmo2", "gemma3": "gemma3"}.get(kind, "llama")  # OLMo 2 and Gemma 3 are families of their own
    assert f"converted to --arch {family}" in run.stdout + run.stderr
    run = run_cli(
        "toolkit_cli.export",
        ["--path", str(tmp_path / "ours" / "model.pt"), "--out", str(tmp_path / "back"), "--format", "hf"],
    )
    assert run.returncode == 0, run.stderr
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    assert type(back).__name__ == type(hf).__name__
    assert getattr(back.config, "sliding_window", None) == getattr(hf.config, "sliding_window", None)
    x = torch.randint(0, 60, (2, 20), generator=torch.Generator().manual_seed(3))  # longer than the window (6)
    with torch.no_grad():
        assert (back(x).logits - hf(x).logits).abs().max().item() < 1e-4


def test_imported_model_continues_training_on_its_tokenizers_data_and_exports(tmp_path):
    """Binarized with the imported tokenizer (ids unchanged, EOS at each line's end), trained from the
    imported checkpoint, exported to the same class that transformers loads (export checks the logits)."""
    import numpy as np

    from tests.helpers import dist_helpers as H
    from toolkit.data.indexed_dataset import MMapIndexedDataset

    make_hf(str(tmp_path / "hf"), "llama")
    run_export(ExportConfig(path=str(tmp_path / "hf"), out=str(tmp_path / "ours"), import_from="hf"))
    rng = np.random.default_rng(0)
    lines = [" ".join(f"w{i}" for i in rng.integers(0, 60, rng.integers(5, 30))) for _ in range(120)]
    (tmp_path / "train.txt").write_text("\n".join(lines[:100]) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(lines[100:]) + "\n")
    proc = H.run_train(
        [
            "--only-source",
            "--trainpref",
            str(tmp_path / "train.txt"),
            "--validpref",
            str(tmp_path / "valid.txt"),
            "--destdir",
            str(tmp_path / "bin"),
            "--srcdict",
            str(tmp_path / "ours" / "dict.txt"),
            "--bpe",
            "hf_byte_bpe",
            "--bpe-model",
            str(tmp_path / "ours" / "tokenizer.json"),
        ],
        module="toolkit_cli.preprocess",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    tok = tokenizer(tmp_path / "hf")
    first = MMapIndexedDataset(str(tmp_path / "bin" / "train"))[0].tolist()
    assert first == tok(lines[0], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    proc = H.run_train(
        [
            str(tmp_path / "bin"),
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
            "--tokens-per-sample",
            "63",
            "--add-bos-token",
            "--restore-file",
            str(tmp_path / "ours" / "model.pt"),
            "--reset-optimizer",
            "--batch-size",
            "4",
            "--optimizer",
            "adam",
            "--lr",
            "0.001",
            "--max-update",
            "3",
            "--cpu",
            "--num-workers",
            "0",
            "--disable-validation",
            "--save-dir",
            str(tmp_path / "ck"),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "loaded checkpoint" in proc.stdout
    saved = torch.load(tmp_path / "ck" / "checkpoint_last.pt", weights_only=True)
    assert saved["extra_state"]["trainer"]["num_updates"] == 3
    run_export(ExportConfig(path=str(tmp_path / "ck" / "checkpoint_last.pt"), out=str(tmp_path / "back"), format="hf"))
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(hf2).__name__ == "LlamaForCausalLM"
    trained = hf2.state_dict()
    original = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).state_dict()
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"], original["model.layers.0.mlp.up_proj.weight"])
