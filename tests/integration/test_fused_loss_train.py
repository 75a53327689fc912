"""toolkit-train with the fused output layer + loss (the default, ``--head-loss-chunk-rows``) against the logits
path (``--head-loss-chunk-rows 0``): the same losses and the same trained weights, one process. (DDP and FSDP2
runs use the default too: tests/integration/test_distributed.py compares them with one process.)"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.dist_helpers import train

UPDATES = 6


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("fused") / "bin"))


def trained(data_bin, save_dir, *extra):
    # SGD, not Adam: Adam turns a rounding-sized gradient (the key bias's is 0 in exact arithmetic) into an
    # lr-sized step, so two correct runs would differ there; SGD keeps each difference as small as its cause
    proc = train(
        data_bin,
        save_dir,
        "--max-update",
        str(UPDATES),
        "--disable-validation",
        "--optimizer",
        "sgd",
        "--lr",
        "0.5",
        *extra,
    )
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    return H.losses(proc.stdout), state


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_head_trains_as_the_logits_path(data_bin, tmp_path, tied):
    tie = ["--share-decoder-input-output-embed"] if tied else []
    fused_losses, fused = trained(data_bin, tmp_path / "fused", "--head-loss-chunk-rows", "7", *tie)
    losses, state = trained(data_bin, tmp_path / "logits", "--head-loss-chunk-rows", "0", *tie)
    assert sorted(fused_losses) == list(range(1, UPDATES + 1))
    H.assert_logged_losses_match(fused_losses, losses, range(1, UPDATES + 1))
    assert ("output_projection.weight" in state) == (not tied) and fused.keys() == state.keys()
    for name in state:
        difference = (fused[name].double() - state[name].double()).norm() / state[name].double().norm()
        assert difference < H.REL_TOL, (name, float(difference))
