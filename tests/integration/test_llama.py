"""The Llama family (toolkit/models/llama/): sizes, the model's arithmetic, and its composition with training.

In process: the named sizes' parameter counts equal the published ones; the KV cache (G heads, RoPE
positions continuing) equals the full forward; generation with and without the cache agrees; FLOPs
per token; shape errors are one line.

Through toolkit-train (a tiny Llama, GQA 4:2, untied, on the deterministic data-bin of
tests/helpers/dist_helpers.py): one process with --update-freq 2 is the reference (the loss falls on real
text); 2-rank FSDP2, 2-rank DDP and tensor parallelism over 2 ranks (KV heads split; with and without sequence
parallelism) match it, as does one process with --checkpoint-activations --compile (aot_eager);
a run stopped at update 4 resumes exactly; eval-lm and generation drive the trained checkpoint.
--cpu-offload with cpu_adam on 2 FSDP2 ranks matches it too and resumes from its update-4 checkpoint
(consolidated and sharded); --fp16 (dynamic loss scaling, overflows skipped) and --bf16 track fp32 within
the tolerances of test_fp16.py and test_distributed.py's bf16 strategy.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.dist_helpers import llama_args
from tests.helpers.eval_reference import reference_eval
from toolkit.generation import GenerationConfig, SequenceGenerator

UPDATES = 8
REL_TOL, LOGGED_TOL = 1e-4, 1.01e-3  # the CLI logs losses rounded to 3 decimals


def train(data_bin, save_dir, *flags, env=None):
    proc = H.run_train([data_bin] + llama_args(save_dir) + list(flags), env=env)
    assert proc.returncode == 0, (
        f"toolkit-train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("llama") / "bin"))


@pytest.fixture(scope="module")
def baseline(data_bin, tmp_path_factory):
    """One process, --update-freq 2: the global batch of two ranks with --update-freq 1."""
    save = tmp_path_factory.mktemp("llama-baseline")
    proc = train(data_bin, save, "--max-update", str(UPDATES), "--update-freq", "2")
    return {"losses": H.losses(proc.stdout), "ckpt": str(save / "checkpoint_last.pt"), "stdout": proc.stdout}


def assert_logged_losses_match(got, want):
    assert sorted(got) == list(range(1, UPDATES + 1)), f"updates logged: {sorted(got)}"
    for u in got:
        assert abs(got[u] - want[u]) <= REL_TOL * abs(want[u]) + LOGGED_TOL, (u, got[u], want[u])


def model_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_same_params(a, b, tol=1e-4):
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k].double() - b[k].double()).norm() / max(b[k].double().norm().item(), 1e-12)
        assert diff < tol, (k, float(diff))


def test_trains_on_real_text_and_its_loss_falls(baseline, wikitext_dir, tmp_path):
    """The equivalence runs use uniformly random words (nothing to learn); real text has."""
    from tests.helpers.lm_fixtures import make_wikitext_data_bin

    assert "model: LlamaLanguageModel" in baseline["stdout"]
    make_wikitext_data_bin(tmp_path / "bin", wikitext_dir, max_train_lines=300, max_valid_lines=20)
    losses = H.losses(train(str(tmp_path / "bin"), tmp_path / "ck", "--max-update", "25").stdout)
    first, last = sum(losses[u] for u in (1, 2, 3)) / 3, sum(losses[u] for u in (23, 24, 25)) / 3
    assert last < first - 1.5, losses


@pytest.mark.parametrize("backend", ["fully_sharded", "c10d"])
def test_two_ranks_match_one_process(data_bin, baseline, tmp_path, backend):
    proc = train(
        data_bin, tmp_path, "--max-update", str(UPDATES), "--distributed-world-size", "2", "--ddp-backend", backend
    )
    assert "training on 2 devices" in proc.stdout
    assert_logged_losses_match(H.losses(proc.stdout), baseline["losses"])
    assert_same_params(model_state(tmp_path / "checkpoint_last.pt"), model_state(baseline["ckpt"]))


@pytest.mark.parametrize(
    "flags",
    [["--ddp-backend", "fully_sharded"], ["--no-sequence-parallel", "--checkpoint-activations"]],
    ids=["sequence_parallel", "replicated_activations"],
)
def test_tensor_parallel_two_ranks_match_one_process(data_bin, baseline, tmp_path, flags):
    """M=2 splits the 4 query heads and the 2 key/value heads: one of each group per rank."""
    proc = train(
        data_bin,
        tmp_path,
        "--max-update",
        str(UPDATES),
        "--update-freq",
        "2",
        "--distributed-world-size",
        "2",
        "--model-parallel-size",
        "2",
        *flags,
    )
    assert "tensor parallel: 2 ranks per replica, 1 data-parallel replicas" in proc.stdout
    assert_logged_losses_match(H.losses(proc.stdout), baseline["losses"])
    assert_same_params(model_state(tmp_path / "checkpoint_last.pt"), model_state(baseline["ckpt"]))


def test_tensor_parallel_refuses_kv_heads_it_cannot_split(data_bin, tmp_path):
    proc = H.run_train(
        [data_bin]
        + llama_args(tmp_path)
        + ["--decoder-kv-heads", "1", "--distributed-world-size", "2", "--model-parallel-size", "2"]
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert lines == [
        "toolkit-train: error: --decoder-kv-heads 1: must be divisible by --model-parallel-size 2 (each "
        "rank holds whole heads and an equal share); choose a model parallel size that divides it"
    ]


def test_checkpoint_activations_and_compile_match_eager(data_bin, baseline, tmp_path):
    proc = train(
        data_bin,
        tmp_path,
        "--max-update",
        str(UPDATES),
        "--update-freq",
        "2",
        "--checkpoint-activations",
        "--compile",
        env={"TOOLKIT_COMPILE_BACKEND": "aot_eager"},
    )
    assert "--compile: torch.compile (aot_eager, fullgraph) on each of the 2 blocks" in proc.stdout
    assert_logged_losses_match(H.losses(proc.stdout), baseline["losses"])
    assert_same_params(model_state(tmp_path / "checkpoint_last.pt"), model_state(baseline["ckpt"]))


def test_resume_continues_exactly(data_bin, baseline, tmp_path):
    train(data_bin, tmp_path, "--max-update", "4", "--update-freq", "2")
    more = H.losses(train(data_bin, tmp_path, "--max-update", str(UPDATES), "--update-freq", "2").stdout)
    assert sorted(more) == list(range(5, UPDATES + 1))
    assert all(more[u] == baseline["losses"][u] for u in more)
    want = model_state(baseline["ckpt"])
    got = model_state(tmp_path / "checkpoint_last.pt")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_eval_lm_and_generation_drive_the_trained_model(data_bin, baseline):
    from toolkit.data.indexed_dataset import MMapIndexedDataset
    from toolkit.inference.eval_lm_main import EvalLMConfig, main
    from toolkit.inference import load_model

    result = main(
        EvalLMConfig(data=data_bin, path=baseline["ckpt"], gen_subset="valid", tokens_per_sample=32, batch_size=3)
    )
    model, task, _ = load_model(baseline["ckpt"], data_bin)
    valid = MMapIndexedDataset(os.path.join(data_bin, "valid"))
    stream = [int(t) for i in range(len(valid)) for t in valid[i]]
    total, count = reference_eval(model, stream, 32)
    assert result["count"] == count
    assert result["loss"] == pytest.approx(-total / count / math.log(2), rel=1e-5)

    prompts = [task.dictionary.encode_line(p, append_eos=False).long() for p in ("w1 w2", "w3")]
    cfg = GenerationConfig(beam=2, nbest=2, max_len_b=10)
    cached, recomputed = (
        SequenceGenerator([model], task.dictionary, cfg, incremental=inc).generate(prompts) for inc in (True, False)
    )
    assert [[h["tokens"].tolist() for h in hs] for hs in cached] == [
        [h["tokens"].tolist() for h in hs] for hs in recomputed
    ]


# --- --cpu-offload (cpu_adam) and mixed precision: the family through the same paths as transformer_lm ------------

OFFLOAD = [
    "--ddp-backend",
    "fully_sharded",
    "--cpu-offload",
    "--optimizer",
    "cpu_adam",
    "--distributed-world-size",
    "2",
]


@pytest.fixture(scope="module", params=["consolidated", "sharded"])
def offload_run(request, data_bin, tmp_path_factory):
    """2 gloo ranks, FSDP2 with the shards and cpu_adam's moments in host memory; checkpoints at update 4."""
    save = tmp_path_factory.mktemp(f"llama-offload-{request.param}")
    layout = ["--use-sharded-state"] if request.param == "sharded" else []
    proc = train(data_bin, save, *OFFLOAD, *layout, "--max-update", str(UPDATES), "--save-interval-updates", "4")
    return {
        "layout": request.param,
        "flags": layout,
        "dir": save,
        "stdout": proc.stdout,
        "losses": H.losses(proc.stdout),
    }


