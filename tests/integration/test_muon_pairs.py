"""``--optimizer muon`` with each feature that changes how the forward and backward compute or what data they
see (docs/composition.md's muon row), several features per run, against one process.

Each case trains two FSDP2 ranks (each sharded matrix's momentum gathered whole and orthogonalized by one
owner, tests/integration/test_muon.py) with its features on, and one eager process with ``--update-freq 2`` (the
two ranks' batches per update) in the same precision, with the same data and mask but neither ``--compile`` nor
``--checkpoint-activations``: so compile is compared with eager, activation checkpointing with none, and the
precision, mask, mixture and EMA with one process. Logged losses (3 decimals): fp32 1e-3 relative, fp16 1e-2,
bf16 and float8 2e-2 (test_composition's bounds: the two layouts round in different orders), plus one unit in
the last logged place. With ``--store-ema`` (an fp32 case: fp16's layouts already differ by a few 1e-3 in the
weights after 4 updates, since Muon's orthogonalized step and AdamW's normalized one magnify rounding) the saved
moving averages (decay 0.5, so they are not the last weights: checked) are compared too, to rtol 1e-3 / atol 1e-4
(test_ema_sharded's bound), but for the attention's k bias, whose gradient is exactly zero (AdamW steps on
rounding noise there).
``--compile`` uses ``aot_eager`` as test_composition's runs do.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.mixture import MIXTURE, data_and_flags, make_sources, mixture_flags
from toolkit.distributed.compile import BACKEND_ENV

UPDATES = 4
MUON = ["--optimizer", "muon", "--lr", "0.05", "--muon-adamw-lr", "0.01", "--weight-decay", "0.01"]  # test_muon's
FSDP2 = ["--distributed-world-size", "2", "--ddp-backend", "fully_sharded"]
EMA = ["--store-ema", "--ema-decay", "0.5", "--ema-fp32"]
FP16_TOL, BF16_TOL = 1e-2, 2e-2
CASES = {  # name: (the features, on the two ranks and the one process; what only the two ranks add; tolerance)
    "compile_ac_ema_mask": (EMA + ["--document-attention-mask"], ["--compile", "--checkpoint-activations"], 1e-3),
    "mefp16": (["--memory-efficient-fp16"], [], FP16_TOL),
    "fp16_mixture": ([MIXTURE, "--fp16"], [], FP16_TOL),
    "fp8_bf16": (["--fp8", "--bf16"], [], BF16_TOL),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon_pairs")
    return {"bin": H.make_lm_data_bin(str(root / "bin")), MIXTURE: mixture_flags(make_sources(root / "mixture"))}


def train(data, save_dir, *flags):
    data_bin, expanded = data_and_flags(data["bin"], flags, data[MIXTURE])
    env = {BACKEND_ENV: "aot_eager"} if "--compile" in flags else None
    proc = H.run_train(
        [
            data_bin,
            *H.model_args(str(save_dir)),
            *MUON,
            "--disable-validation",
            "--max-update",
            str(UPDATES),
            *expanded,
        ],
        env=env,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def saved_average(save_dir):
    return torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)


@pytest.mark.parametrize("case", list(CASES))
def test_muon_with_each_feature_equals_one_process(data, tmp_path, case):
    shared, sharded_only, rel = CASES[case]
    one = train(data, tmp_path / "one", *shared, "--update-freq", "2")
    two = train(data, tmp_path / "two", *FSDP2, *shared, *sharded_only)
    assert "--optimizer muon: 8 sharded matrices orthogonalized whole" in two.stdout
    if "--compile" in sharded_only:
        assert "--compile: torch.compile (aot_eager, fullgraph) on each of the 2 blocks" in two.stdout
    got, want = H.losses(two.stdout), H.losses(one.stdout)
    assert sorted(got) == sorted(want) == list(range(1, UPDATES + 1)), (got, want)
    assert want[UPDATES] < want[1], want  # it learns
    for u in want:
        assert abs(got[u] - want[u]) <= rel * abs(want[u]) + H.LOGGED_TOL, (u, got[u], want[u])
    if "--store-ema" in shared:
        two_ckpt, one_ckpt = saved_average(tmp_path / "two"), saved_average(tmp_path / "one")
        average, want_average = two_ckpt["extra_state"]["ema"], one_ckpt["extra_state"]["ema"]
        assert average.keys() == want_average.keys()
        for k in want_average:
            a, b = average[k], want_average[k]
            if k.endswith("qkv_proj.bias"):
                C = a.numel() // 3
                a, b = torch.cat([a[:C], a[2 * C :]]), torch.cat([b[:C], b[2 * C :]])
            assert torch.allclose(a, b, rtol=1e-3, atol=1e-4), (k, (a - b).abs().max())
        key = next(k for k in average if k.endswith("layers.0.fc1.weight"))
        assert not torch.allclose(average[key], two_ckpt["model"][key], atol=1e-3), "the average is not the weights"
