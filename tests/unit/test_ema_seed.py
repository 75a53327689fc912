"""--ema-seed-model (fairseq's EMAConfig): the moving average starts at another checkpoint's saved average.

fairseq reads ``extra_state["ema"]`` of the seed checkpoint (``load_ema_from_checkpoint``) into its
EMA model with ``strict=True``. The fairseq-layout checks use files built from fairseq's documented
key names and fairseq's forward pass as the reference; the toolkit check follows fairseq's EMA formula
from the seed through one real update.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers.fairseq_layout import (
    fairseq_010_checkpoint,
    fairseq_main_checkpoint,
    model_options,
    random_fairseq_model,
    reference_logits,
    task_options,
)
from tests.helpers.lm_fixtures import make_data_bin
from toolkit import inference
from toolkit.config import EMAConfig
from toolkit.train.ema import EMA
from toolkit.core.errors import UserError
from toolkit.train.resolve import parse_train_config

LINES = ["the cat sat on the mat", "a dog ran far", "the dog sat on a mat"] * 4
MAX_POS = 24


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("emaseed") / "data")
    return path, len(make_data_bin(path, {"train": LINES, "valid": LINES, "test": LINES}))


def fairseq_file(tmp_path, data, layout, tied, with_ema=True):
    """A fairseq checkpoint whose model and moving average differ; returns (path, the average's fairseq dict)."""
    data_dir, vocab = data
    weights = random_fairseq_model(V=vocab, max_pos=MAX_POS, tied=tied, seed=0)
    average = random_fairseq_model(V=vocab, max_pos=MAX_POS, tied=tied, seed=1)
    build = fairseq_010_checkpoint if layout == "0.10" else fairseq_main_checkpoint
    state = build(weights, model_options(max_pos=MAX_POS, tied=tied), task_options(data_dir, MAX_POS))
    if with_ema:
        state["extra_state"]["ema"] = average
    path = str(tmp_path / f"fairseq_{layout}.pt")
    torch.save(state, path)
    return path, average


@pytest.mark.parametrize("layout,tied", [("0.10", False), ("main", True)])
def test_seeded_from_a_fairseq_checkpoints_average(tmp_path, data, layout, tied):
    path, average = fairseq_file(tmp_path, data, layout, tied)
    model, task, _ = inference.load_model(path, data[0])  # the checkpoint's model weights
    ema = EMA(model, EMAConfig(store_ema=True, ema_seed_model=path))
    ema.copy_to(model)
    tokens = torch.randint(4, len(task.dictionary), (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens)
    torch.testing.assert_close(logits, reference_logits(average, tokens, 2, 1, True, tied), rtol=1e-5, atol=1e-5)


def test_seed_without_an_average_or_of_another_model_is_one_line(tmp_path, data):
    path, _ = fairseq_file(tmp_path, data, "main", False, with_ema=False)
    model, _, _ = inference.load_model(path, data[0])
    with pytest.raises(UserError, match="holds no moving average.*--store-ema"):
        EMA(model, EMAConfig(store_ema=True, ema_seed_model=path))
    other = torch.nn.Linear(3, 3)
    torch.save({"model": other.state_dict(), "extra_state": {"ema": other.state_dict()}}, tmp_path / "other.pt")
    with pytest.raises(UserError, match="--ema-seed-model .*other.pt"):
        EMA(model, EMAConfig(store_ema=True, ema_seed_model=str(tmp_path / "other.pt")))


def test_flag_checks(tmp_path, caplog):
    with pytest.raises(UserError, match="--ema-seed-model .*no such file"):
        parse_train_config(["d", "--max-update", "1", "--store-ema", "--ema-seed-model", str(tmp_path / "x.pt")])
    with caplog.at_level(logging.INFO, logger="toolkit.resolve"):
        cfg = parse_train_config(["d", "--max-update", "1", "--ema-seed-model", "x.pt"])
    assert cfg.ema.ema_seed_model == "x.pt"
    assert (
        sum("--ema-seed-model x.pt: accepted, no effect without --store-ema" in r.getMessage() for r in caplog.records)
        == 1
    )


def test_a_pipeline_stage_seeds_its_layers_from_the_whole_average(tmp_path):
    """A pipeline stage (its model pruned to layers 2-3 and the head) checks a saved average against the whole
    model's names and takes its own part of it."""
    from toolkit.distributed.pipeline import StageSpec, prune_to_stages
    from toolkit.models.llama.config import LlamaConfig
    from toolkit.models.llama.model import LlamaLanguageModel

    cfg = LlamaConfig(decoder_layers=4, decoder_embed_dim=16, decoder_attention_heads=2, decoder_ffn_embed_dim=32)
    cfg.max_target_positions = 8
    whole = LlamaLanguageModel(cfg, 11, 1, seed=1)
    average = {k: torch.randn_like(v) for k, v in whole.state_dict().items()}
    torch.save({"model": whole.state_dict(), "extra_state": {"ema": average}}, tmp_path / "whole.pt")
    with torch.device("meta"):
        stage = LlamaLanguageModel(cfg, 11, 1, seed=1)
    prune_to_stages(stage, [StageSpec(1, (2, 3), False, True)], pp=2)
    stage.to_empty(device="cpu")
    ema = EMA(stage, EMAConfig(store_ema=True, ema_seed_model=str(tmp_path / "whole.pt")))
    assert sorted(ema.shadow) == sorted(stage.state_dict()) and "layers.2.mlp.up_proj.weight" in ema.shadow
    torch.testing.assert_close(ema.shadow, {k: average[k] for k in ema.shadow})
