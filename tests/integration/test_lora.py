"""LoRA fine-tuning on chat data as a user of Hugging Face PEFT relies on it, from a transformers Llama to PEFT.

A tiny transformers Llama with a chat template is imported (``toolkit-export --from hf``), its conversations are
binarized with the template (``toolkit-preprocess --chat-template``), and ``--task sft --lora-rank 4`` fine-tunes
it from the import (``--finetune-from-model``). Only the adapters train: the optimizer holds state for them alone,
every base tensor of the checkpoint is the import's, bit for bit. ``toolkit-export --format peft`` writes PEFT's
layout (adapter_config.json; adapter_model.safetensors under base_model.model.<transformers module>.lora_A/B; the
base in base/, the transformers folder's own tensors) and ``peft.PeftModel.from_pretrained`` on the original
transformers folder gives the toolkit's log-probs and computes what ``--format hf`` (the adapters merged) computes,
fp32 to 1e-4. A resume is exact
(with adapter dropout: its generator resumes too). Two FSDP2 ranks equal one process with ``--update-freq 2``:
fp32 (plain; compiled with aot_eager, activation checkpointing and the document mask; HSDP with Muon and EMA) to
1e-3 of the logged losses and of the adapters; fp16 (with CPU Adam, the two ranks offloaded; memory-efficient) to
1e-2 and bf16 to 2e-2 of the logged losses (the adapters are not compared there: Adam's first steps are the
gradient's sign, which the two layouts' rounding flips for the entries near zero, so single entries differ by whole
steps).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("jinja2")
safetensors = pytest.importorskip("safetensors.torch")

from tests.helpers import cli as C  # noqa: E402
from tests.helpers import dist_helpers as H  # noqa: E402
from tests.helpers.chat import chat_messages  # noqa: E402
from tests.helpers.hf_llama import CHAT_TEMPLATE, make_hf  # noqa: E402
from toolkit.distributed.compile import BACKEND_ENV  # noqa: E402

TARGETS = "q_proj,v_proj,down_proj"
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", TARGETS]
ADAPTED = [f"layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
FSDP2 = ["--distributed-world-size", "2", "--ddp-backend", "fully_sharded"]
HARNESS_TASKS = os.path.join(C.REPO_ROOT, "tests", "harness_tasks")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """(root, the options the import says to fine-tune it with): hf/, imp/ (the import) and bin/ (the chats)."""
    root = tmp_path_factory.mktemp("lora")
    make_hf(str(root / "hf"), "llama", chat_template=CHAT_TEMPLATE)
    run = C.run_cli("toolkit_cli.export", ["--from", "hf", "--path", str(root / "hf"), "--out", str(root / "imp")])
    assert run.returncode == 0, run.stderr[-2000:]
    options = re.search(r"fine-tune with: toolkit-train DATA (.*)$", run.stdout + run.stderr, re.M).group(1).split()
    records = root / "chats.jsonl"
    records.write_text("".join(json.dumps({"messages": chat_messages(k)}) + "\n" for k in range(28)))
    argv = ["--chat-template", str(root / "imp"), "--trainpref", str(records), "--validpref", str(records)]
    argv += ["--destdir", str(root / "bin")]  # 28 conversations packed into 12 samples: 6 batches of 2 an epoch
    run = C.run_cli("toolkit_cli.preprocess", argv)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return root, options


def fine_tune(chat, save_dir, *extra, env=None):
    root, options = chat
    argv = [str(root / "bin"), "--task", "sft", *options, *LORA, "--optimizer", "adam", "--lr", "0.01"]
    argv += ["--batch-size", "2", "--required-batch-size-multiple", "1", "--cpu"]
    argv += ["--num-workers", "0", "--log-format", "json", "--log-interval", "1", "--disable-validation"]
    argv += ["--no-epoch-checkpoints", "--save-dir", str(save_dir), *extra]
    run = H.run_train(argv, env=env, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def export(path, out, fmt):
    run = C.run_cli("toolkit_cli.export", ["--path", str(path), "--format", fmt, "--out", str(out)])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout + run.stderr


def checkpoint(save_dir):
    return torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def trained(chat, tmp_path_factory):
    """The fine-tuned run (2 epochs of 3 updates) and its two exports."""
    root, _ = chat
    out = tmp_path_factory.mktemp("trained")
    start = ["--finetune-from-model", str(root / "imp" / "model.pt")]
    run = fine_tune(chat, out / "run", *start, "--max-update", "6", "--update-freq", "2")
    logs = {fmt: export(out / "run" / "checkpoint_last.pt", out / fmt, fmt) for fmt in ("peft", "hf")}
    return out, run.stdout, logs


def adapter_names(module: str):
    return [f"{module}.lora_A.weight", f"{module}.lora_B.weight"]


def test_only_the_adapters_train(chat, trained):
    root, _ = chat
    out, stdout, _ = trained
    saved, base = checkpoint(out / "run"), torch.load(root / "imp" / "model.pt", weights_only=True)["model"]
    adapters = [name for module in ADAPTED for name in adapter_names(module)]
    assert sorted(saved["model"]) == sorted([*base, *adapters])
    for name, tensor in base.items():  # frozen: the import's tensors, bit for bit
        assert torch.equal(saved["model"][name], tensor), name
    assert all(saved["model"][name].any() for name in adapters if ".lora_B." in name)  # B starts at zero
    assert sorted(saved["last_optimizer_state"]["state"]) == sorted(adapters)
    count = sum(saved["model"][name].numel() for name in adapters)
    assert f"(num. trained: {count})" in stdout and "LoRA: rank 4, alpha 8, dropout 0 on 6 Linear layers" in stdout
    epochs = [json.loads(m.group(1))["train_loss"] for m in re.finditer(r"\| train \| (\{.*\})\s*$", stdout, re.M)]
    assert len(epochs) == 2 and float(epochs[1]) < float(epochs[0]), (
        epochs
    )  # the second epoch's mean loss over the same conversations is lower


def test_peft_export_is_peft_layout(chat, trained):
    root, _ = chat
    out, _, logs = trained
    saved = checkpoint(out / "run")["model"]
    folder = out / "peft"
    assert sorted(os.listdir(folder)) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "base",
        "toolkit_export.json",
    ]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8)
    assert config["target_modules"] == sorted(TARGETS.split(",")) and config["bias"] == "none"
    assert config["base_model_name_or_path"] == str(folder / "base") and not config["fan_in_fan_out"]
    tensors = safetensors.load_file(str(folder / "adapter_model.safetensors"))
    want = {f"base_model.model.model.{n}": saved[n] for m in ADAPTED for n in adapter_names(m)}
    assert sorted(tensors) == sorted(want)
    for name, tensor in want.items():  # lora_A [r, in], lora_B [out, r]: ours as they are
        assert torch.equal(tensors[name], tensor), name
    original = safetensors.load_file(str(root / "hf" / "model.safetensors"))
    base = safetensors.load_file(str(folder / "base" / "model.safetensors"))
    assert sorted(base) == sorted(original)
    for name, tensor in original.items():  # the base is the transformers folder the run started from
        torch.testing.assert_close(base[name], tensor, rtol=0, atol=0, msg=name)
    assert "peft loads the adapters onto base/; max |logits diff|" in logs["peft"]


def test_peft_on_the_original_model_gives_the_toolkits_log_probs_as_the_merged_export(chat, trained):
    peft = pytest.importorskip("peft")
    import transformers

    root, _ = chat
    out, _, _ = trained
    original = transformers.AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()
    tokens = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = original(tokens).logits
        adapted = peft.PeftModel.from_pretrained(original, str(out / "peft")).eval()(tokens).logits
        merged_model = transformers.AutoModelForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32)
        merged = merged_model.eval()(tokens).logits
    from toolkit.inference import load_model

    ours, _, _ = load_model(str(out / "run" / "checkpoint_last.pt"))  # the adapters merged as evaluation reads them
    with torch.no_grad():
        toolkit = torch.log_softmax(ours(tokens), -1)
    torch.testing.assert_close(torch.log_softmax(adapted, -1), toolkit, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-4)
    assert (adapted - base).abs().max() > 1e-2  # the adapters change what the model computes


def test_resume_is_exact(chat, tmp_path):
    root, _ = chat
    start = ["--finetune-from-model", str(root / "imp" / "model.pt"), "--lora-dropout", "0.1"]
    whole = fine_tune(chat, tmp_path / "whole", *start, "--max-update", "4")
    fine_tune(chat, tmp_path / "cut", *start, "--max-update", "2")
    resumed = fine_tune(chat, tmp_path / "cut", *start, "--max-update", "4")
    assert "loaded checkpoint" in resumed.stdout
    assert H.losses(resumed.stdout) == {u: v for u, v in H.losses(whole.stdout).items() if u > 2}
    a, b = checkpoint(tmp_path / "whole")["model"], checkpoint(tmp_path / "cut")["model"]
    for name in a:
        assert torch.equal(a[name], b[name]), name


MUON = ["--optimizer", "muon", "--lr", "0.05", "--weight-decay", "0.01"]  # every adapter is a matrix: Muon's
EMA = ["--store-ema", "--ema-decay", "0.5", "--ema-fp32"]
CASES = {  # both layouts' flags; only the two ranks'; the tolerance of the losses and of the adapters
    "plain": ([], [], 1e-3),
    "compile_ac_mask": (["--document-attention-mask"], ["--compile", "--checkpoint-activations"], 1e-3),
    "hsdp_muon_ema": ([*MUON, *EMA], ["--sharding-strategy", "hybrid_shard", "--shard-group-size", "1"], 1e-3),
    "offload_fp16": (["--optimizer", "cpu_adam", "--fp16"], ["--cpu-offload"], 1e-2),
    "mefp16": (["--memory-efficient-fp16"], [], 1e-2),
    "bf16": (["--bf16"], [], 2e-2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_fsdp_ranks_equal_one_process(chat, tmp_path, case):
    root, _ = chat
    shared, sharded_only, rel = CASES[case]
    start = ["--finetune-from-model", str(root / "imp" / "model.pt"), "--max-update", "4", *shared]
    env = {BACKEND_ENV: "aot_eager"} if "--compile" in sharded_only else None
    one = fine_tune(chat, tmp_path / "one", *start, "--update-freq", "2")
    two = fine_tune(chat, tmp_path / "two", *start, *FSDP2, *sharded_only, env=env)
    if "--compile" in sharded_only:
        assert "--compile: torch.compile (aot_eager, fullgraph) on each of the 2 blocks" in two.stdout
    got, want = H.losses(two.stdout), H.losses(one.stdout)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4], (got, want)
    for u in want:
        assert abs(got[u] - want[u]) <= rel * abs(want[u]) + H.LOGGED_TOL, (u, got[u], want[u])
    if rel > 1e-3:  # fp16 and bf16: the losses (Adam's first steps are the gradient's sign, module docstring)
        return
    a, b = checkpoint(tmp_path / "two")["model"], checkpoint(tmp_path / "one")["model"]
    for name in (n for m in ADAPTED for n in adapter_names(m)):
        torch.testing.assert_close(a[name], b[name], rtol=rel, atol=1e-4, msg=name)


def test_eval_harness_chat_template_scores_as_lm_eval_hf_with_peft(chat, peft_imported):
    """``toolkit-eval-harness --apply-chat-template`` on the PEFT import against ``lm_eval --model hf
    --model_args peft=... --apply_chat_template`` (few-shot as turns, the task's description as the system turn):
    the same rendered contexts and per-request log-likelihoods to 1e-4."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from toolkit.evaluation.harness import ToolkitLM
    from toolkit.evaluation.harness_main import evaluate

    root, _ = chat
    folder, _, _ = peft_imported
    tasks, manager = ["toolkit_words_chat"], TaskManager(include_path=HARNESS_TASKS, include_defaults=False)
    ours = ToolkitLM(path=str(folder / "model.pt"), batch_size=8, device="cpu")
    got = evaluate(ours, tasks, manager, num_fewshot=2, log_samples=True, chat=True)
    hf = HFLM(pretrained=str(root / "hf"), peft=str(root / "adapter"), batch_size=8, device="cpu")
    seeds = dict(random_seed=1234, numpy_random_seed=1234, torch_random_seed=1234, fewshot_random_seed=1234)
    want = lm_eval.simple_evaluate(
        model=hf,
        tasks=tasks,
        task_manager=manager,
        num_fewshot=2,
        log_samples=True,
        bootstrap_iters=0,
        **seeds,
        apply_chat_template=True,
        fewshot_as_multiturn=True,
    )
    a, b = got["samples"]["toolkit_words_chat"], want["samples"]["toolkit_words_chat"]
    assert len(a) == len(b) == 12
    assert a[0]["arguments"][0][0].startswith("<s>system w1 w2 </s> user ")  # the template's rendering
    for x, y in zip(a, b):
        assert x["arguments"] == y["arguments"]
        for (p, _), (q, _) in zip((r[0] for r in x["resps"]), (r[0] for r in y["resps"])):
            assert abs(p - q) < 1e-4, (p, q)


def test_interactive_chat_renders_the_conversation_with_the_template(chat, peft_imported):
    """``toolkit-interactive --chat-template``: each line a user turn; the second prompt is transformers'
    ``apply_chat_template`` of the conversation so far (the first reply as the assistant's turn); the hub's
    ``chat`` gives the same first reply."""
    import io

    import transformers

    from toolkit.config.commands import GenerationConfig, InteractiveConfig
    from toolkit.inference.generate import interactive_main

    root, _ = chat
    folder, _, _ = peft_imported
    cfg = InteractiveConfig(data=str(folder), path=str(folder / "model.pt"), cpu=True, chat_template=str(folder))
    out = io.StringIO()
    interactive_main(cfg, GenerationConfig(beam=1, max_len_b=24), stdin=io.StringIO("w1 w2 w3\nw4 w5\n"), out=out)
    lines = dict(line.split("\t", 1) for line in out.getvalue().splitlines() if line[:2] in ("S-", "D-"))
    reply = lines["D-0"].split("\t", 1)[1][len(lines["S-0"]) :].strip()
    history = [{"role": "user", "content": "w1 w2 w3"}, {"role": "assistant", "content": reply}]
    history.append({"role": "user", "content": "w4 w5"})
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(root / "hf"))
    want = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert lines["S-1"] == tokenizer.decode(want[1:], skip_special_tokens=True) and reply
    from toolkit.inference.hub_utils import from_pretrained

    hub = from_pretrained(str(folder), "model.pt")
    assert hub.chat(history[:1], max_len_b=24) == reply


