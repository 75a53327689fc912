"""An adaptive model (wiki103-shaped: adaptive input and softmax, tied weights and projections) under
data parallelism on 2 CPU ranks (gloo): every backend trains as one process does, LayerDrop skips the
same layers on every rank, and FSDP2's sharded checkpoint consolidates and scores."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers import adaptive_dist_helpers as A
from tests.helpers import dist_helpers as H

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("adaptive_dist") / "bin"))


def test_every_backend_trains_an_adaptive_model_as_one_process_does(data_bin, tmp_path):
    out = tmp_path / "results.json"
    proc = H.run_cli("tests.helpers.adaptive_dist_helpers", [data_bin, str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    reference = results.pop("reference")["losses"]
    for name in ("c10d", "full_shard+ac", "full_shard+bf16", "full_shard+fp16"):
        tol = 2e-2 if "16" in name else 1e-4
        for got, want in zip(results[name]["losses"], reference):
            assert abs(got - want) <= tol * abs(want), (name, results[name]["losses"], reference)
    assert results["full_shard+ac"]["local_param_numel"] == results["full_shard+ac"]["param_numel"] // 2
    # LayerDrop: FSDP2 (skipped blocks neither gathered nor reduced) and no_c10d drop the same layers
    a, b = results["layerdrop:full_shard"]["losses"], results["layerdrop:no_c10d"]["losses"]
    assert all(math.isfinite(x) for x in a)
    assert a == pytest.approx(b, rel=1e-4)


def test_sharded_checkpoint_of_an_adaptive_model_consolidates_and_scores(data_bin, tmp_path):
    from toolkit import inference
    from toolkit_cli import consolidate

    argv = A.base_argv(data_bin, str(tmp_path)) + [
        "--max-update",
        "2",
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--use-sharded-state",
        "--disable-validation",
        "--optimizer",
        "nag",
        "--lr",
        "0.1",
    ]
    proc = H.run_train(argv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "consolidated.pt"
    consolidate.cli_main([str(tmp_path / "checkpoint_last"), "-o", str(out)])
    model, task, _ = inference.load_model(str(out), data_bin)
    state = torch.load(out, map_location="cpu", weights_only=True)
    assert set(state["model"]) == set(model.state_dict())  # one name per tied weight
    assert model.adaptive_softmax is not None and "adaptive_softmax.head.class_proj.weight" in state["model"]
    stream = torch.tensor([5, 6, 7, 8, 9, 2], dtype=torch.long)
    scores = inference.score_stream([model], stream, task.dictionary.eos(), tokens_per_sample=8)
    inputs = torch.cat([stream.new_tensor([task.dictionary.eos()]), stream[:-1]])[None]
    with torch.no_grad():
        logp = model.get_normalized_probs(model(inputs))[0]
    torch.testing.assert_close(scores, logp[torch.arange(6), stream])
