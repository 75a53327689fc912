"""toolkit-train end to end on a slice of the real WikiText corpus (tiny model, CPU, fp32)."""

import math
import os

import pytest
import torch

from tests.helpers.lm_fixtures import make_wikitext_data_bin
from toolkit.data.dictionary import Dictionary
from tests.helpers.cli import run_cli, train

# Recorded from this code on the CI machine kind (x86-64, torch 2.13 CPU, fp32). Any change to the
# data pipeline, init, model or optimizer moves them; reductions differ in the last bits across
# CPUs, hence the tolerance.
GOLDEN_LOSSES = {1: 13.092, 5: 12.426, 10: 12.496}
GOLDEN_RTOL = 2e-3


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory, wikitext_dir):
    dest = tmp_path_factory.mktemp("wikitext-bin")
    make_wikitext_data_bin(str(dest), wikitext_dir, 600, 60)
    for ext in ("bin", "idx"):  # a test split for eval-lm
        with open(dest / f"valid.{ext}", "rb") as src, open(dest / f"test.{ext}", "wb") as dst:
            dst.write(src.read())
    return str(dest)


@pytest.fixture(scope="module")
def reference_run(data_bin, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("ref"))
    return save, train(
        data_bin, save, "--max-update", "12", "--save-interval-updates", "6", "--validate-interval-updates", "6"
    )


def test_losses_fall_and_match_golden(data_bin, reference_run):
    _, run = reference_run
    losses = run.losses()
    assert sorted(losses) == list(range(1, 13))
    assert losses[12] < losses[1] - 0.5, losses
    # the untrained model predicts roughly uniformly over the vocabulary
    vocab = len(Dictionary.load(os.path.join(data_bin, "dict.txt")))
    assert abs(losses[1] - math.log2(vocab)) < 1.0
    for update, expected in GOLDEN_LOSSES.items():
        assert losses[update] == pytest.approx(expected, rel=GOLDEN_RTOL), (update, losses[update])


def test_same_seed_same_losses(data_bin, reference_run, tmp_path):
    _, ref = reference_run
    again = train(
        data_bin,
        str(tmp_path),
        "--max-update",
        "12",
        "--save-interval-updates",
        "6",
        "--validate-interval-updates",
        "6",
    )
    assert again.losses() == ref.losses()
    other_seed = train(data_bin, str(tmp_path / "s"), "--max-update", "3", "--seed", "4")
    assert other_seed.losses()[3] != ref.losses()[3]


def test_cpu_matmul_libraries_train_alike(data_bin, reference_run, tmp_path):
    """--cpu-matmul: oneDNN and torch's BLAS compute the same fp32 products (only their summation orders differ), so
    the logged losses agree to their printed digits; auto (the reference run) says which it took and why. With
    activation checkpointing (torch's own) the recomputation in backward replays the forward's library: torch's
    products there would save other tensors than oneDNN's, which checkpointing refuses."""
    from toolkit.core import cpu_gemm

    _, ref = reference_run
    assert "CPU fp32 matmuls:" in ref.stdout
    runs = [("torch",), ("onednn",), ("onednn", "--checkpoint-activations")]
    for choice, *extra in runs if cpu_gemm.onednn_available() else runs[:1]:
        name = "-".join((choice, *extra))
        run = train(data_bin, str(tmp_path / name), "--max-update", "6", "--cpu-matmul", choice, *extra)
        for update in range(1, 7):
            assert run.losses()[update] == pytest.approx(ref.losses()[update], rel=5e-4), (name, update)


def test_resume_mid_epoch_gives_same_losses(data_bin, reference_run, tmp_path):
    _, ref = reference_run
    first = train(data_bin, str(tmp_path), "--max-update", "6")
    assert sorted(first.losses()) == list(range(1, 7))
    resumed = train(data_bin, str(tmp_path), "--max-update", "12")
    assert "loaded checkpoint" in resumed.stdout
    assert sorted(resumed.losses()) == list(range(7, 13))
    for update in range(7, 13):
        assert resumed.losses()[update] == pytest.approx(ref.losses()[update], rel=1e-6), update


