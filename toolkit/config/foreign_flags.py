"""Flags people bring from other tools, and what each is called here.

A researcher coming from Hugging Face's ``Trainer``, Megatron-LM, torchtitan, nanoGPT or litgpt types the flag
their fingers know (``--max-steps``, ``--gradient-accumulation-steps``, ``--seq-len``); argparse's bare
"unrecognized arguments" leaves them to search the help. ``explain_unrecognized`` turns that message into one
line naming this toolkit's flag for each foreign one (and the spelling for ``--snake_case`` and near misses),
offering only flags that the command in question has. Torch-free: it runs before anything heavy is imported.
"""

from __future__ import annotations

import difflib
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# foreign flag -> (our flag, a note: how it maps, or the whole spelling when it starts with our flag; "" for a rename)
FOREIGN: Dict[str, Tuple[str, str]] = {
    # how long to train
    "--max-steps": ("--max-update", ""),
    "--train-iters": ("--max-update", ""),
    "--max-iters": ("--max-update", ""),
    "--training-steps": ("--max-update", ""),
    "--num-train-epochs": ("--max-epoch", ""),
    "--epochs": ("--max-epoch", ""),
    # batch shape
    "--gradient-accumulation-steps": ("--update-freq", ""),
    "--grad-accum": ("--update-freq", ""),
    "--gradient-accumulation-iters": ("--update-freq", ""),
    "--seq-len": ("--tokens-per-sample", ""),
    "--seq-length": ("--tokens-per-sample", ""),
    "--max-seq-len": ("--tokens-per-sample", ""),
    "--max-seq-length": ("--tokens-per-sample", ""),
    "--block-size": ("--tokens-per-sample", ""),
    "--context-length": ("--tokens-per-sample", ""),
    "--micro-batch-size": ("--batch-size", "sequences per rank and step; or --max-tokens for tokens"),
    "--per-device-train-batch-size": ("--batch-size", "sequences per rank and step; or --max-tokens for tokens"),
    "--global-batch-size": ("--batch-size", "global batch = --batch-size x ranks x --update-freq"),
    # optimization
    "--learning-rate": ("--lr", ""),
    "--warmup-steps": ("--warmup-updates", ""),
    "--lr-warmup-iters": ("--warmup-updates", ""),
    "--lr-warmup-steps": ("--warmup-updates", ""),
    "--max-grad-norm": ("--clip-norm", ""),
    "--clip-grad": ("--clip-norm", ""),
    "--grad-clip": ("--clip-norm", ""),
    "--lr-decay-style": ("--lr-scheduler", ""),
    "--z-loss": ("--z-loss-coef", "--moe-z-loss-coef is the router's z-loss"),
    "--z-loss-weight": ("--z-loss-coef", ""),
    "--aux-loss-coef": ("--moe-aux-loss-coef", ""),
    "--router-aux-loss-coef": ("--moe-aux-loss-coef", ""),
    # parallelism and memory
    "--ep": ("--expert-parallel-size", ""),
    "--expert-model-parallel-size": ("--expert-parallel-size", ""),
    "--tp": ("--model-parallel-size", ""),
    "--tensor-parallel-size": ("--model-parallel-size", ""),
    "--tensor-model-parallel-size": ("--model-parallel-size", ""),
    "--tensor-parallel-degree": ("--model-parallel-size", ""),
    "--cp": ("--context-parallel-size", ""),
    "--context-parallel-degree": ("--context-parallel-size", ""),
    "--data-parallel-shard-degree": ("--ddp-backend", "--ddp-backend fully_sharded shards over the data ranks"),
    "--pp": ("--pipeline-parallel-size", ""),
    "--pipeline-model-parallel-size": ("--pipeline-parallel-size", ""),
    "--pipeline-parallel-degree": ("--pipeline-parallel-size", ""),
    "--pipeline-model-parallel": (
        "--pipeline-parallel-size",
        "--pipeline-parallel-size N (fairseq's --pipeline-balance is the same flag here, one count per stage)",
    ),
    "--pipeline-chunks": ("--pipeline-microbatches", ""),
    "--num-microbatches": ("--pipeline-microbatches", ""),
    "--fsdp": ("--ddp-backend", "--ddp-backend fully_sharded"),
    "--deepspeed": ("--ddp-backend", "--ddp-backend fully_sharded --cpu-offload (DeepSpeed's CPU Adam)"),
    "--zero-stage": ("--ddp-backend", "--ddp-backend fully_sharded (--sharding-strategy shard_grad_op: ZeRO-2)"),
    "--gradient-checkpointing": ("--checkpoint-activations", ""),
    "--activation-checkpointing": ("--checkpoint-activations", ""),
    "--recompute-activations": ("--checkpoint-activations", ""),
    "--precision": ("--bf16", "--bf16 or --fp16 (fp32 is the default)"),
    "--mixed-precision": ("--bf16", "--bf16 or --fp16"),
    "--torch-compile": ("--compile", ""),
    # where things go
    "--output-dir": ("--save-dir", ""),
    "--save": ("--save-dir", ""),
    "--out-dir": ("--save-dir", ""),
    "--save-steps": ("--save-interval-updates", ""),
    "--checkpoint-interval": ("--save-interval-updates", ""),
    "--eval-steps": ("--validate-interval-updates", ""),
    "--eval-interval": ("--validate-interval-updates", ""),
    "--logging-steps": ("--log-interval", ""),
    "--resume-from-checkpoint": ("--restore-file", ""),
    "--load": ("--restore-file", ""),
    "--init-from": ("--finetune-from-model", ""),
    "--model-name-or-path": ("--finetune-from-model", "import the folder first: toolkit-export --from hf --path DIR"),
    "--report-to": ("--tensorboard-logdir", "--tensorboard-logdir DIR or --wandb-project NAME"),
    # model shape
    "--num-layers": ("--decoder-layers", ""),
    "--n-layer": ("--decoder-layers", ""),
    "--hidden-size": ("--decoder-embed-dim", ""),
    "--n-embd": ("--decoder-embed-dim", ""),
    "--num-attention-heads": ("--decoder-attention-heads", ""),
    "--n-head": ("--decoder-attention-heads", ""),
    "--ffn-hidden-size": ("--decoder-ffn-embed-dim", ""),
    "--intermediate-size": ("--decoder-ffn-embed-dim", ""),
    "--num-experts": ("--moe-num-experts", ""),
    "--moe-router-topk": ("--moe-top-k", ""),
    # generation
    "--top-k": ("--sampling-topk", "with --sampling"),
    "--top-p": ("--sampling-topp", "with --sampling"),
    "--do-sample": ("--sampling", ""),
    "--num-beams": ("--beam", ""),
}


