"""Training the MoE family with toolkit-train: the router terms and expert loads in the log (dropped tokens 0),
two gloo ranks (DDP; FSDP2 with activation checkpointing) logging the same losses, router terms and loads as one process with
--update-freq 2 and ending with the same aux-loss-free bias (the post-step hook sums the loads over the ranks),
a --compile run logging the same losses, and a resumed run equal to the uninterrupted one (the bias is saved
with the model). Expert parallelism: the all-to-all dispatch and combine equal the local computation (2 gloo
ranks), and two ranks with --expert-parallel-size 2 train as one process with --update-freq 2, their consolidated
checkpoint holding the whole expert stacks (gathered from the shards), so it loads without expert parallelism;
under FSDP2 (2 ranks, and 4 ranks with each rank's experts sharded over 2, resumed), FSDP2 with --cpu-offload, and
with --compile (the exchange eager between the compiled graphs) and with --data-mixture the same. Context
parallelism: two ranks with --context-parallel-size 2, and four with --expert-parallel-size 2 as well, train as one
process, the router terms those of the whole sequences."""

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers import ep_helpers, tp_helpers
from tests.helpers.dist_helpers import assert_logged_losses_match
from tests.helpers.moe_train import ROUTER_TERMS, UPDATES, assert_router_terms_match, logged, train

pytestmark = pytest.mark.integration

ONE_PROC = ["--update-freq", "2"]
FSDP_EP = ["--expert-parallel-size", "2", "--ddp-backend", "fully_sharded"]


def expert_bias(save_dir):
    state = torch.load(f"{save_dir}/checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    return torch.stack([state[f"layers.{i}.mlp.gate.expert_bias"] for i in range(2)])


def assert_equals_one_process(proc, one_process, save_dir):
    """Losses to the logged digits, the balance and z losses of every update (2e-4), the aux-loss-free bias (exact:
    the same counts), and the consolidated weights (fp32, rtol 1e-4)."""
    assert_logged_losses_match(H.losses(proc.stdout), one_process["losses"], range(1, UPDATES + 1))
    assert_router_terms_match(logged(proc.stdout), one_process["terms"])
    torch.testing.assert_close(expert_bias(save_dir), one_process["bias"])
    saved = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    reference = torch.load(one_process["save_dir"] / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    for name, tensor in reference["model"].items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("moe_train") / "bin"))