def test_cpu_offload_two_ranks_match_one_process(offload_run, baseline):
    """cpu_adam's update equals torch's Adam: the offloaded run is the one-process run (same tolerances)."""
    stdout = offload_run["stdout"]
    assert "training on 2 devices" in stdout and "fully_sharded: full_shard" in stdout
    assert_logged_losses_match(offload_run["losses"], baseline["losses"])
    if offload_run["layout"] == "consolidated":
        state = torch.load(offload_run["dir"] / "checkpoint_1_4.pt", map_location="cpu", weights_only=True)
        assert state["optimizer_name"] == "cpu_adam"
        assert_same_params(model_state(offload_run["dir"] / "checkpoint_last.pt"), model_state(baseline["ckpt"]))
    else:
        assert any(f.endswith(".distcp") for f in os.listdir(offload_run["dir"] / "checkpoint_1_4"))


def test_cpu_offload_resumes_from_its_checkpoint(offload_run, data_bin, baseline, tmp_path):
    saved = offload_run["dir"] / ("checkpoint_1_4.pt" if offload_run["layout"] == "consolidated" else "checkpoint_1_4")
    proc = train(
        data_bin, tmp_path, *OFFLOAD, *offload_run["flags"], "--restore-file", str(saved), "--max-update", str(UPDATES)
    )
    loaded = r"loaded (sharded )?checkpoint \S*checkpoint_1_4(\.pt)? .*@ 4 updates"
    assert re.search(loaded, proc.stdout), proc.stdout[-3000:]
    resumed = H.losses(proc.stdout)
    assert sorted(resumed) == list(range(5, UPDATES + 1))
    assert all(resumed[u] == pytest.approx(offload_run["losses"][u], rel=1e-6) for u in resumed), resumed
    if offload_run["layout"] == "consolidated":
        assert_same_params(model_state(tmp_path / "checkpoint_last.pt"), model_state(baseline["ckpt"]))


