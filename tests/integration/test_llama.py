"""The Llama family (toolkit/models/llama/): sizes, the model's arithmetic, and its composition with training.

In process: the named sizes' parameter counts equal the published ones; the KV cache (G heads, RoPE
positions continuing) equals the full forward; generation with and without the cache agrees; FLOPs
per token; shape errors are one line.

Through toolkit-train (a tiny Llama, GQA 4:2, untied, on the deterministic data-bin of
tests/helpers/dist_helpers.py): one process with --update-freq 2 is the reference (the loss falls on real
text); 2-rank FSDP2, 2-rank DDP and tensor parallelism over 2 ranks (KV heads split; with and without sequence
parallelism) match it, as does one process with --checkpoint-activations --compile (aot_eager);
a run stopped at update 4 resumes exactly; eval-lm and generation drive the trained checkpoint.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.dist_helpers import llama_args
from toolkit.generation import GenerationConfig, SequenceGenerator

UPDATES = 8
REL_TOL, LOGGED_TOL = 1e-4, 1.01e-3  # the CLI logs losses rounded to 3 decimals


def train(data_bin, save_dir, *flags, env=None):
    proc = H.run_train([data_bin] + llama_args(save_dir) + list(flags), env=env)
    assert proc.returncode == 0, f"toolkit-train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
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
    proc = train(data_bin, tmp_path, "--max-update", str(UPDATES), "--distributed-world-size", "2",
                 "--ddp-backend", backend)
    assert "training on 2 devices" in proc.stdout
    assert_logged_losses_match(H.losses(proc.stdout), baseline["losses"])
    assert_same_params(model_state(tmp_path / "checkpoint_last.pt"), model_state(baseline["ckpt"]))


@pytest.mark.parametrize("flags", [["--ddp-backend", "fully_sharded"],
                                   ["--no-sequence-parallel", "--checkpoint-activations"]],
                         ids=["sequence_parallel", "replicated_activations"])
def test_tensor_parallel_two_ranks_match_one_process(data_bin, baseline, tmp_path, flags):
    """M=2 splits the 4 query heads and the 2 key/value heads: one of each group per rank."""
    proc = train(data_bin, tmp_path, "--max-update", str(UPDATES), "--update-freq", "2", "--distributed-world-size",
                 "2", "--model-parallel-size", "2", *flags)
    assert "tensor parallel: 2 ranks per replica, 1 data-parallel replicas" in proc.stdout
    assert_logged_losses_match(H.losses(proc.stdout), baseline["losses"])
    assert_same_params(model_state(tmp_path / "checkpoint_last.pt"), model_state(baseline["ckpt"]))


def test_tensor_parallel_refuses_kv_heads_it_cannot_split(data_bin, tmp_path):
    proc = H.run_train([data_bin] + llama_args(tmp_path) + ["--decoder-kv-heads", "1", "--distributed-world-size", "2",
                                                          "--model-parallel-size", "2"])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert lines == ["toolkit-train: error: --decoder-kv-heads 1: must be divisible by --model-parallel-size 2 (each "
                     "rank holds whole heads and an equal share); choose a model parallel size that divides it"]


def test_checkpoint_activations_and_compile_match_eager(data_bin, baseline, tmp_path):
    proc = train(data_bin, tmp_path, "--max-update", str(UPDATES), "--update-freq", "2",
                 "--checkpoint-activations", "--compile", env={"TOOLKIT_COMPILE_BACKEND": "aot_eager"})
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


def reference_eval(model, stream, block):
    """(sum of natural-log scores, count): blocks of ``block`` targets, each predicted from the tokens
    before it in its block, ``</s>`` before the first (eval-lm without a context window)."""
    total = 0.0
    for s in range(0, len(stream), block):
        targets = stream[s:s + block]
        inputs = torch.tensor([[stream[s - 1] if s else 2] + targets[:-1]])
        with torch.no_grad():
            lp = model.get_normalized_probs(model(inputs))[0]
        total += float(lp.gather(1, torch.tensor(targets)[:, None]).sum())
    return total, len(stream)


def test_eval_lm_and_generation_drive_the_trained_model(data_bin, baseline):
    from toolkit.data.indexed_dataset import MMapIndexedDataset
    from toolkit.inference.eval_lm_main import EvalLMConfig, main
    from toolkit.inference import load_model

    result = main(EvalLMConfig(data=data_bin, path=baseline["ckpt"], gen_subset="valid", tokens_per_sample=32,
                               batch_size=3))
    model, task, _ = load_model(baseline["ckpt"], data_bin)
    valid = MMapIndexedDataset(os.path.join(data_bin, "valid"))
    stream = [int(t) for i in range(len(valid)) for t in valid[i]]
    total, count = reference_eval(model, stream, 32)
    assert result["count"] == count
    assert result["loss"] == pytest.approx(-total / count / math.log(2), rel=1e-5)

    prompts = [task.dictionary.encode_line(p, append_eos=False).long() for p in ("w1 w2", "w3")]
    cfg = GenerationConfig(beam=2, nbest=2, max_len_b=10)
    cached, recomputed = (SequenceGenerator([model], task.dictionary, cfg, incremental=inc).generate(prompts)
                          for inc in (True, False))
    assert [[h["tokens"].tolist() for h in hs] for hs in cached] == [[h["tokens"].tolist() for h in hs]
                                                                     for hs in recomputed]
