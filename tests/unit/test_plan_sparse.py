"""toolkit-plan on the DeepSeek-V3, GLM-4.5 and Qwen3-Next families (read on the meta device, no data): the
parameters a token uses against those held, the latent KV cache a token costs against expanded keys and values
(multi-head latent attention only), a sequence's recurrent state against keys and values (gated DeltaNet layers),
and the experts' all-to-all under ``--expert-parallel-size``; the dense first layers and latent attention's
narrower values trace."""

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


def test_recurrent_state_of_gated_deltanet_layers_against_keys_and_values():
    """Qwen3-Next-80B-A3B at T 4096 in bf16, by hand: 36 of its 48 layers gated DeltaNet, each keeping a state of
    32 value heads x 128 x 128 in fp32 (2,097,152 B) and its convolution's last 3 inputs of 2 x 16 x 128 + 32 x 128
    = 8,192 channels at 2 B (49,152 B); full attention in their place would cache 2 key/value heads of 256, k and
    v, for 4,096 tokens at 2 B (8,388,608 B a layer)."""
    plan = _plan("qwen3_next_80b_a3b")
    st = plan.stats
    assert (st.recurrent_layers, st.attention_layers) == (36, 12)
    state, conv, kv = 36 * 2_097_152, 36 * 49_152, 36 * 8_388_608
    line = sparse_and_latent(plan)[-1]
    assert line == (
        f"recurrent state per sequence, 36 gated DeltaNet layers: {state + conv:,} B ({state:,} B of delta-rule "
        f"states in fp32, {conv:,} B of convolution inputs at 2 B a number) against {kv:,} B of keys and values as "
        "full attention at T 4096 (3.9x)"
    )
    assert line in table(plan)