@pytest.fixture(scope="module")
def one_process(data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("one")
    proc = train(data_bin, save_dir, "--max-update", str(UPDATES), *ONE_PROC)
    return dict(
        losses=H.losses(proc.stdout),
        terms=logged(proc.stdout),
        bias=expert_bias(save_dir),
        save_dir=save_dir,
        stdout=proc.stdout,
    )


def test_router_terms_and_loads_are_logged(one_process):
    terms = one_process["terms"]
    assert sorted(terms) == list(range(1, UPDATES + 1))
    for update in terms.values():
        assert set(update) == set(ROUTER_TERMS)
        assert update["moe_dropped"] == 0.0 and update["moe_max_load_0"] >= 1.0 and update["moe_z_loss"] > 0
    bias = one_process["bias"]
    assert bias.abs().max() > 0 and torch.all(bias.abs() <= UPDATES * 0.05 + 1e-6)


@pytest.mark.parametrize(
    "backend", [["c10d"], ["fully_sharded", "--checkpoint-activations"]], ids=["c10d", "fully_sharded+ac"]
)
def test_two_ranks_equal_one_process_with_update_freq_2(data_bin, one_process, tmp_path, backend):
    proc = train(
        data_bin, tmp_path, "--max-update", str(UPDATES), "--distributed-world-size", "2", "--ddp-backend", *backend
    )
    assert_logged_losses_match(H.losses(proc.stdout), one_process["losses"], range(1, UPDATES + 1))
    assert_router_terms_match(logged(proc.stdout), one_process["terms"])
    if backend == ["c10d"]:  # a consolidated checkpoint: the bias the ranks share equals one process's
        torch.testing.assert_close(expert_bias(tmp_path), one_process["bias"])


def test_compile_logs_the_same_losses(data_bin, one_process, tmp_path):
    """--compile: each block compiled (fullgraph); the grouped matmul runs as an opaque op (fp32 on CPU)."""
    proc = train(data_bin, tmp_path, "--max-update", str(UPDATES), *ONE_PROC, "--compile")
    assert_logged_losses_match(H.losses(proc.stdout), one_process["losses"], range(1, UPDATES + 1))


def test_resume_equals_the_uninterrupted_run(data_bin, one_process, tmp_path):
    train(data_bin, tmp_path, "--max-update", "2", *ONE_PROC)
    resumed = train(data_bin, tmp_path, "--max-update", str(UPDATES), *ONE_PROC)
    assert_logged_losses_match(H.losses(resumed.stdout), one_process["losses"], range(3, UPDATES + 1))
    torch.testing.assert_close(expert_bias(tmp_path), one_process["bias"])


# --- --expert-parallel-size ---


def test_dispatch_and_combine_equal_the_local_computation(tmp_path):
    tp_helpers.spawn(ep_helpers.dispatch_matches_local, 2, str(tmp_path))
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    for name, whole in result["whole"].items():  # the placed layer saves the whole stack (gathered)
        torch.testing.assert_close(result["state"][name], whole)


@pytest.mark.parametrize("backend", ["c10d", "no_c10d"])
def test_two_expert_parallel_ranks_equal_one_process(data_bin, one_process, tmp_path, backend):
    proc = train(
        data_bin,
        tmp_path,
        "--max-update",
        str(UPDATES),
        "--distributed-world-size",
        "2",
        "--expert-parallel-size",
        "2",
        "--ddp-backend",
        backend,
    )
    assert "expert parallel: 2 MoE layers' experts over 2 ranks" in proc.stdout + proc.stderr
    assert_equals_one_process(proc, one_process, tmp_path)


@pytest.mark.parametrize("backend", ["c10d", "fully_sharded"])
def test_expert_parallel_compiled_equals_one_process(data_bin, one_process, tmp_path, backend):
    """--compile under --expert-parallel-size 2 (2 ranks; DDP, and FSDP2): each block compiled (inductor) around its
    eager token exchange, the losses those of one eager process with --update-freq 2 to the logged digits
    (``assert_logged_losses_match``)."""
    proc = train(
        data_bin,
        tmp_path,
        "--max-update",
        str(UPDATES),
        "--distributed-world-size",
        "2",
        "--expert-parallel-size",
        "2",
        "--ddp-backend",
        backend,
        "--compile",
    )
    assert "graphs around the expert exchange" in proc.stdout + proc.stderr
    assert_logged_losses_match(H.losses(proc.stdout), one_process["losses"], range(1, UPDATES + 1))


def test_expert_parallel_with_fsdp2_cpu_offload_equals_one_process(data_bin, tmp_path):
    """--cpu-offload --optimizer cpu_adam under FSDP2 x EP (2 ranks): the host-memory step over the experts' shards
    and the dense ones, clipped by the whole model's norm, as one process with --update-freq 2 (the same optimizer)."""
    host = ["--max-update", "2", "--optimizer", "cpu_adam", "--clip-norm", "0.05"]
    alone = train(data_bin, tmp_path / "one", *host, *ONE_PROC)
    placed = train(data_bin, tmp_path / "ep", *host, "--distributed-world-size", "2", *FSDP_EP, "--cpu-offload")
    assert_logged_losses_match(H.losses(placed.stdout), H.losses(alone.stdout), range(1, 3))
    norms = [gradient_norms(proc.stdout) for proc in (alone, placed)]
    assert min(norms[0].values()) > 0.05  # clipping was active
    assert norms[1] == pytest.approx(norms[0], rel=1e-3, abs=2e-3)


def test_expert_parallel_overlap_offload_step_equals_the_serial_step(data_bin, tmp_path):
    """--overlap-offload-step under FSDP2 x EP (2 ranks, ep 2, --cpu-offload, cpu_adam), clipped: the squares taken
    per FSDP2 group during backward, the experts' added over the ep ranks before the clip factor, give the norm and
    the updates of the serial step (logged losses and gradient norms, rtol 1e-3) and of one process."""
    # wide experts and no shared one: the experts hold a large part of the norm, so a norm that missed the other
    # ep rank's experts would show in the logged digits
    host = [
        "--max-update",
        "2",
        "--optimizer",
        "cpu_adam",
        "--clip-norm",
        "0.05",
        "--moe-ffn-embed-dim",
        "512",
        "--moe-shared-ffn-embed-dim",
        "0",
    ]
    alone = train(data_bin, tmp_path / "one", *host, *ONE_PROC)
    placed = ["--distributed-world-size", "2", *FSDP_EP, "--cpu-offload"]
    serial = train(data_bin, tmp_path / "serial", *host, *placed)
    overlapped = train(data_bin, tmp_path / "overlap", *host, *placed, "--overlap-offload-step")
    assert "--overlap-offload-step: CPU Adam steps" in overlapped.stdout + overlapped.stderr
    norms = [gradient_norms(proc.stdout) for proc in (alone, serial, overlapped)]
    assert sorted(norms[0]) == [1, 2] and min(norms[0].values()) > 0.05  # clipping was active
    for reference in (serial, alone):
        assert_logged_losses_match(H.losses(overlapped.stdout), H.losses(reference.stdout), range(1, 3))
    assert norms[2] == pytest.approx(norms[1], rel=1e-3) and norms[2] == pytest.approx(norms[0], rel=1e-3)


def test_expert_parallel_with_a_data_mixture_equals_one_process(tmp_path):
    """--data-mixture under --expert-parallel-size 2 (2 ranks, DDP): each data-parallel rank draws its own mixture
    batches, and the ranks exchange tokens with each other's experts; as one process drawing both with
    --update-freq 2."""
    from tests.helpers.mixture import make_sources

    root = make_sources(tmp_path / "sources")
    mixture = ["--data-mixture", f"web={root}/web:0.7,code={root}/code:0.3", "--max-update", "3"]
    alone = train("", tmp_path / "one", *mixture, *ONE_PROC)
    placed = train("", tmp_path / "ep", *mixture, "--distributed-world-size", "2", "--expert-parallel-size", "2")
    assert "expert parallel: 2 MoE layers' experts over 2 ranks" in placed.stdout + placed.stderr
    assert_logged_losses_match(H.losses(placed.stdout), H.losses(alone.stdout), range(1, 4))


def test_refusals_name_the_reason(data_bin, tmp_path):
    proc = H.run_train(
        [
            data_bin,
            "--task",
            "language_modeling",
            "--arch",
            "moe_tiny_sigmoid",
            "--cpu",
            "--distributed-world-size",
            "2",
            "--model-parallel-size",
            "2",
            "--ddp-backend",
            "no_c10d",
            "--save-dir",
            str(tmp_path),
        ],
        timeout=120,
    )
    assert proc.returncode == 1 and "only FSDP2 reduces their gradients" in proc.stdout + proc.stderr


def test_expert_parallel_with_hsdp_equals_one_process(data_bin, tmp_path):
    """--sharding-strategy hybrid_shard (2 groups of 2 ranks) x --expert-parallel-size 2 on 4 ranks: the dense layers
    on their (replicate, shard) mesh, each rank's experts on a (replicate, shard) mesh of their own over the ranks
    holding the same ones (the other group's), their gradient divided as the dense ones'. Its losses and gradient
    norms are those of one process with --update-freq 4 (the same global batch) to the logged digits / rtol 1e-3,
    its consolidated checkpoint after 2 updates holds the one-process weights (rtol 1e-4), and one process resumed
    from it continues as the uninterrupted run. no_shard (4 replicas, ep 2) logs the same losses and norms."""
    one = tmp_path / "one"
    first = train(data_bin, one, "--max-update", "2", "--update-freq", "4")
    at_two = torch.load(one / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    alone = train(data_bin, one, "--max-update", str(UPDATES), "--update-freq", "4")  # resumed: the same run
    hsdp = train(
        data_bin,
        tmp_path / "hsdp",
        "--max-update",
        "2",
        "--distributed-world-size",
        "4",
        *FSDP_EP,
        "--sharding-strategy",
        "hybrid_shard",
        "--shard-group-size",
        "2",
    )
    assert "each sharded by FSDP2 over the 1 ranks holding them, replicated over 2 groups" in hsdp.stdout + hsdp.stderr
    assert_logged_losses_match(H.losses(hsdp.stdout), H.losses(first.stdout), range(1, 3))
    assert gradient_norms(hsdp.stdout) == pytest.approx(gradient_norms(first.stdout), rel=1e-3)
    saved = torch.load(tmp_path / "hsdp" / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    assert set(saved) == set(at_two)
    for name, tensor in at_two.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    resumed = train(data_bin, tmp_path / "hsdp", "--max-update", str(UPDATES), "--update-freq", "4")
    assert_logged_losses_match(H.losses(resumed.stdout), H.losses(alone.stdout), range(3, UPDATES + 1))
    # no_shard: the dense layers replicated over 4, the ep pairs whole replicas, each expert replicated over 2
    replicated = train(
        data_bin,
        tmp_path / "no_shard",
        "--max-update",
        "2",
        "--distributed-world-size",
        "4",
        *FSDP_EP,
        "--sharding-strategy",
        "no_shard",
    )
    assert "over the 1 ranks holding them, replicated over 2 groups" in replicated.stdout + replicated.stderr
    assert_logged_losses_match(H.losses(replicated.stdout), H.losses(first.stdout), range(1, 3))
    assert gradient_norms(replicated.stdout) == pytest.approx(gradient_norms(first.stdout), rel=1e-3)


def test_expert_parallel_with_fsdp2_equals_one_process(data_bin, one_process, tmp_path):
    """--ddp-backend fully_sharded --expert-parallel-size 2: on 2 ranks (each expert on one rank: its FSDP2 mesh has
    one rank) as one process with --update-freq 2, to the logged digits (``assert_logged_losses_match``), with the
    consolidated checkpoint holding the whole stacks (rtol 1e-4); on 4 ranks (each expert sharded over the 2 ranks
    holding it, its gradient reduce-scattered between them only) as one process with --update-freq 4, stopped after
    2 updates and resumed from the consolidated checkpoint (weights and Adam moments gathered, then re-sharded)."""
    proc = train(data_bin, tmp_path / "two", "--max-update", str(UPDATES), "--distributed-world-size", "2", *FSDP_EP)
    assert "each sharded by FSDP2 over the 1 ranks holding them" in proc.stdout + proc.stderr
    assert_logged_losses_match(H.losses(proc.stdout), one_process["losses"], range(1, UPDATES + 1))
    torch.testing.assert_close(expert_bias(tmp_path / "two"), one_process["bias"])
    saved = torch.load(tmp_path / "two" / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    reference = torch.load(one_process["save_dir"] / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    for name, tensor in reference["model"].items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=name)

    alone = train(data_bin, tmp_path / "one", "--max-update", str(UPDATES), "--update-freq", "4")
    four = ["--distributed-world-size", "4", *FSDP_EP]
    first = train(data_bin, tmp_path / "four", "--max-update", "2", *four)
    assert "each sharded by FSDP2 over the 2 ranks holding them" in first.stdout + first.stderr
    resumed = train(data_bin, tmp_path / "four", "--max-update", str(UPDATES), *four)
    assert_logged_losses_match(H.losses(first.stdout), H.losses(alone.stdout), range(1, 3))
    assert_logged_losses_match(H.losses(resumed.stdout), H.losses(alone.stdout), range(3, UPDATES + 1))


# --- --context-parallel-size ---

CP2 = ["--context-parallel-size", "2"]


def test_context_parallel_2_equals_one_process(data_bin, one_process, tmp_path):
    """--context-parallel-size 2 (2 ranks, DDP) with --update-freq 2 = one process with --update-freq 2: each rank
    attends over the keys/values gathered from both and routes its chunks of the sequences, the routers' statistics
    (balance and z losses, loads) summed over the cp ranks, so they are those of the whole sequences."""
    proc = train(data_bin, tmp_path, "--max-update", str(UPDATES), "--distributed-world-size", "2", *CP2, *ONE_PROC)
    assert_equals_one_process(proc, one_process, tmp_path)


def test_expert_parallel_2_with_context_parallel_2_equals_one_process(data_bin, one_process, tmp_path):
    """4 ranks, dp_shard 2 x cp 2 under FSDP2, the experts spread over ep 2 of the dp_shard x cp ranks (each rank's
    experts sharded over the 2 ranks holding them): one process with --update-freq 2 (the same global batch)."""
    proc = train(data_bin, tmp_path, "--max-update", str(UPDATES), "--distributed-world-size", "4", *CP2, *FSDP_EP)
    assert "expert parallel: 2 MoE layers' experts over 2 ranks" in proc.stdout + proc.stderr
    assert_equals_one_process(proc, one_process, tmp_path)


def test_expert_parallel_checkpoint_resumes_at_two_ranks_and_at_one(data_bin, one_process, tmp_path):
    """Saved at --expert-parallel-size 2 (whole expert stacks and their Adam moments): resumed by two expert-parallel
    ranks, and by one process, each continues as the uninterrupted one-process run."""
    import shutil

    first = tmp_path / "ep2"
    train(data_bin, first, "--max-update", "2", "--distributed-world-size", "2", "--expert-parallel-size", "2")
    shutil.copytree(first, tmp_path / "ep1")
    again = train(
        data_bin, first, "--max-update", str(UPDATES), "--distributed-world-size", "2", "--expert-parallel-size", "2"
    )
    assert_logged_losses_match(H.losses(again.stdout), one_process["losses"], range(3, UPDATES + 1))
    alone = train(data_bin, tmp_path / "ep1", "--max-update", str(UPDATES), *ONE_PROC)
    assert_logged_losses_match(H.losses(alone.stdout), one_process["losses"], range(3, UPDATES + 1))
    torch.testing.assert_close(expert_bias(tmp_path / "ep1"), one_process["bias"])


def test_expert_parallel_clips_by_the_global_norm(data_bin, tmp_path):
    """--clip-norm under expert parallelism trains as one process (the norm's expert share, added over the ep ranks,
    is checked exactly by the dispatch test: in this tiny model the experts hold little of the norm)."""
    clip = ["--max-update", "2", "--clip-norm", "0.05"]
    alone = train(data_bin, tmp_path / "one", *clip, *ONE_PROC)
    placed = train(data_bin, tmp_path / "ep", *clip, "--distributed-world-size", "2", "--expert-parallel-size", "2")
    assert_logged_losses_match(H.losses(placed.stdout), H.losses(alone.stdout), range(1, 3))
    norms = [gradient_norms(proc.stdout) for proc in (alone, placed)]
    assert sorted(norms[0]) == [1, 2] and min(norms[0].values()) > 0.05  # clipping was active
    assert norms[1] == pytest.approx(norms[0], rel=1e-3, abs=2e-3)


def gradient_norms(stdout):
    """{update: logged gradient norm} of the train_inner lines."""
    import json

    return {
        int(r["num_updates"]): float(r["gnorm"])
        for r in (
            json.loads(line.split("| train_inner |", 1)[1]) for line in stdout.splitlines() if "| train_inner |" in line
        )
    }


TP_EP = ["--distributed-world-size", "4", "--model-parallel-size", "2", "--expert-parallel-size", "2"]


@pytest.mark.parametrize(
    "sequence",
    [["--no-sequence-parallel"], [], ["--ddp-backend", "fully_sharded"]],
    ids=["replicated_sequence", "sequence_parallel", "full_shard_sequence_parallel"],
)
def test_expert_parallel_2_with_tensor_parallel_2_equals_one_process(data_bin, one_process, tmp_path, sequence):
    """4 ranks, --model-parallel-size 2 --expert-parallel-size 2: attention split over the 2 tp ranks, each expert
    whole on both (its FSDP2 mesh: the 2 ranks holding it, one per tp rank), the 4 experts spread over the 2
    data-parallel ranks (ep 2), train as one process with --update-freq 2 (the same global batch): losses, router
    terms and gradient norms, the same aux-loss-free bias; the consolidated checkpoint holds the whole stacks, and
    one process resumed from the one saved after 2 updates logs the same later losses. With and without sequence
    parallelism (each tp rank routing half of the positions: the router statistics summed over tp), and under
    --ddp-backend fully_sharded (the dense layers sharded over the 2 data-parallel ranks)."""
    import shutil

    flags = [*TP_EP, *sequence]
    first = train(data_bin, tmp_path / "tp_ep", "--max-update", "2", *flags)
    assert "whole on each tp rank, each sharded by FSDP2 over the 2 ranks holding them" in first.stdout + first.stderr
    shutil.copytree(tmp_path / "tp_ep", tmp_path / "one")
    again = train(data_bin, tmp_path / "tp_ep", "--max-update", str(UPDATES), *flags)
    assert_logged_losses_match(H.losses(first.stdout), one_process["losses"], range(1, 3))
    assert_logged_losses_match(H.losses(again.stdout), one_process["losses"], range(3, UPDATES + 1))
    assert_router_terms_match(logged(first.stdout + again.stdout), one_process["terms"])
    norms = {**gradient_norms(first.stdout), **gradient_norms(again.stdout)}  # Adam alone would hide a scaled gradient
    assert norms == pytest.approx(gradient_norms(one_process["stdout"]), rel=1e-3, abs=2e-3)
    torch.testing.assert_close(expert_bias(tmp_path / "tp_ep"), one_process["bias"])
    alone = train(data_bin, tmp_path / "one", "--max-update", str(UPDATES), *ONE_PROC)
    assert_logged_losses_match(H.losses(alone.stdout), one_process["losses"], range(3, UPDATES + 1))


def test_tensor_parallel_2_without_expert_parallelism_equals_one_process(data_bin, tmp_path):
    """--model-parallel-size 2 alone (sequence parallel): every expert whole on both tp ranks (the MoE layer sharded
    by FSDP2 over all ranks, its gradient the sum of the two halves of the positions) trains as one process with
    the same batch: losses, router terms and gradient norms."""
    alone = train(data_bin, tmp_path / "one", "--max-update", "2")
    split = train(
        data_bin, tmp_path / "tp", "--max-update", "2", "--distributed-world-size", "2", "--model-parallel-size", "2"
    )
    assert_logged_losses_match(H.losses(split.stdout), H.losses(alone.stdout), range(1, 3))
    assert_router_terms_match(logged(split.stdout), logged(alone.stdout), range(1, 3))
    assert gradient_norms(split.stdout) == pytest.approx(gradient_norms(alone.stdout), rel=1e-3, abs=2e-3)


def test_expert_parallel_with_tensor_parallel_compiled_equals_one_process(data_bin, one_process, tmp_path):
    """--compile under EP 2 x TP 2 (sequence parallel): each block's forward compiled in graphs around the MoE layer's
    own FSDP2 hooks and token exchange (eager), the losses those of one eager process with --update-freq 2."""
    proc = train(data_bin, tmp_path, "--max-update", "2", *TP_EP, "--compile")
    assert "graphs around the expert exchange" in proc.stdout + proc.stderr
    assert_logged_losses_match(H.losses(proc.stdout), one_process["losses"], range(1, 3))
