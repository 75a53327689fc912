"""fairseq's training flags of issue 11 item 4: parsed under fairseq's names, with fairseq's effect.

Parse-level checks use ``parse_train_config`` in process; the effects on a run use tiny
``toolkit-train`` runs (a few updates) on a slice of WikiText.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.lm_fixtures import make_wikitext_data_bin
from tests.helpers.cli import REPO_ROOT, train


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory, wikitext_dir):
    dest = str(tmp_path_factory.mktemp("flags-bin"))
    make_wikitext_data_bin(dest, wikitext_dir, 60, 20)
    return dest


def test_validation_flags_in_a_run(data_bin, tmp_path):
    run = train(
        data_bin,
        str(tmp_path / "s"),
        "--max-update",
        "4",
        "--validate-interval-updates",
        "1",
        "--validate-after-updates",
        "3",
        "--keep-best-checkpoints",
        "1",
        "--fixed-validation-seed",
        "7",
        "--skip-invalid-size-inputs-valid-test",
        "--max-sentences-valid",
        "2",
        "--combine-val",
    )
    valid = run.records("valid")
    assert [int(r["valid_num_updates"]) for r in valid] == [3, 4]  # nothing before --validate-after-updates
    assert {r["valid_bsz"] for r in valid} == {"2"}  # --max-sentences-valid
    assert f"{data_bin} valid 20 examples" in run.stdout  # --combine-val without valid1: valid alone
    best = min(float(r["valid_loss"]) for r in valid if int(r["valid_num_updates"]) == 4)
    assert [n for n in os.listdir(tmp_path / "s") if n.startswith("checkpoint.best_")] == [
        f"checkpoint.best_loss_{best:.3f}0.pt"
    ]  # one kept: the digit is randint(0, 1) = 0


def test_saves_between_validations_do_not_validate(data_bin, tmp_path):
    """With --validate-interval-updates the interval alone decides when to validate: a save every update
    validates only at updates 3 and 6 (and the last), not at each save as fairseq's mid-epoch saves do without it;
    checkpoint_best follows those validations. Without the flag, every mid-epoch save validates (fairseq)."""
    common = ["--max-update", "6", "--save-interval-updates", "1", "--no-epoch-checkpoints"]
    run = train(data_bin, str(tmp_path / "s"), *common, "--validate-interval-updates", "3")
    assert [int(r["valid_num_updates"]) for r in run.records("valid")] == [3, 6]
    scores = {int(r["valid_num_updates"]): float(r["valid_loss"]) for r in run.records("valid")}
    best = torch.load(tmp_path / "s" / "checkpoint_best.pt", weights_only=True, map_location="cpu")["extra_state"]
    assert best["best"] == min(scores.values()) and best["trainer"]["num_updates"] == min(scores, key=scores.get)
    fairseq_way = train(data_bin, str(tmp_path / "f"), *common)
    assert [int(r["valid_num_updates"]) for r in fairseq_way.records("valid")] == [1, 2, 3, 4, 5, 6]


def test_pytorch_ddp_takes_ddp_flags(data_bin, tmp_path):
    """2 ranks on CPU (gloo): fairseq's backend name and DDP's own flags reach DistributedDataParallel."""
    run = train(
        data_bin,
        str(tmp_path / "s"),
        "--max-update",
        "2",
        "--ddp-backend",
        "pytorch_ddp",
        "--find-unused-parameters",
        "--bucket-cap-mb",
        "1",
        "--distributed-world-size",
        "2",
        "--no-save",
        "--disable-validation",
    )
    assert "using fairseq's equivalent here, --ddp-backend c10d" in run.stdout and sorted(run.losses()) == [1, 2]
    assert "FutureWarning" not in run.stderr, run.stderr  # e.g. DDP's deprecated broadcast_buffers


def test_update_freq_list_changes_per_epoch(data_bin, tmp_path):
    run = train(
        data_bin,
        str(tmp_path / "s"),
        "--max-epoch",
        "3",
        "--update-freq",
        "1,2",
        "--no-save",
        "--disable-validation",
        "--lr",
        "0.002,0.001",
        "--lr-scheduler",
        "fixed",
        "--warmup-updates",
        "0",
    )
    ends = [int(r["train_num_updates"]) for r in run.records("train")]
    first = ends[0]
    assert ends[1] - ends[0] == (first + 1) // 2 and ends[2] - ends[1] == (first + 1) // 2
    assert [float(r["train_lr"]) for r in run.records("train")] == [0.002, 0.001, 0.001]  # --lr per epoch


def test_ema_saved_under_fairseqs_key(data_bin, tmp_path):
    save = str(tmp_path / "s")
    train(data_bin, save, "--max-update", "3", "--store-ema", "--ema-decay", "0.5", "--ema-start-update", "3")
    ckpt = torch.load(os.path.join(save, "checkpoint_last.pt"), weights_only=True)
    # decay 0 until update 3 (a copy of update 2's weights), then 0.5 * that + 0.5 * update 3's weights
    assert set(ckpt["extra_state"]["ema"]) == set(ckpt["model"])
    key = "layers.0.fc1.weight" if "layers.0.fc1.weight" in ckpt["model"] else next(iter(ckpt["model"]))
    assert not torch.equal(ckpt["extra_state"]["ema"][key], ckpt["model"][key])
    run = train(data_bin, save, "--max-update", "4", "--store-ema", "--ema-decay", "0.5")
    assert "EMA not found" not in run.stdout


def test_finetune_from_model_and_restore_file(data_bin, tmp_path):
    pre = str(tmp_path / "pre")
    fresh = train(data_bin, pre, "--max-update", "3", "--restore-file", "no/such.pt")
    assert "No existing checkpoint found no/such.pt" in fresh.stdout  # fairseq: a missing file starts fresh
    pretrained = os.path.join(pre, "checkpoint_last.pt")
    tuned = str(tmp_path / "tuned")
    run = train(
        data_bin,
        tuned,
        "--max-update",
        "2",
        "--finetune-from-model",
        pretrained,
        "--lr",
        "1e-12",
        "--lr-scheduler",
        "fixed",
        "--disable-validation",
    )
    assert "loading pretrained model from" in run.stdout
    a = torch.load(pretrained, weights_only=True)
    b = torch.load(os.path.join(tuned, "checkpoint_last.pt"), weights_only=True)
    assert b["extra_state"]["trainer"]["num_updates"] == 2  # counters reset; weights carried over
    for k, v in a["model"].items():
        torch.testing.assert_close(b["model"][k], v, atol=1e-6, rtol=0)
    again = train(data_bin, tuned, "--max-update", "3", "--finetune-from-model", pretrained, "--disable-validation")
    assert "loading pretrained model from" not in again.stdout and "@ 2 updates" in again.stdout

    relative = os.path.relpath(pretrained, REPO_ROOT)  # run_cli runs in the repository root
    resumed = train(
        data_bin, str(tmp_path / "other"), "--max-update", "4", "--restore-file", relative, "--disable-validation"
    )
    assert "@ 3 updates" in resumed.stdout


def test_finetune_from_a_fairseq_checkpoint(tmp_path):
    """fairseq's own transformer_lm file: its weights, by our names, with a fresh optimizer and counters."""
    from tests.helpers.fairseq_layout import fairseq_main_checkpoint, model_options, random_fairseq_model, task_options
    from tests.helpers.lm_fixtures import make_data_bin
    from toolkit.compat.fairseq import checkpoint as fairseq_checkpoint
    from toolkit.models.transformer_lm import TransformerLMConfig

    data = str(tmp_path / "data")
    vocab = len(make_data_bin(data, {"train": ["the cat sat on the mat", "a dog ran far"] * 8, "valid": ["a cat"]}))
    state = fairseq_main_checkpoint(
        random_fairseq_model(V=vocab, max_pos=24), model_options(max_pos=24), task_options(data, 24)
    )
    path = str(tmp_path / "fairseq.pt")
    torch.save(state, path)
    save = str(tmp_path / "tuned")
    train(
        data,
        save,
        "--max-update",
        "1",
        "--finetune-from-model",
        path,
        "--decoder-embed-dim",
        "16",
        "--decoder-input-dim",
        "16",
        "--decoder-output-dim",
        "16",
        "--decoder-ffn-embed-dim",
        "24",
        "--decoder-learned-pos",
        "--decoder-normalize-before",
        "--tokens-per-sample",
        "24",
        "--max-target-positions",
        "24",
        "--lr",
        "1e-12",
        "--lr-scheduler",
        "fixed",
        "--disable-validation",
    )
    tuned = torch.load(os.path.join(save, "checkpoint_last.pt"), weights_only=True)
    expected = fairseq_checkpoint.import_checkpoint(path, state, TransformerLMConfig)["model"]
    assert tuned["extra_state"]["trainer"]["num_updates"] == 1  # fairseq's 7 updates are not carried over
    for k, v in expected.items():
        torch.testing.assert_close(tuned["model"][k], v, atol=1e-6, rtol=0)
