"""Tensor parallelism (toolkit.distributed.tensor_parallel) on CPU with gloo, against one plain process.

Two spawned groups (tests/helpers/tp_helpers.py): 2 ranks with M=2, and 4 ranks as (dp 2 x mp 2)
under FSDP2. Each trains a tiny model (2 layers, C=32, 4 heads, V=64) for 10 updates on the
same global batches as a single process, with the trainer's normalization (summed loss,
gradients times dp / ntokens), the global gradient norm and clipping, and AdamW.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import tp_helpers as H

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")

REL_TOL = 1e-4
FP16_REL_TOL = 2e-3  # fp16 compute: matmuls split over ranks round differently (unit roundoff 4.9e-4)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tp2"))
    H.spawn(H.worker_tp2, 2, out)
    return torch.load(os.path.join(out, "result.pt"), weights_only=True)


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tp4"))
    H.spawn(H.worker_2x2, 4, out)
    result = torch.load(os.path.join(out, "result.pt"), weights_only=True)
    result["dcp_dir"] = os.path.join(out, "dcp")
    return result


@pytest.fixture(scope="module")
def single():
    """The same updates on one plain process (fp32)."""
    torch.manual_seed(0)
    plain = H.build(H.model_cfg())
    tied = H.build(H.model_cfg(share_decoder_input_output_embed=True, decoder_learned_pos=False))
    short = H.short_batch_loss(plain)
    init = {k: v.clone() for k, v in plain.state_dict().items()}
    opt = H.optimizer(plain)
    trained = H.train(plain, opt=opt)
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    continued = H.train(plain, opt=opt, first=H.STEPS, steps=H.RESUMED_STEPS)  # the uninterrupted run
    arch_tied = H.arch_defaults_cfg(share_decoder_input_output_embed=True)
    return {
        "short_batch_loss": short,
        "init_state": init,
        "plain": trained,
        "plain_state": state,
        "continued": continued,
        "tied": H.train(tied),
        "arch_defaults": H.train(H.build(H.arch_defaults_cfg())),
        "arch_defaults_tied": H.train(H.build(arch_tied)),
    }


def assert_close(got, want, rel, steps=H.STEPS):
    assert len(got) == len(want) == steps
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rel * abs(w), (step, g, w)


def test_meta_init_gives_the_plain_build_values_and_state_dict(tp2, tp4, single):
    """Built on meta, sharded (TP, TP+FSDP2), materialized: same keys, shapes and values as a plain build."""
    want = single["init_state"]
    for got in (tp2["init_state"], tp4["init_state"]):
        assert list(got) == list(want)
        for k in want:
            assert got[k].shape == want[k].shape and torch.equal(got[k], want[k]), k


def test_two_ranks_model_parallel_match_one_process(tp2, single):
    assert_close(tp2["sp_untied"]["loss"], single["plain"]["loss"], REL_TOL)
    assert_close(tp2["sp_untied"]["gnorm"], single["plain"]["gnorm"], REL_TOL)
    assert single["plain"]["gnorm"][0] > H.CLIP_NORM  # clipping took part


def test_transformer_lm_defaults_project_in_and_out_match_one_process(tp2, single):
    """fairseq's --arch transformer_lm: 512-wide embeddings around a narrower model (project_in_dim and
    project_out_dim, replicated over the TP ranks), post-norm without a final LayerNorm; and tied to the
    vocabulary-sharded embedding without sequence parallelism."""
    assert_close(tp2["arch_defaults"]["loss"], single["arch_defaults"]["loss"], REL_TOL)
    assert_close(tp2["arch_defaults"]["gnorm"], single["arch_defaults"]["gnorm"], REL_TOL)
    assert_close(tp2["arch_defaults_tied_no_sp"]["loss"], single["arch_defaults_tied"]["loss"], REL_TOL)


def test_sequence_parallel_pads_a_short_batch_to_a_multiple_of_m(tp2, single):
    assert abs(tp2["short_batch_loss"] - single["short_batch_loss"]) <= REL_TOL * single["short_batch_loss"]


def test_tied_embeddings_without_sequence_parallel_with_checkpointing(tp2, single):
    assert_close(tp2["tied_no_sp_ac"]["loss"], single["tied"]["loss"], REL_TOL)
    assert_close(tp2["tied_no_sp_ac"]["gnorm"], single["tied"]["gnorm"], REL_TOL)


def test_data_and_model_parallel_under_fsdp2_match_one_process(tp4, single):
    assert tp4["dp"] == (0, 2)
    assert_close(tp4["fsdp"]["loss"], single["plain"]["loss"], REL_TOL)
    assert_close(tp4["fsdp"]["gnorm"], single["plain"]["gnorm"], REL_TOL)
    want = single["plain_state"]
    for k, v in want.items():
        got = tp4["trained_state"][k]
        if k.endswith("qkv_proj.bias"):
            # The k bias has a zero gradient in exact arithmetic (softmax is shift-invariant), so AdamW's
            # normalized steps follow rounding noise there: compare the q and v parts.
            C = v.numel() // 3
            v, got = torch.cat([v[:C], v[2 * C :]]), torch.cat([got[:C], got[2 * C :]])
        diff = (got.double() - v.double()).norm() / v.double().norm().clamp_min(1e-12)
        assert diff < REL_TOL, (k, float(diff))


def test_replicated_data_parallel_mesh_with_model_parallel(tp4, single):
    """no_shard / c10d-like: FSDP2 on a (dp_replicate 2, dp_shard 1) mesh beside mp 2 (HSDP + TP)."""
    assert_close(tp4["replicate"]["loss"], single["plain"]["loss"][:4], REL_TOL, steps=4)
    assert_close(tp4["replicate"]["gnorm"], single["plain"]["gnorm"][:4], REL_TOL, steps=4)


def test_fsdp2_with_checkpointing_and_fp16_compute(tp4, single):
    assert_close(tp4["fsdp_ac_fp16"]["loss"], single["plain"]["loss"], FP16_REL_TOL)
    assert_close(tp4["fsdp_ac_fp16"]["gnorm"], single["plain"]["gnorm"], 5 * FP16_REL_TOL)


def test_dcp_checkpoint_saved_at_2x2_resumes_at_1x4_and_1x1(tp4, single):
    """Model and optimizer state saved by (dp 2 x mp 2), loaded by (1 x 4) and by one plain process:
    the same parameters, and the next updates continue as the uninterrupted single-process run."""
    saved = tp4["trained_state"]
    for k in saved:
        assert torch.equal(tp4["loaded_1x4"][k], saved[k]), k
    plain = H.build(H.model_cfg(), seed=99)
    opt = H.load_checkpoint(plain, tp4["dcp_dir"])  # no process group: one plain process
    for k, v in plain.state_dict().items():
        assert torch.equal(v, saved[k]), k
    resumed_1x1 = H.train(plain, opt=opt, first=H.STEPS, steps=H.RESUMED_STEPS)
    for resumed in (tp4["resumed_1x4"], resumed_1x1):
        assert_close(resumed["loss"], single["continued"]["loss"], REL_TOL, steps=H.RESUMED_STEPS)
        assert_close(resumed["gnorm"], single["continued"]["gnorm"], REL_TOL, steps=H.RESUMED_STEPS)


def test_consolidated_state_dict_loads_into_the_2x2_model(tp4):
    assert tp4["consolidated_loads"]


def test_dropout_replicated_regions_agree_sharded_regions_differ(tp2):
    probes = tp2["dropout"]
    assert probes["embedding_dropout_active"]
    assert probes["embedded_same_on_tp_ranks"]
    assert probes["block_draws_differ_on_tp_ranks"]
    assert probes["same_seed_same_draws"] and probes["other_seed_other_draws"]
    assert probes["checkpointing_recomputes_same_masks"]
