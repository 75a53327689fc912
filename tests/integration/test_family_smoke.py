"""The 2025-26 dense families (Qwen3, OLMo 2, Gemma 3) through what a user runs on them, beyond HF parity.

For each tiny member (``qwen3_tiny``: QK-norm per head, head size apart from the width, tied; ``olmo2_tiny``: norms
after the sub-layers, QK-norm over the projections; ``gemma3_tiny``: a sliding-window layer then a global one,
(1 + w) norms, GeGLU): one process with --update-freq 2 is the reference; 2 FSDP2 ranks and one process with
--checkpoint-activations --compile (aot_eager) log the same losses; a run stopped at update 2 resumes to the
reference's losses exactly, its checkpoint rewritten as the Llama family's options class saved it (the norm
switches ``gemma_norms`` / ``norm_after_sublayer`` and the options the family lacks: ``SAVED_BY_LLAMA``);
toolkit-eval-lm on the checkpoint equals the log-probabilities of the model's own forward
(tests/helpers/eval_reference.py). A run of ``--arch llama --gemma-norms`` (its checkpoint as that run saved it)
resumes under ``--arch gemma3`` with its other flags to the uninterrupted run's losses.
"""

from __future__ import annotations


import pytest

from tests.helpers import dist_helpers as H
from tests.helpers.eval_reference import assert_eval_lm_equals_forward

UPDATES = 4
FAMILIES = ["qwen3_tiny", "olmo2_tiny", "gemma3_tiny"]
_NONE = dict(query_pre_attn_scalar=None, rope_local_theta=None, attn_logit_softcap=None, final_logit_softcap=None)
#: the options a checkpoint of each size held that its family's options class does not have, with their values
SAVED_BY_LLAMA = {
    "qwen3_tiny": dict(gemma_norms=False, norm_after_sublayer=False, qk_norm_over="head", **_NONE),
    "olmo2_tiny": dict(gemma_norms=False, norm_after_sublayer=True, **_NONE),
    "gemma3_tiny": dict(gemma_norms=True, norm_after_sublayer=False, qk_norm_over="head"),
}


def save_as_the_llama_family_did(path, size, **saved):
    """The checkpoint's options as the Llama family's options class saved them for ``size``'s model (``saved``: other
    values, e.g. its ``arch``); the weights and the training state as they are."""
    import torch

    ckpt = torch.load(path, weights_only=True)
    ckpt["cfg"] = {k: v for k, v in ckpt["cfg"].items() if k != "partial_rotary_factor"}
    ckpt["cfg"].update(SAVED_BY_LLAMA[size], **saved)
    torch.save(ckpt, path)


def train(data_bin, save_dir, arch, *flags, env=None):
    args = H.llama_args(save_dir)
    args[args.index("--arch") + 1] = arch
    proc = H.run_train([data_bin] + args + ["--max-update", str(UPDATES)] + list(flags), env=env)
    assert proc.returncode == 0, (
        f"toolkit-train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return H.losses(proc.stdout)


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("families") / "bin"))


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_trains_sharded_compiled_resumed_and_evaluated(arch, data_bin, tmp_path):
    reference = train(data_bin, tmp_path / "one", arch, "--update-freq", "2")
    assert sorted(reference) == list(range(1, UPDATES + 1)) and reference[UPDATES] < reference[1]
    sharded = train(
        data_bin, tmp_path / "fsdp", arch, "--distributed-world-size", "2", "--ddp-backend", "fully_sharded"
    )
    H.assert_logged_losses_match(sharded, reference, range(1, UPDATES + 1))
    compiled = train(
        data_bin,
        tmp_path / "compiled",
        arch,
        "--update-freq",
        "2",
        "--checkpoint-activations",
        "--compile",
        env={"TOOLKIT_COMPILE_BACKEND": "aot_eager"},
    )
    H.assert_logged_losses_match(compiled, reference, range(1, UPDATES + 1))
    train(data_bin, tmp_path / "resumed", arch, "--update-freq", "2", "--max-update", "2")
    save_as_the_llama_family_did(tmp_path / "resumed" / "checkpoint_last.pt", arch)
    resumed = train(data_bin, tmp_path / "resumed", arch, "--update-freq", "2")
    assert sorted(resumed) == [3, 4] and all(resumed[u] == reference[u] for u in resumed)

    assert_eval_lm_equals_forward(str(tmp_path / "one" / "checkpoint_last.pt"), data_bin)


#: gemma3_tiny's values over the bare ``--arch gemma3``: what a run of ``--arch llama --gemma-norms`` gave as flags
GEMMA3_TINY_FLAGS = (
    "--decoder-head-dim 32 --decoder-kv-heads 2 --query-pre-attn-scalar 32 --rope-theta 1000000 "
    "--rope-local-theta 10000 --rms-norm-eps 1e-6 --sliding-window 6 --layer-types sliding_attention,full_attention"
).split()


def test_a_run_of_llama_with_gemma_norms_resumes_as_the_gemma3_family(data_bin, tmp_path):
    """Its checkpoint (--arch llama, gemma_norms true, as the Llama family saved it) resumes under --arch gemma3 with
    the same other flags to the uninterrupted run's losses."""
    reference = train(data_bin, tmp_path / "one", "gemma3", "--update-freq", "2", *GEMMA3_TINY_FLAGS)
    train(data_bin, tmp_path / "resumed", "gemma3", "--update-freq", "2", "--max-update", "2", *GEMMA3_TINY_FLAGS)
    save_as_the_llama_family_did(tmp_path / "resumed" / "checkpoint_last.pt", "gemma3_tiny", arch="llama")
    resumed = train(data_bin, tmp_path / "resumed", "gemma3", "--update-freq", "2", *GEMMA3_TINY_FLAGS)
    assert sorted(resumed) == [3, 4] and all(resumed[u] == reference[u] for u in resumed)