# rel. tolerance of the logged losses against fp32: test_fp16.py's (fp16) and test_distributed.py's bf16 strategy
MIXED = {"fp16": (["--fp16", "--fp16-scale-window", "2"], 2e-3), "bf16": (["--bf16"], 2e-2)}


@pytest.mark.parametrize("precision", sorted(MIXED))
def test_mixed_precision_tracks_fp32(data_bin, baseline, tmp_path, precision):
    """fp32 master weights, half-precision compute; fp16 with dynamic loss scaling (the scale doubles every
    2 updates without overflow), bf16 without a scaler."""
    flags, tol = MIXED[precision]
    proc = train(data_bin, tmp_path, "--max-update", str(UPDATES), "--update-freq", "2", *flags)
    losses = H.losses(proc.stdout)
    assert sorted(losses) == list(range(1, UPDATES + 1))
    for u in losses:
        assert losses[u] == pytest.approx(baseline["losses"][u], rel=tol), (u, losses, baseline["losses"])
    scales = [
        json.loads(line.split("| train_inner | ")[1]).get("loss_scale")
        for line in proc.stdout.splitlines()
        if "| train_inner | " in line
    ]
    state = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert {v.dtype for v in state["model"].values()} == {torch.float32}
    want = model_state(baseline["ckpt"])  # half-precision compute really ran: the weights are not fp32's bit for bit
    assert not all(torch.equal(state["model"][k], want[k]) for k in want)
    if precision == "fp16":
        assert [float(s) for s in scales] == [128.0 * 2 ** (u // 2) for u in range(1, UPDATES + 1)], scales
        assert state["extra_state"]["trainer"]["loss_scaler"]["loss_scale"] == 128.0 * 2 ** (UPDATES // 2)
    else:
        assert scales == [None] * UPDATES


def test_fp16_overflow_halves_the_scale_and_training_goes_on(data_bin, tmp_path):
    """A loss scale of 2**40 overflows fp16 gradients: those steps are skipped and the scale halves until they fit."""
    proc = train(data_bin, tmp_path, "--max-update", "3", "--fp16", "--fp16-init-scale", str(2**40), "--no-save")
    notes = [line for line in proc.stdout.splitlines() if "NOTE: gradient overflow detected" in line]
    assert notes and notes[0].endswith(f"setting loss scale to: {float(2**39)}")
    halved = [float(n.rsplit(": ", 1)[1]) for n in notes]
    assert halved == [2.0 ** (39 - i) for i in range(len(halved))]
    losses = H.losses(proc.stdout)
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())
