"""``toolkit-train --context-parallel-size``: each sequence split over gloo ranks equals one process.

The attention arithmetic of the layout is checked in one process by tests/unit/test_context_parallel.py;
here the real command: the all-gather of keys/values and its backward, positions kept global, the loss and
token counts summed over the cp ranks, FSDP2 sharding over dp_shard x cp, checkpoints and resume at CP 1,
--compile around the eager attention.
"""

import json
import shutil

import torch

from tests.helpers import dist_helpers as H
from tests.helpers.dist_helpers import assert_logged_losses_match, llama_args
from toolkit.distributed.compile import BACKEND_ENV

UPDATES = 4
DOCUMENTS = ["--document-attention-mask", "--reset-position-ids", "--sample-break-mode", "none"]


def train(data, save_dir, *flags):
    proc = H.run_train(
        [data, *llama_args(save_dir), "--disable-validation", "--max-update", str(UPDATES), *flags], timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def model_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_same_weights(a, b):
    """atol 1e-4 (lr 3e-3, weights ~1e-2): the CP ranks attend tile by tile with the flash kernel, one process
    in one call, so the gradients differ in rounding; Adam turns rounding of a near-zero gradient into up to
    lr-sized steps (2e-5 measured on one element of 4 updates), as in test_tp_cli's comparison."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-4, msg=k)


def test_dp2_cp2_equals_one_process_with_update_freq_2_plain_and_with_documents(tmp_path):
    """4 ranks (dp_shard 2 x cp 2, FSDP2 over all four): two batches per update, each split over 2 ranks."""
    data = H.make_lm_data_bin(str(tmp_path / "bin"))
    for name, flags in (("plain", []), ("documents", DOCUMENTS)):
        one = train(data, tmp_path / f"{name}-one", *flags, "--update-freq", "2")
        cp = train(
            data,
            tmp_path / f"{name}-cp",
            *flags,
            "--distributed-world-size",
            "4",
            "--context-parallel-size",
            "2",
            "--ddp-backend",
            "fully_sharded",
        )
        assert_logged_losses_match(H.losses(cp.stdout), H.losses(one.stdout), range(1, UPDATES + 1))
        assert_same_weights(
            model_state(tmp_path / f"{name}-cp" / "checkpoint_last.pt"),
            model_state(tmp_path / f"{name}-one" / "checkpoint_last.pt"),
        )


def test_cp2_with_documents_and_a_window_equals_one_process(tmp_path):
    """Documents and a 5-token window crossing the chunk boundaries (T 32 in chunks of 8); DDP (c10d)."""
    data = H.make_lm_data_bin(str(tmp_path / "bin"))
    flags = [*DOCUMENTS, "--sliding-window", "5"]
    one = train(data, tmp_path / "one", *flags)
    cp = train(data, tmp_path / "cp", *flags, "--distributed-world-size", "2", "--context-parallel-size", "2")
    assert_logged_losses_match(H.losses(cp.stdout), H.losses(one.stdout), range(1, UPDATES + 1))
    assert_same_weights(
        model_state(tmp_path / "cp" / "checkpoint_last.pt"), model_state(tmp_path / "one" / "checkpoint_last.pt")
    )


def test_checkpoint_saved_at_cp2_resumes_at_cp1(tmp_path):
    """2 ranks (cp 2, FSDP2) = one process; their sharded (DCP) checkpoint of update 2 continues in one process."""
    data = H.make_lm_data_bin(str(tmp_path / "bin"))
    one = train(data, tmp_path / "one")
    cp = train(
        data,
        tmp_path / "cp",
        "--distributed-world-size",
        "2",
        "--context-parallel-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--save-interval-updates",
        "2",
        "--use-sharded-state",
    )
    assert_logged_losses_match(H.losses(cp.stdout), H.losses(one.stdout), range(1, UPDATES + 1))
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "cp" / "checkpoint_1_2", resumed_dir / "checkpoint_last")
    resumed = train(data, resumed_dir)
    assert "loaded sharded checkpoint" in resumed.stdout
    assert_logged_losses_match(H.losses(resumed.stdout), H.losses(one.stdout), range(3, UPDATES + 1))
    assert_same_weights(
        model_state(resumed_dir / "checkpoint_last.pt"), model_state(tmp_path / "one" / "checkpoint_last.pt")
    )


def test_a_family_without_context_parallel_attention_is_refused_in_one_line(tmp_path):
    data = H.make_lm_data_bin(str(tmp_path / "bin"))
    proc = H.run_train(
        [data, *H.model_args(str(tmp_path / "ck")), "--distributed-world-size", "2", "--context-parallel-size", "2"]
    )
    assert proc.returncode == 1
    assert "--arch transformer_lm's attention does not exchange keys/values" in proc.stderr.strip().splitlines()[-1]


CP2 = ["--distributed-world-size", "2", "--context-parallel-size", "2"]
FSDP_AC = ["--ddp-backend", "fully_sharded", "--checkpoint-activations"]
COMPILED_CP = [  # [name, flags, backend] for tests/helpers/compile_helpers.py; null backend: inductor
    ["eager", CP2, None],
    ["compiled", CP2 + ["--compile"], None],
    ["eager_documents", CP2 + FSDP_AC + DOCUMENTS, None],
    ["compiled_documents", CP2 + FSDP_AC + DOCUMENTS + ["--compile"], None],
]


def assert_compiled_equals_eager(tmp_path, world_size: int, configs) -> None:
    """Each ``eager...`` config against its ``compiled...`` twin, all run in one launched group
    (tests/helpers/compile_helpers.py): the losses equal to 1e-5 relative (fp32: only the graphs' rounding
    differs). The compiled run captures 4 graphs, shared by the blocks: the block's forward and the attention's, each
    up to the eager attention call and from it on; a traced attention would add its own pieces (7 measured at the
    first batch without ``torch.compiler.disable``, and more at the first batch with documents). All 4 are captured
    in the first update and none after it (a recompile per batch would add graphs at each update)."""
    data = H.make_lm_data_bin(str(tmp_path / "bin"))
    out = tmp_path / "results.json"
    proc = H.run_cli(
        "tests.helpers.compile_helpers",
        [data, str(out), str(world_size), json.dumps(configs), "llama"],
        env={BACKEND_ENV: ""},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "graphs around the context-parallel attention" in proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    for eager in (name for name, _, _ in configs if not name.startswith("compiled")):
        ref, got = results[eager], results["compiled" + eager[len("eager") :]]
        assert ref["graphs"] == 0 and got["graphs"] == 4, (eager, ref["graphs"], got["graphs"])
        assert got["graphs_after"][0] == got["graphs"], (eager, got["graphs_after"])
        for u, (a, b) in enumerate(zip(got["losses"], ref["losses"]), start=1):
            assert abs(a - b) <= 1e-5 * abs(b), (eager, u, a, b)
        assert got["keys"] == ref["keys"]


def test_cp2_compiled_equals_eager_plain_and_with_documents(tmp_path):
    """--compile (inductor) under --context-parallel-size 2 (2 ranks): each block compiled around its eager attention
    over the gathered keys/values (``ContextShard.attend``); losses measured equal to every printed digit. Plain
    with DDP, and with documents crossing the chunk boundaries (tiles that change batch by batch) under FSDP2 and
    --checkpoint-activations (the block's own forward compiled inside the wrapper)."""
    assert_compiled_equals_eager(tmp_path, 2, COMPILED_CP)


def test_tp2_cp2_compiled_equals_eager(tmp_path):
    """TP 2 x CP 2 on 4 ranks (FSDP2, sequence parallelism): the tensor-parallel compile (the block's forward, its
    random-number hooks eager) around the same eager attention; measured 5e-8 relative."""
    tp_cp = [
        "--distributed-world-size",
        "4",
        "--context-parallel-size",
        "2",
        "--model-parallel-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
    ]
    assert_compiled_equals_eager(tmp_path, 4, [["eager", tp_cp, None], ["compiled", tp_cp + ["--compile"], None]])


def test_tp2_cp2_and_cp2_with_checkpointing_in_bf16_equal_one_process(tmp_path):
    """TP 2 x CP 2 on 4 ranks (one replica: each TP slice's sequence split over 2 ranks, sequence parallelism on)
    = one process; CP 2 with --checkpoint-activations --bf16 (the gather runs again in the recomputation)
    = one process in bf16, to bf16's rounding."""
    data = H.make_lm_data_bin(str(tmp_path / "bin"))
    one = train(data, tmp_path / "one")
    tp_cp = train(
        data,
        tmp_path / "tp-cp",
        "--distributed-world-size",
        "4",
        "--context-parallel-size",
        "2",
        "--model-parallel-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
    )
    assert_logged_losses_match(H.losses(tp_cp.stdout), H.losses(one.stdout), range(1, UPDATES + 1))
    half = ["--bf16", "--checkpoint-activations"]
    one_bf16 = H.losses(train(data, tmp_path / "one-bf16", *half).stdout)
    cp_bf16 = H.losses(
        train(
            data,
            tmp_path / "cp-bf16",
            *half,
            "--distributed-world-size",
            "2",
            "--context-parallel-size",
            "2",
            "--ddp-backend",
            "fully_sharded",
        ).stdout
    )
    assert sorted(cp_bf16) == list(range(1, UPDATES + 1))
    for u in cp_bf16:  # bf16 keeps 8 bits of mantissa: 2e-3 relative is its rounding of a loss near 7
        assert abs(cp_bf16[u] - one_bf16[u]) <= 2e-3 * abs(one_bf16[u]), (u, cp_bf16[u], one_bf16[u])


def test_cp2_pads_uneven_lines_and_validates_as_one_process(tmp_path):
    """--sample-break-mode eos: lines of any length (padded to a multiple of 2C on the CP ranks); the validation's
    loss and counts (words and sentences per batch: each row counted once over the cp ranks) equal one process's."""
    data = H.make_lm_data_bin(str(tmp_path / "bin"))

    def run(name, *flags):
        proc = H.run_train(
            [data, *llama_args(tmp_path / name), "--max-update", "3", "--sample-break-mode", "eos", *flags], timeout=600
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        valid = [json.loads(line.split("| valid | ")[1]) for line in proc.stdout.splitlines() if "| valid | " in line]
        return H.losses(proc.stdout), {k: valid[-1][k] for k in ("valid_loss", "valid_wpb", "valid_bsz")}

    one_losses, one_valid = run("one")
    cp_losses, cp_valid = run("cp", "--distributed-world-size", "2", "--context-parallel-size", "2")
    assert_logged_losses_match(cp_losses, one_losses, range(1, 4))
    assert cp_valid == one_valid
