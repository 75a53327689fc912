"""One weight check (toolkit.checkpoint.model_fit.check_weights) for a fairseq checkpoint's weights and a seed
checkpoint's moving average: the same one line naming the weight, both shapes and what to do."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.fairseq_layout import fairseq_main_checkpoint, model_options, random_fairseq_model, task_options
from tests.helpers.lm_fixtures import make_data_bin
from toolkit import inference
from toolkit.checkpoint.model_fit import check_weights
from toolkit.config import EMAConfig
from toolkit.core.errors import UserError
from toolkit.train.ema import EMA

LINES = ["the cat sat on the mat", "a dog ran far", "the dog sat on a mat"] * 4
MAX_POS = 24
FC1 = "layers.0.fc1.weight"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("weights") / "data")
    return path, len(make_data_bin(path, {"train": LINES, "valid": LINES, "test": LINES}))


def message(saved, expected, **kwargs) -> str:
    with pytest.raises(UserError) as e:
        check_weights("x.pt", saved, expected, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_each_mismatch_is_named_with_the_fix():
    model = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    check_weights("x.pt", {"a": torch.ones(2, 3), "b": torch.ones(4)}, model)  # a match passes
    check_weights("x.pt", {"a": (2, 3), "b": (4,)}, model)  # shapes stand for tensors
    assert message({"a": torch.ones(3, 2), "b": torch.ones(4)}, model) == (
        "x.pt: a has shape (3, 2) in the checkpoint, (2, 3) in this model; use the same model options"
    )
    assert message({"a": torch.ones(2, 3), "b": torch.ones(4), "c": torch.ones(1)}, model, fix="do X") == (
        "x.pt: the checkpoint has c, which this model does not; do X"
    )
    assert message({"a": torch.ones(2, 3)}, model, saved_as="the average", describe=lambda n: f"<{n}>") == (
        "x.pt: the average has no weight for <b>; use the same model options"
    )


def fairseq_file(tmp_path, data, change=None, average_change=None):
    data_dir, vocab = data
    weights = random_fairseq_model(V=vocab, max_pos=MAX_POS, seed=0)
    average = random_fairseq_model(V=vocab, max_pos=MAX_POS, seed=1)
    for sd, edit in ((weights, change), (average, average_change)):
        if edit:
            edit(sd)
    state = fairseq_main_checkpoint(weights, model_options(max_pos=MAX_POS), task_options(data_dir, MAX_POS))
    state["extra_state"]["ema"] = average
    path = str(tmp_path / "fairseq.pt")
    torch.save(state, path)
    return path


def wrong_fc1(sd):
    sd["decoder." + FC1] = torch.ones(3, 3)


def test_a_fairseq_weight_of_another_shape(tmp_path, data):
    path = fairseq_file(tmp_path, data, change=wrong_fc1)
    with pytest.raises(UserError) as e:
        inference.load_model(path, data[0])
    assert str(e.value).startswith(
        f"{path}: cannot load: {FC1} (fairseq name decoder.{FC1}) has shape (3, 3) in the checkpoint, ("
    )
    assert "in this model; the model is built from the checkpoint's own options" in str(e.value)


def test_a_fairseq_weight_missing(tmp_path, data):
    path = fairseq_file(tmp_path, data, change=lambda sd: sd.pop("decoder." + FC1))
    with pytest.raises(
        UserError,
        match=f"cannot load: the checkpoint has no weight for {FC1} "
        rf"\(fairseq name decoder.{FC1}\)",
    ):
        inference.load_model(path, data[0])


def test_a_seed_average_of_another_shape_says_the_same(tmp_path, data):
    path = fairseq_file(tmp_path, data, average_change=wrong_fc1)
    model, _, _ = inference.load_model(path, data[0])
    with pytest.raises(UserError) as e:
        EMA(model, EMAConfig(store_ema=True, ema_seed_model=path))
    assert str(e.value).startswith(f"--ema-seed-model {path}: {FC1} has shape (3, 3) in the saved moving average, (")
    assert str(e.value).endswith(
        "in this model; it was trained with another architecture or other model options; use the same model options"
    )
