"""--model-parallel-size 2 with --ddp-backend no_c10d (fairseq's legacy DDP): no FSDP2; after backward each rank
all-reduces its own tensor-parallel shards' gradients with the ranks that hold the same shards.

Two ranks are one replica split in two (no gradient exchange: the one process takes the same batches); four
ranks are two replicas of two (the one process takes both replicas' batches, ``--update-freq 2``); and two
ranks in --fp16 (autocast and loss scaling on the shards; fp32 weights) against one --fp16 process. Logged losses
1e-3 relative plus one unit in the last logged place; the final weights of the fp32 runs rtol 1e-3 / atol 1e-4 (as
test_composition's TP weights). Reducing over all ranks instead of the ranks holding the same shard (adding
the two halves of a split weight) fails the four-rank case.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import dist_helpers as H

UPDATES = 4


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("tp_no_c10d") / "bin"))


def train(data_bin, save_dir, *flags):
    proc = H.run_train(
        [data_bin, *H.model_args(str(save_dir)), "--disable-validation", "--max-update", str(UPDATES), *flags],
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("world,flags", [(2, []), (4, []), (2, ["--fp16"])], ids=["2", "4", "2_fp16"])
def test_tensor_parallel_with_no_c10d_matches_one_process(data_bin, tmp_path, world, flags):
    replicas = world // 2
    one = train(data_bin, tmp_path / "one", "--update-freq", str(replicas), *flags)
    tp = train(
        data_bin,
        tmp_path / "tp",
        "--distributed-world-size",
        str(world),
        "--model-parallel-size",
        "2",
        "--ddp-backend",
        "no_c10d",
        *flags,
    )
    assert f"tensor parallel: 2 ranks per replica, {replicas} data-parallel replicas" in tp.stdout
    got, want = H.losses(tp.stdout), H.losses(one.stdout)
    assert sorted(got) == sorted(want) == list(range(1, UPDATES + 1)), (got, want)
    for u in want:
        assert abs(got[u] - want[u]) <= 1e-3 * abs(want[u]) + H.LOGGED_TOL, (u, got[u], want[u])
    if flags:  # fp16: losses only (as test_composition's fp16 pairs); Adam turns fp16 rounding of an embedding
        return  # row's near-zero gradient into steps of lr size (6e-3 measured on embed_tokens)
    saved = [
        torch.load(d / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
        for d in (tmp_path / "tp", tmp_path / "one")
    ]
    assert saved[0].keys() == saved[1].keys()
    for k, b in saved[1].items():
        a = saved[0][k]
        if k.endswith("qkv_proj.bias"):  # the k bias has an exactly-zero gradient: Adam steps on rounding noise
            C = a.numel() // 3  # (as in test_composition / test_tp_cli)
            a, b = torch.cat([a[:C], a[2 * C :]]), torch.cat([b[:C], b[2 * C :]])
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-4), (k, (a - b).abs().max())
