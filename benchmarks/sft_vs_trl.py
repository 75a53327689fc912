"""Chat SFT with LoRA against TRL's ``SFTTrainer`` with peft on CPU: the same first loss, and the training-step time.

    pip install trl          # the benchmark's optional extra (TRL 1.x); peft and transformers as for the toolkit
    python -m benchmarks.sft_vs_trl                       # 32 conversations a step, 8 steps, width 256, 4 layers
    python -m benchmarks.sft_vs_trl --hidden 512 --layers 8 --steps 12 --threads 2

One random transformers Llama with a chat template that marks its assistant turns (``{% generation %}``) and the
word-level tokenizer of ``tests/helpers/hf_llama.py``; ``--conversations`` conversations of those words (1 to 3
exchanges, a system turn in every other one). Both sides train LoRA (r 8, alpha 16, all-linear, no dropout, AdamW
lr 1e-3) on the assistant tokens only, every step on all the conversations:

- TRL: ``SFTTrainer(assistant_only_loss=True)``, ``per_device_train_batch_size`` = the conversations (padded
  rows), peft's ``LoraConfig``; its first loss is ``compute_loss`` on its first batch, a step's time is from
  ``on_step_begin`` to ``on_step_end``.
- toolkit: ``toolkit-export --from hf``, ``toolkit-preprocess --chat-template``, ``toolkit-validate --task sft``
  (the first loss: the model before any update on the same tokens), ``toolkit-train --task sft --lora-rank 8``
  with the conversations packed into samples with document masks, one update an epoch; a step's wall time is
  1 / the logged ``ups`` of each update, its CPU time the run's CPU seconds less a one-update run's, per update.

Wall times are medians over the steps after the first; the speed-up is of CPU seconds a step (all threads),
which a shared machine's load moves less. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

from benchmarks.timing import REPO, cpu_now, median, now

LORA = {"r": 8, "alpha": 16, "lr": 1e-3}


def build_model(folder: str, hidden: int, layers: int):
    import torch
    import transformers

    from tests.helpers.hf_llama import CHAT_TEMPLATE, save_tokenizer

    torch.manual_seed(0)
    ids = save_tokenizer(folder, "llama", CHAT_TEMPLATE)
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 2),
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **ids,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def conversations(n: int) -> List[List[Dict[str, str]]]:
    from tests.helpers.chat import chat_messages

    return [chat_messages(k) for k in range(n)]


def run_trl(hf: str, chats, steps: int, out: str) -> Dict[str, float]:
    import datasets
    import peft
    import torch
    import transformers
    import trl

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    config = trl.SFTConfig(
        output_dir=out,
        assistant_only_loss=True,
        per_device_train_batch_size=len(chats),
        max_steps=steps,
        learning_rate=LORA["lr"],
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        max_length=256,
        seed=1,
    )
    lora = peft.LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules="all-linear", lora_dropout=0.0)
    data = datasets.Dataset.from_list([{"messages": m} for m in chats])
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer, peft_config=lora)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        first = float(trainer.compute_loss(trainer.model, batch))
    times: List[Tuple[float, float]] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *_args, **_kwargs):
            self.start = (now(), cpu_now())

        def on_step_end(self, *_args, **_kwargs):
            times.append((now() - self.start[0], cpu_now() - self.start[1]))

    trainer.add_callback(StepTimer())
    trainer.train()
    wall, cpu = zip(*times[1:])
    return {
        "first_loss": first,
        "step_s": median(wall),
        "step_cpu_s": sum(cpu) / len(cpu),
        "steps": len(times),
    }


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cli(module: str, argv: List[str], env: Dict[str, str]) -> Tuple[str, float]:
    """The command's log and the CPU seconds it used (all its threads)."""
    before = _children_cpu()
    run = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env, cwd=REPO)
    if run.returncode != 0:
        raise SystemExit(f"{module} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return run.stdout + run.stderr, _children_cpu() - before


def run_toolkit(root: str, chats, steps: int, env: Dict[str, str]) -> Dict[str, float]:
    imp, data = os.path.join(root, "imp"), os.path.join(root, "bin")
    log, _ = _cli("toolkit_cli.export", ["--from", "hf", "--path", os.path.join(root, "hf"), "--out", imp], env)
    flags = re.search(r"fine-tune with: toolkit-train DATA (.*)$", log, re.M).group(1).split()
    records = os.path.join(root, "chats.jsonl")
    with open(records, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": m}) + "\n" for m in chats)
    argv = ["--chat-template", imp, "--trainpref", records, "--validpref", records, "--destdir", data]
    _cli("toolkit_cli.preprocess", argv, env)
    first = _first_loss(data, os.path.join(imp, "model.pt"))
    lora = ["--lora-rank", str(LORA["r"]), "--lora-alpha", str(LORA["alpha"]), "--lora-targets", "all-linear"]
    argv = [data, "--task", "sft", *flags, *lora, "--optimizer", "adam", "--lr", str(LORA["lr"]), "--cpu"]
    argv += ["--batch-size", "1024", "--required-batch-size-multiple", "1", "--num-workers", "0", "--no-save"]
    argv += ["--log-format", "json", "--log-interval", "1", "--disable-validation"]
    _, one_step = _cli("toolkit_cli.train", [*argv, "--max-update", "1"], env)
    log, all_steps = _cli("toolkit_cli.train", [*argv, "--max-update", str(steps)], env)
    ups = [float(json.loads(m.group(1))["ups"]) for m in re.finditer(r"\| train_inner \| (\{.*\})\s*$", log, re.M)]
    times = [1.0 / u for u in ups[1:] if u > 0]
    cpu = (all_steps - one_step) / (steps - 1)  # the same start and first step, without them
    return {"first_loss": first, "step_s": median(times), "step_cpu_s": cpu, "steps": len(ups)}


def _first_loss(data: str, checkpoint: str) -> float:
    """The mean loss (nats) over the assistant tokens of the training conversations, before any update."""
    from toolkit.config.commands import ValidateConfig
    from toolkit.train.validate import main as validate

    sums = validate(ValidateConfig(data=data, path=checkpoint, task="sft", cpu=True, valid_subset="train"))
    sums = sums["train"]["_sums"]
    return sums["loss"] / sums["sample_size"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("benchmarks.sft_vs_trl: error: TRL is not installed; pip install trl") from None
    import torch

    torch.set_num_threads(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    chats = conversations(args.conversations)
    with tempfile.TemporaryDirectory() as root:
        build_model(os.path.join(root, "hf"), args.hidden, args.layers)
        ours = run_toolkit(root, chats, args.steps, env)
        theirs = run_trl(os.path.join(root, "hf"), chats, args.steps, os.path.join(root, "trl"))
    gap = abs(ours["first_loss"] - theirs["first_loss"])
    speedup = theirs["step_cpu_s"] / ours["step_cpu_s"]
    print(f"{'':10} {'first loss':>12} {'step wall (ms)':>15} {'step CPU (ms)':>14}")
    for name, side in (("toolkit", ours), ("TRL", theirs)):
        print(f"{name:10} {side['first_loss']:12.6f} {1000 * side['step_s']:15.1f} {1000 * side['step_cpu_s']:14.1f}")
    print(
        f"first-loss gap {gap:.2e} (relative {gap / theirs['first_loss']:.2e}); toolkit {speedup:.2f}x TRL's steps "
        f"(CPU seconds a step: steady on a shared machine; wall {theirs['step_s'] / ours['step_s']:.2f}x)"
    )
    result = {"args": vars(args), "toolkit": ours, "trl": theirs, "first_loss_gap": gap, "cpu_speedup": speedup}
    print(json.dumps(result))
    if not math.isfinite(gap):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