def test_log_lines_match_fairseq_format(reference_run):
    _, run = reference_run
    inner = run.records("train_inner")[0]
    assert list(inner)[:11] == [
        "epoch",
        "update",
        "loss",
        "ppl",
        "wps",
        "ups",
        "wpb",
        "bsz",
        "num_updates",
        "lr",
        "gnorm",
    ]
    assert list(inner)[11:14] == ["train_wall", "wall", "tps"] and "mfu" in inner
    assert "loss_scale" not in inner and "gb_free" not in inner  # fp32, CPU
    assert all(isinstance(v, str) for k, v in inner.items() if k not in ("epoch", "update"))
    assert float(inner["ppl"]) == pytest.approx(2 ** float(inner["loss"]), rel=1e-2)
    assert inner["num_updates"] == "1" and inner["bsz"] == "4"
    valid = run.records("valid")[0]
    assert list(valid) == [
        "epoch",
        "valid_loss",
        "valid_ppl",
        "valid_wps",
        "valid_wpb",
        "valid_bsz",
        "valid_num_updates",
        "valid_best_loss",
    ]
    assert valid["valid_num_updates"] == "6"
    epoch_line = run.records("train")[-1]
    assert list(epoch_line)[:3] == ["epoch", "train_loss", "train_ppl"]
    assert all(k == "epoch" or k.startswith("train_") for k in epoch_line)
    for line in (
        "num. model params:",
        "training on 1 devices",
        "Stopping training due to num_updates: 12 >= max_update: 12",
        "done training in",
    ):
        assert line in run.stdout, line


def test_checkpoint_files_and_contents(reference_run):
    save, _ = reference_run
    assert sorted(os.listdir(save)) == [
        "checkpoint_1_12.pt",
        "checkpoint_1_6.pt",
        "checkpoint_best.pt",
        "checkpoint_last.pt",
    ]
    state = torch.load(os.path.join(save, "checkpoint_last.pt"), map_location="cpu", weights_only=True)
    assert state["cfg"]["arch"] == "transformer_lm" and state["cfg"]["decoder_layers"] == 2
    assert state["extra_state"]["trainer"]["num_updates"] == 12
    assert {"model", "last_optimizer_state", "extra_state"} <= set(state)
    assert "epoch" in state["extra_state"]["train_iterator"]


def test_eval_lm_and_hub_agree(data_bin, reference_run):
    save, run = reference_run
    ckpt = os.path.join(save, "checkpoint_best.pt")
    ev = run_cli("toolkit_cli.eval_lm", [data_bin, "--path", ckpt, "--tokens-per-sample", "32", "--batch-size", "4"])
    assert ev.returncode == 0, ev.stderr
    assert "Evaluated" in ev.stdout and "Loss (base 2):" in ev.stdout
    eval_loss = float(ev.stdout.split("Loss (base 2): ")[1].split(",")[0])
    valid_loss = float(run.records("valid")[-1]["valid_loss"])
    assert eval_loss == pytest.approx(valid_loss, abs=2e-3)  # same tokens, same blocks as validation

    windowed = run_cli(
        "toolkit_cli.eval_lm",
        [data_bin, "--path", ckpt, "--tokens-per-sample", "32", "--context-window", "16", "--batch-size", "4"],
    )
    assert float(windowed.stdout.split("Loss (base 2): ")[1].split(",")[0]) < eval_loss

    from toolkit.inference import score_stream

    from toolkit.models.transformer_lm import TransformerLanguageModel

    lm = TransformerLanguageModel.from_pretrained(save, "checkpoint_best.pt", data_bin)
    sentence = "the game was released in japan"
    scored = lm.score(sentence)
    direct = score_stream(list(lm.models), lm.encode(sentence), lm.dictionary.eos(), tokens_per_sample=32)
    assert torch.allclose(scored["positional_scores"], direct)
    assert scored["perplexity"] == pytest.approx(math.exp(-direct.mean().item()))
    expected = " ".join(w if w in lm.dictionary else "<unk>" for w in sentence.split())
    assert lm.decode(lm.encode(sentence)) == expected
    text = lm.sample("the game", sampling=True, topk=10, max_len=5, seed=0)
    assert text.startswith("the game")
    assert isinstance(lm.sample("the", beam=2, sampling=False, max_len=3), str)


def test_torch_hub_load(reference_run, data_bin):
    from tests.helpers.cli import REPO_ROOT

    save, _ = reference_run
    lm = torch.hub.load(
        REPO_ROOT,
        "transformer_lm",
        source="local",
        model_dir=save,
        checkpoint_file="checkpoint_best.pt",
        data_name_or_path=data_bin,
    )
    assert lm.score("the game")["perplexity"] > 1.0


