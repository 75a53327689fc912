"""--document-attention-mask / --reset-position-ids: a document inside a packed block scores as it does alone."""

import numpy as np
import pytest

from tests.helpers.cli import run_cli, train
from tests.helpers.dist_helpers import llama_args
from tests.helpers.lm_fixtures import make_data_bin


def test_training_with_the_mask_both_families(tmp_path):
    lines = [" ".join(np.random.RandomState(i).choice(list("abcdefgh"), size=3 + i % 9)) for i in range(200)]
    make_data_bin(tmp_path / "bin", {"train": lines, "valid": lines[:20]})
    masked = [
        "--sample-break-mode",
        "none",
        "--document-attention-mask",
        "--reset-position-ids",
        "--max-update",
        "3",
        "--no-save",
    ]
    runs = [
        train(str(tmp_path / "bin"), str(tmp_path / "t"), *masked),
        run_cli("toolkit_cli.train", [str(tmp_path / "bin"), *llama_args(tmp_path / "l"), *masked]),
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
        assert len(run.losses()) == 3 and all(np.isfinite(list(run.losses().values())))


def test_reset_positions_needs_the_mask(tmp_path):
    make_data_bin(tmp_path / "bin", {"train": ["a b"], "valid": ["a"]})
    run = train(str(tmp_path / "bin"), str(tmp_path / "ck"), "--reset-position-ids", "--max-update", "1", check=False)
    assert run.returncode == 1 and "needs --document-attention-mask" in run.stderr.strip().splitlines()[-1]


def test_two_fsdp_ranks_with_the_mask_equal_one_process(tmp_path):
    """The mask travels with the batch through FSDP2: 2 ranks = 1 process with --update-freq 2."""
    from tests.helpers import dist_helpers as H
    from tests.helpers.dist_helpers import assert_logged_losses_match

    data = H.make_lm_data_bin(str(tmp_path / "bin"))
    masked = ["--document-attention-mask", "--reset-position-ids", "--max-update", "4", "--disable-validation"]
    one = H.run_train([data, *H.model_args(str(tmp_path / "one")), *masked, "--update-freq", "2"])
    two = H.run_train(
        [
            data,
            *H.model_args(str(tmp_path / "two")),
            *masked,
            "--distributed-world-size",
            "2",
            "--ddp-backend",
            "fully_sharded",
        ]
    )
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    assert_logged_losses_match(H.losses(two.stdout), H.losses(one.stdout), range(1, 5))
    plain = H.run_train(
        [
            data,
            *H.model_args(str(tmp_path / "plain")),
            "--max-update",
            "4",
            "--disable-validation",
            "--update-freq",
            "2",
        ]
    )
    assert H.losses(plain.stdout)[4] != H.losses(one.stdout)[4], "the mask changes what is computed"


@pytest.mark.parametrize("family", ["transformer_lm", "llama"])
def test_tensor_parallel_with_the_mask_equals_one_process(tmp_path, family):
    """The mask goes to the blocks by keyword, past the tensor-parallel input styles: TP 2 = one process."""
    from tests.helpers import dist_helpers as H
    from tests.helpers.dist_helpers import assert_logged_losses_match

    data = H.make_lm_data_bin(str(tmp_path / "bin"))
    masked = ["--document-attention-mask", "--reset-position-ids", "--max-update", "3", "--disable-validation"]

    def args(name):
        return H.model_args(str(tmp_path / name)) if family == "transformer_lm" else llama_args(tmp_path / name)

    one = H.run_train([data, *args("one"), *masked])
    tp = H.run_train(
        [
            data,
            *args("tp"),
            *masked,
            "--distributed-world-size",
            "2",
            "--model-parallel-size",
            "2",
            "--ddp-backend",
            "fully_sharded",
        ]
    )
    assert one.returncode == 0 and tp.returncode == 0, (one.stderr[-2000:], tp.stdout[-2000:] + tp.stderr[-2000:])
    assert_logged_losses_match(H.losses(tp.stdout), H.losses(one.stdout), range(1, 4))


def test_compiled_blocks_with_the_mask_equal_eager(tmp_path):
    """--compile (aot_eager, as test_compile's CLI runs) with activation checkpointing takes the mask keyword."""
    from tests.helpers import dist_helpers as H
    from tests.helpers.dist_helpers import assert_logged_losses_match
    from toolkit.distributed.compile import BACKEND_ENV

    data = H.make_lm_data_bin(str(tmp_path / "bin"))
    masked = ["--document-attention-mask", "--reset-position-ids", "--max-update", "3", "--disable-validation"]
    eager = H.run_train([data, *H.model_args(str(tmp_path / "eager")), *masked])
    compiled = H.run_train(
        [data, *H.model_args(str(tmp_path / "compiled")), *masked, "--compile", "--checkpoint-activations"],
        env={BACKEND_ENV: "aot_eager"},
    )
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr[-3000:]
    assert_logged_losses_match(H.losses(compiled.stdout), H.losses(eager.stdout), range(1, 4))