def test_tensor_parallel_ranks_equal_one_process(chat, tmp_path):
    """2 ranks tp 2 (sequence parallel): q/v column-parallel (lora_B split by rows), down row-parallel (lora_A
    split by columns, its partial products reduced with the base's), against one process, fp32 to 1e-3."""
    root, _ = chat
    start = ["--finetune-from-model", str(root / "imp" / "model.pt"), "--max-update", "3"]
    one = fine_tune(chat, tmp_path / "one", *start)
    two = fine_tune(chat, tmp_path / "two", *start, "--distributed-world-size", "2", "--model-parallel-size", "2")
    got, want = H.losses(two.stdout), H.losses(one.stdout)
    assert sorted(got) == sorted(want) == [1, 2, 3], (got, want)
    for u in want:
        assert abs(got[u] - want[u]) <= 1e-3 * abs(want[u]) + H.LOGGED_TOL, (u, got[u], want[u])
    a, b = checkpoint(tmp_path / "two")["model"], checkpoint(tmp_path / "one")["model"]
    assert sorted(a) == sorted(b)
    for name in b:  # the base frozen on both, the adapters trained alike
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-4, msg=name)
    assert all(b[name].any() for name in b if ".lora_B." in name)  # trained: B starts at zero


def test_bad_lora_input_is_one_line(chat, tmp_path):
    root, options = chat
    argv = [str(root / "bin"), "--task", "sft", *options, "--lora-rank", "4", "--lora-targets", "q_proj,nope"]
    run = H.run_train([*argv, "--cpu", "--save-dir", str(tmp_path / "s"), "--max-update", "1"])
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr[-2000:]
    assert lines[0].startswith("toolkit-train: error: --lora-targets q_proj,nope: nope names no Linear layer")
    args = ["--path", str(root / "imp" / "model.pt"), "--format", "peft", "--out", str(tmp_path / "peft")]
    run = C.run_cli("toolkit_cli.export", args)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1 and not os.path.exists(tmp_path / "peft"), run.stderr[-2000:]
    assert "--format peft: " in lines[0] and "trained without --lora-rank" in lines[0]