def test_hub_data_name_or_path_as_fairseq_reads_it(reference_run, data_bin, monkeypatch):
    """fairseq's rule: './...' is relative to the model folder, any other path as given (here relative to the
    working directory); the model folder itself (the default '.') holds no dict.txt: one line naming the data-bin
    the checkpoint was trained on."""
    from toolkit.core.errors import UserError
    from toolkit.models.transformer_lm import TransformerLanguageModel

    save, _ = reference_run
    monkeypatch.chdir(os.path.dirname(data_bin))
    lm = TransformerLanguageModel.from_pretrained(save, "checkpoint_best.pt", os.path.basename(data_bin))
    relative = TransformerLanguageModel.from_pretrained(save, "checkpoint_best.pt", os.path.relpath(data_bin, save))
    assert (
        lm.score("the game")["positional_scores"].tolist() == relative.score("the game")["positional_scores"].tolist()
    )
    with pytest.raises(UserError, match=rf"holds no dict.txt .*the checkpoint was trained on {data_bin}"):
        TransformerLanguageModel.from_pretrained(save, "checkpoint_best.pt")


def _error_line(run):
    lines = [line for line in run.stderr.strip().splitlines() if line]
    assert run.returncode != 0
    assert lines and "error:" in lines[-1], run.stderr[-2000:]
    return lines[-1]


def test_bad_input(data_bin, tmp_path, reference_run):
    missing = run_cli("toolkit_cli.train", [str(tmp_path / "nope"), "--arch", "transformer_lm", "--batch-size", "2"])
    line = _error_line(missing)
    assert "nope" in line and "data-bin made by toolkit-preprocess" in line

    no_split = train(data_bin, str(tmp_path / "a"), "--valid-subset", "valid9", check=False)
    assert "valid9" in _error_line(no_split)

    unknown = run_cli("toolkit_cli.train", [data_bin, "--arch", "transformer_lm_gpt3_smal", "--batch-size", "2"])
    line = _error_line(unknown)
    assert "transformer_lm_gpt3_small" in line and "--arch" in line

    conflict = train(data_bin, str(tmp_path / "b"), "--fp16", "--bf16", check=False)
    assert "--fp16" in _error_line(conflict)

    save, _ = reference_run
    before = os.path.getmtime(os.path.join(save, "checkpoint_last.pt"))
    other_arch = train(data_bin, save, "--max-update", "20", "--decoder-layers", "3", check=False)
    assert "decoder-layers" in _error_line(other_arch)
    assert os.path.getmtime(os.path.join(save, "checkpoint_last.pt")) == before

    exploding = train(
        data_bin, str(tmp_path / "c"), "--max-update", "5", "--lr", "1e30", "--lr-scheduler", "fixed", check=False
    )
    assert "non-finite" in _error_line(exploding)


def test_hub_applies_the_data_bins_bpe(shakespeare_file, tmp_path):
    """Raw text in, raw text out: the hub encodes with the sentencepiece model saved in the data-bin."""
    with open(shakespeare_file, encoding="utf-8") as f:
        lines = f.read().splitlines()
    (tmp_path / "train.txt").write_text("\n".join(lines[:3000]) + "\n", encoding="utf-8")
    (tmp_path / "valid.txt").write_text("\n".join(lines[3000:3300]) + "\n", encoding="utf-8")
    data = str(tmp_path / "bin")
    prep = run_cli(
        "toolkit_cli.preprocess",
        [
            "--only-source",
            "--trainpref",
            str(tmp_path / "train.txt"),
            "--validpref",
            str(tmp_path / "valid.txt"),
            "--destdir",
            data,
            "--bpe",
            "sentencepiece",
            "--bpe-vocab-size",
            "300",
            "--no-progress-bar",
        ],
    )
    assert prep.returncode == 0, prep.stderr
    train(data, str(tmp_path / "ck"), "--max-update", "3")

    from toolkit.models.transformer_lm import TransformerLanguageModel

    lm = TransformerLanguageModel.from_pretrained(str(tmp_path / "ck"), "checkpoint_best.pt", data)
    sentence = "First Citizen: we are accounted poor citizens"
    ids = lm.encode(sentence)
    assert len(ids) > len(sentence.split()) + 1  # sub-word pieces, then </s>
    assert lm.dictionary.unk() not in ids.tolist()
    assert lm.decode(ids) == sentence
    assert math.isfinite(lm.score(sentence)["perplexity"])
