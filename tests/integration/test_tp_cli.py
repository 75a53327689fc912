"""``toolkit-train --model-parallel-size``: tensor parallelism through the real command, against one process.

The library-level parity (every layout, activation checkpointing, fp16, dropout streams, DCP
resharding) is in tests/integration/test_tensor_parallel.py; here the command line, the trainer's
data-parallel bookkeeping (batches sharded over replicas, not ranks), checkpoints and resume.
"""

import pytest
import torch

from tests.helpers import dist_helpers as H

UPDATES = 6
REL_TOL = 1e-4
LOGGED_TOL = 1.01e-3  # one unit in the last logged place


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("tp") / "bin"))


def arch_default_args(save_dir) -> list:
    """The tiny model under --arch transformer_lm as fairseq defines it: 512-wide input/output embeddings
    (project_in_dim/project_out_dim), post-norm without a final LayerNorm (only the sizes are small)."""
    args, out, skip = H.model_args(str(save_dir)), [], 0
    for a in args:
        if skip:
            skip -= 1
        elif a in ("--decoder-input-dim", "--decoder-output-dim"):
            skip = 1
        elif a != "--decoder-normalize-before":
            out.append(a)
    return out


def train(data_bin, save_dir, *flags):
    proc = H.run_train([data_bin] + arch_default_args(save_dir) + ["--disable-validation", *flags], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def assert_close(got, want, tol=REL_TOL):
    assert sorted(got) == sorted(want)
    for u in want:
        assert abs(got[u] - want[u]) <= tol * abs(want[u]) + LOGGED_TOL, (u, got[u], want[u])


def model_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def test_two_ranks_one_replica_match_one_process_and_resume_on_one(data_bin, tmp_path):
    single = train(data_bin, tmp_path / "one", "--max-update", str(UPDATES))
    tp = train(
        data_bin,
        tmp_path / "tp",
        "--max-update",
        str(UPDATES),
        "--distributed-world-size",
        "2",
        "--model-parallel-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--save-interval-updates",
        "3",
        "--use-sharded-state",
    )
    assert "tensor parallel: 2 ranks per replica, 1 data-parallel replicas" in tp.stdout
    assert_close(H.losses(tp.stdout), H.losses(single.stdout))
    # the sharded checkpoint of update 3, saved at (dp 1 x mp 2), resumes in one plain process
    resume_dir = tmp_path / "resumed"
    resume_dir.mkdir()
    import shutil

    shutil.copytree(tmp_path / "tp" / "checkpoint_1_3", resume_dir / "checkpoint_last")
    resumed = train(data_bin, resume_dir, "--max-update", str(UPDATES))
    assert "loaded sharded checkpoint" in resumed.stdout
    assert_close(H.losses(resumed.stdout), {u: v for u, v in H.losses(single.stdout).items() if u > 3})
    a, b = model_state(resume_dir / "checkpoint_last.pt"), model_state(tmp_path / "one" / "checkpoint_last.pt")
    assert a.keys() == b.keys()
    for k in a:
        if k.endswith("qkv_proj.bias"):  # the k bias has an exactly-zero gradient: Adam steps on rounding noise
            C = a[k].numel() // 3
            a[k], b[k] = torch.cat([a[k][:C], a[k][2 * C :]]), torch.cat([b[k][:C], b[k][2 * C :]])
        # atol 1e-4: with fairseq's 512-wide input embeddings, an element of project_in_dim whose gradient is
        # near zero moves by Adam-normalized rounding noise (3.5e-5 measured; lr is 3e-3)
        assert torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-4), k


def test_consolidated_checkpoint_is_the_plain_layout(data_bin, tmp_path):
    single = train(data_bin, tmp_path / "one", "--max-update", "2")
    tp = train(
        data_bin, tmp_path / "tp", "--max-update", "2", "--distributed-world-size", "2", "--tensor-parallel-size", "2"
    )  # fairseq's other name; c10d replicates through FSDP2
    assert_close(H.losses(tp.stdout), H.losses(single.stdout))
    a, b = model_state(tmp_path / "tp" / "checkpoint_last.pt"), model_state(tmp_path / "one" / "checkpoint_last.pt")
    assert list(a) == list(b) and all(a[k].shape == b[k].shape for k in a)


def test_refused_combinations_are_one_line(data_bin, tmp_path):
    proc = H.run_train(
        [data_bin] + arch_default_args(tmp_path) + ["--model-parallel-size", "2", "--distributed-world-size", "3"]
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "toolkit-train: error: --model-parallel-size 2: must divide the world size 3 (the world is split into "
        "world/M data-parallel groups of M tensor-parallel ranks)"
    ]


def test_two_replicas_of_two_ranks_match_one_process_with_update_freq_2(data_bin, tmp_path):
    """(dp 2 x mp 2): the two replicas read different batches; one process takes both per update."""
    single = train(data_bin, tmp_path / "one", "--max-update", "4", "--update-freq", "2")
    tp = train(
        data_bin,
        tmp_path / "tp",
        "--max-update",
        "4",
        "--distributed-world-size",
        "4",
        "--model-parallel-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
    )
    assert "tensor parallel: 2 ranks per replica, 2 data-parallel replicas" in tp.stdout
    assert_close(H.losses(tp.stdout), H.losses(single.stdout))
