"""cpu_adam's reduced-precision moments (``--adam-state-precision bf16|8bit``, toolkit/optim/quantized_states.py).

References: the codes against their stated error bounds; the updates against cpu_adam with
fp32 moments (same DeepSpeed op, only the stored moments differ); checkpoints against the
uninterrupted run. Tolerances: after 20 AdamW steps at lr 1e-2, the parameters of the
bf16-moment run stay within 1% and those of the 8-bit run within 6% of the distance the
fp32-moment run moved them (observed about 0.4% and 3%).
"""

import os

import torch

from tests.helpers.cli import train


def test_two_rank_cpu_offload_8bit_trains_and_resumes_from_a_sharded_checkpoint(tmp_path):
    """FSDP2 --cpu-offload --bf16-host-grads on 2 gloo ranks with 8-bit moments; a resume from update 3 matches."""
    from tests.helpers.dist_helpers import make_lm_data_bin

    data = make_lm_data_bin(str(tmp_path / "bin"))
    args = [
        "--dropout",
        "0",
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--cpu-offload",
        "--optimizer",
        "cpu_adam",
        "--adam-state-precision",
        "8bit",
        "--bf16-host-grads",
        "--use-sharded-state",
        "--max-update",
        "6",
        "--save-interval-updates",
        "3",
        "--no-epoch-checkpoints",
    ]
    full = train(data, str(tmp_path / "full"), *args)
    assert len(full.losses()) == 6 and "bf16_host_grads=True" in full.stdout
    os.makedirs(tmp_path / "resumed")
    os.rename(tmp_path / "full" / "checkpoint_1_3", tmp_path / "resumed" / "checkpoint_last")
    resumed = train(data, str(tmp_path / "resumed"), *args)
    assert "loaded sharded checkpoint" in resumed.stdout
    assert {u: l for u, l in full.losses().items() if u > 3} == resumed.losses()
    from toolkit.checkpoint.safe_pickle import dcp_to_state_dict

    a, b = (dcp_to_state_dict(str(tmp_path / d / "checkpoint_last")) for d in ("full", "resumed"))
    for key, t in a["model"].items():  # float rounding of DeepSpeed's beta**step (see above), nothing more
        torch.testing.assert_close(t, b["model"][key], rtol=0, atol=1e-5)
    codes = [k for k, v in a["optim"]["state"].items() if v["exp_avg"].dtype == torch.int8]
    assert codes and all(a["optim"]["state"][k]["exp_avg_sq"].dtype == torch.uint8 for k in codes)
    for k in codes:  # the scales were saved sharded by rows like the codes: gathered, each row meets its own
        st = a["optim"]["state"][k]
        rows = st["exp_avg"].shape[0]
        assert st["exp_avg_absmax"].shape == (rows, 1)  # rows of <= 2048 values: one block each
        assert torch.equal(st["exp_avg"].reshape(rows, -1).abs().amax(1) == 127, st["exp_avg_absmax"][:, 0] > 0)
        assert torch.equal(st["exp_avg_sq"].reshape(rows, -1).amax(1) == 255, st["exp_avg_sq_absmax"][:, 0] > 0)
