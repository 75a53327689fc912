"""toolkit-plan on the DeepSeek-V3 and GLM-4.5 families (read on the meta device, no data): the parameters a token
uses against those held, the latent KV cache a token costs against expanded keys and values (multi-head latent
attention only), and the experts' all-to-all under ``--expert-parallel-size``; the dense first layers and latent
attention's narrower values trace."""

from __future__ import annotations

import pytest

from toolkit.plan import PRESETS, make_plan
from toolkit.plan.report import sparse_and_latent, table
from toolkit.train.arguments import parse_train_args
from toolkit.train.resolve import resolve_and_log


def _plan(arch: str, *flags: str):
    argv = ["--task", "language_modeling", "--arch", arch, "--tokens-per-sample", "4096", "--bf16", "--batch-size"]
    argv += ["1", "--ddp-backend", "fully_sharded", "--distributed-world-size", "64", *flags]
    args, explicit = parse_train_args(argv, "toolkit-plan")
    return make_plan(resolve_and_log(args, explicit), PRESETS["h100"])


@pytest.mark.parametrize(
    "arch, total, active, cache",
    [
        ("deepseek_v3_671b", 671_026_404_352, 37_552_282_624, (70_272, 4_997_120)),  # 61 x 576 x 2 B; 61 x 128 x 320
        ("glm4_5", 352_797_814_784, 33_632_251_904, None),  # grouped-query attention caches its keys and values
    ],
)
def test_active_parameters_latent_cache_and_the_experts_all_to_all(arch, total, active, cache):
    plan = _plan(arch, "--expert-parallel-size", "8")
    st = plan.stats
    assert (st.num_params, st.active_params) == (total, active)
    lines = sparse_and_latent(plan)
    assert lines[0].startswith(f"active parameters: {active:,} of {total:,} a token")
    if cache is None:
        assert len(lines) == 1 and st.expanded_kv_width == st.kv_width
    else:
        assert lines[1].startswith(f"KV cache per token, all layers: {cache[0]:,} B latent against {cache[1]:,} B")
    comm = {name: nbytes for name, nbytes, _ in plan.time.comm}
    rows = 4096 * st.moe_top_k  # a rank's one sequence, k experts a token
    # there and back, forward and backward, in bf16, 7 of 8 rows leaving the rank
    assert comm["expert all-to-all"] == 2 * 2 * st.moe_layers * rows * st.embed_dim * 2 * 7 / 8
    assert "expert all-to-all" in table(plan)
