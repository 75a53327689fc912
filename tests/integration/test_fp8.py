"""``--fp8``: torchao float8 training of the blocks' Linear layers (CPU: torch emulates the float8 matmuls)."""

import pytest

from tests.helpers.cli import train

pytest.importorskip("torchao.float8", reason="--fp8 needs torchao (pip install torchao)")

TINY_FP8 = [
    "--decoder-embed-dim",
    "64",
    "--decoder-input-dim",
    "64",
    "--decoder-output-dim",
    "64",
    "--decoder-ffn-embed-dim",
    "128",
    "--dropout",
    "0",
]


def test_fp8_training_follows_fp32_and_its_checkpoint_loads_without_fp8(tmp_path, wikitext_dir):
    from tests.helpers.lm_fixtures import make_wikitext_data_bin

    data = str(tmp_path / "bin")
    make_wikitext_data_bin(data, wikitext_dir, max_train_lines=400, max_valid_lines=40)
    common = [*TINY_FP8, "--max-update", "12", "--log-interval", "4", "--disable-validation"]
    fp32 = train(data, str(tmp_path / "fp32"), *common).losses()
    fp8 = train(data, str(tmp_path / "fp8"), *common, "--fp8")
    assert "--fp8: 8 Linear layers of the blocks train in float8" in fp8.stdout
    got = fp8.losses()
    assert sorted(got) == sorted(fp32) == [4, 8, 12]
    assert got[12] < got[4]  # it trains
    for update, loss in fp32.items():
        assert abs(got[update] - loss) / loss < 0.02, (update, got[update], loss)
    # The float8 run's checkpoint resumes in a plain run: same parameter names and shapes.
    resumed = train(
        data, str(tmp_path / "fp8"), *TINY_FP8, "--max-update", "14", "--log-interval", "2", "--disable-validation"
    )
    assert 14 in resumed.losses()


def test_float8_all_gather_on_two_fsdp2_ranks_follows_one_process(tmp_path, wikitext_dir):
    """Two gloo ranks with float8 all-gather against one process with the same recipe. Not bit-equal: each
    rank scales its own half of the batch's activations (a per-tensor amax), hence the 3% bound."""
    from tests.helpers.lm_fixtures import make_wikitext_data_bin

    data = str(tmp_path / "bin")
    make_wikitext_data_bin(data, wikitext_dir, max_train_lines=400, max_valid_lines=40)
    common = [
        *TINY_FP8,
        "--max-update",
        "8",
        "--log-interval",
        "4",
        "--disable-validation",
        "--no-save",
        "--fp8",
        "--fp8-recipe",
        "tensorwise",
    ]
    one = train(data, str(tmp_path / "one"), *common, "--batch-size", "8").losses()
    two = train(
        data,
        str(tmp_path / "two"),
        *common,
        "--fp8-all-gather",
        "--ddp-backend",
        "fully_sharded",
        "--distributed-world-size",
        "2",
    )
    assert "float8 all-gather" in two.stdout
    for update, loss in one.items():
        assert abs(two.losses()[update] - loss) / loss < 0.03, (update, two.losses()[update], loss)