@pytest.fixture(scope="module")
def peft_imported(chat):
    """A random PEFT adapter (rsLoRA, B not zero) saved by peft on the original folder, imported with --from peft:
    (the import's folder, peft's model, the --lora-* flags its log gives)."""
    peft = pytest.importorskip("peft")
    import transformers

    root, _ = chat
    original = transformers.AutoModelForCausalLM.from_pretrained(str(root / "hf"), dtype=torch.float32)
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4, lora_alpha=6, lora_dropout=0.05, target_modules=["q_proj", "o_proj", "gate_proj"], use_rslora=True
    )
    config.init_lora_weights = False  # random lora_B: the adapter changes what the model computes
    model = peft.get_peft_model(original, config)
    model.save_pretrained(str(root / "adapter"))
    args = ["--from", "peft", "--path", str(root / "adapter"), "--base", str(root / "hf"), "--out", str(root / "pimp")]
    run = C.run_cli("toolkit_cli.export", args)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    flags = re.search(r"fine-tune with: .*--finetune-from-model \S+ (--lora-rank .*)$", run.stdout + run.stderr, re.M)
    return root / "pimp", model.eval(), flags.group(1).split()


def test_peft_adapter_imports_with_peft_log_probs(peft_imported):
    folder, theirs, flags = peft_imported
    assert flags == ["--lora-rank", "4", "--lora-alpha", "12.0", "--lora-dropout", "0.05"] + [
        "--lora-targets",
        "gate_proj,o_proj,q_proj",
    ]  # rsLoRA's alpha / sqrt(r) as alpha' / r
    from toolkit.inference import load_model

    ours, _, _ = load_model(str(folder / "model.pt"))
    tokens = torch.randint(3, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = torch.log_softmax(theirs(tokens).logits, -1), torch.log_softmax(ours(tokens), -1)
        with theirs.disable_adapter():
            base = torch.log_softmax(theirs(tokens).logits, -1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (want - base).abs().max() > 1e-1  # the adapter changes what the model computes


def test_imported_adapter_continues_or_merges(chat, peft_imported, tmp_path):
    """With its --lora-* flags the run continues the imported adapters; without --lora-rank it merges them and
    trains the whole model: the same model, so the same first loss."""
    folder, _, flags = peft_imported
    start = ["--finetune-from-model", str(folder / "model.pt"), "--max-update", "1"]
    lora = fine_tune(chat, tmp_path / "lora", *start, *flags, "--lora-dropout", "0")
    assert f"--finetune-from-model {folder / 'model.pt'}: continues its 6 LoRA adapters" in lora.stdout
    root, options = chat
    argv = [str(root / "bin"), "--task", "sft", *options, *start, "--optimizer", "adam", "--lr", "0.01", "--cpu"]
    argv += ["--batch-size", "2", "--required-batch-size-multiple", "1", "--num-workers", "0", "--log-interval", "1"]
    argv += ["--log-format", "json", "--disable-validation", "--save-dir", str(tmp_path / "whole")]
    whole = H.run_train(argv, timeout=400)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    assert "merged its 6 LoRA adapters (r 4) into the weights they adapt" in whole.stdout
    assert H.losses(whole.stdout)[1] == H.losses(lora.stdout)[1]
    imported, saved = (
        torch.load(folder / "model.pt", weights_only=True)["model"],
        checkpoint(tmp_path / "lora")["model"],
    )
    assert sorted(saved) == sorted(imported)
    for name, tensor in imported.items():  # the base frozen, the adapters trained from the imported ones
        assert torch.equal(saved[name], tensor) != (".lora_" in name), name