def _unrecognized(message: str) -> Optional[List[str]]:
    prefix = "unrecognized arguments: "
    return message[len(prefix) :].split() if message.startswith(prefix) else None


def _suggestion(flag: str, known: Iterable[str]) -> Optional[str]:
    known = set(known)
    dashed = "--" + flag[2:].replace("_", "-")
    foreign = FOREIGN.get(dashed)
    if foreign is not None and foreign[0] in known:
        ours, note = foreign
        if note.startswith(ours):  # the note is the whole spelling (a flag with its value)
            return f"{flag}: use {note} here"
        return f"{flag}: use {ours} here" + (f" ({note})" if note else "")
    if dashed != flag and dashed in known:
        return f"{flag}: use {dashed} here"
    close = difflib.get_close_matches(dashed, sorted(k for k in known if k.startswith("--")), n=1, cutoff=0.8)
    if close:
        return f"{flag}: did you mean {close[0]}?"
    return None


def explain_unrecognized(message: str, known: Sequence[str]) -> str:
    """argparse's "unrecognized arguments: ..." with, for each flag this module knows another name of, what it is
    called here; any other message unchanged. ``known`` is the option strings of the parser that refused them."""
    args = _unrecognized(message)
    if not args:
        return message
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    hints = [hint for hint in (_suggestion(flag, known) for flag in flags) if hint]
    if not hints:
        return message
    return f"{message} ({'; '.join(hints)})"
