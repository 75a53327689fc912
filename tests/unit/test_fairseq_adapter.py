"""toolkit.compat.fairseq.adapter: callers hand it any checkpoint; a toolkit one passes through untouched,
a fairseq one comes back under our names (the callers never branch on the format themselves)."""

from __future__ import annotations

import torch

from tests.helpers.fairseq_layout import fairseq_main_checkpoint, model_options, random_fairseq_model, task_options
from toolkit.compat.fairseq import adapter

V, MAX_POS = 40, 32


def _fairseq_state(data: str = "data-bin/x"):
    sd = random_fairseq_model(V=V, max_pos=MAX_POS)
    return sd, fairseq_main_checkpoint(sd, model_options(max_pos=MAX_POS), task_options(data, MAX_POS))


def test_a_toolkit_checkpoint_passes_through():
    weights = {"embed_tokens.weight": torch.randn(4, 2)}
    ours = {"cfg": {"arch": "transformer_lm"}, "model": weights, "extra_state": {}}
    assert adapter.as_toolkit_state("ours.pt", ours) is ours
    assert adapter.model_weights("ours.pt", torch.nn.Linear(2, 2), ours) is weights
    assert adapter.resume_trainer("ours.pt", ours, trainer=None, reset_optimizer=False) is None
    assert adapter.load_weights_into_trainer("ours.pt", ours, trainer=None) is False
    assert adapter.average_weights("ours.pt", ours, weights, torch.nn.Linear(2, 2)) is weights


def test_a_fairseq_checkpoint_comes_back_under_our_names():
    sd, state = _fairseq_state()
    imported = adapter.as_toolkit_state("fs.pt", state)
    assert imported is not state and imported["cfg"]["arch"] == "transformer_lm"
    assert imported["cfg"]["decoder_layers"] == 2 and imported["cfg"]["tokens_per_sample"] == MAX_POS
    assert not any(name.startswith("decoder.") for name in imported["model"])
    torch.testing.assert_close(imported["model"]["embed_tokens.weight"], sd["decoder.embed_tokens.weight"])
    assert "fairseq_source" in imported


def test_adapter_reads_a_fairseq_file(tmp_path):
    sd, state = _fairseq_state(str(tmp_path))
    path = str(tmp_path / "checkpoint_last.pt")
    torch.save(state, path)
    read = adapter.read_checkpoint(path)
    assert read["optimizer_history"][-1]["num_updates"] == 7
    torch.testing.assert_close(read["model"]["decoder.embed_tokens.weight"], sd["decoder.embed_tokens.weight"])
    assert adapter.shard_files(path) == []
