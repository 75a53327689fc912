"""toolkit-eval-lm: perplexity of trained language models on a data-bin split.

    toolkit-eval-lm data-bin/wikitext-103 --path checkpoints/checkpoint_best.pt \
        --context-window 384 --tokens-per-sample 128
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

from toolkit import inference, options
from toolkit.config import opt
from toolkit.data.indexed_dataset import MMapIndexedDataset
from toolkit.errors import UserError
from toolkit.logging.setup import setup_logging

logger = logging.getLogger("toolkit_cli.eval_lm")


@dataclass
class EvalLMConfig:
    data: str = opt(None, "the data-bin folder", positional=True)
    path: Optional[str] = opt(None, "checkpoint to evaluate; several joined by ':' form an ensemble")
    gen_subset: str = opt("test", "data split to evaluate")
    context_window: int = opt(0, "earlier tokens given as context to each block (scored once each)")
    tokens_per_sample: Optional[int] = opt(None, "tokens scored per block (default: the training value)")
    max_tokens: Optional[int] = opt(None, "maximum tokens in a batch")
    batch_size: Optional[int] = opt(None, "number of blocks in a batch", aliases=("--max-sentences",))
    output_word_probs: bool = opt(False, "print each word's log-probability (base 2)")
    cpu: bool = opt(False, "evaluate on CPU even when a GPU is present")
    log_file: Optional[str] = opt(None, "also write the log to this file")


def main(cfg: EvalLMConfig) -> float:
    """Returns the perplexity (also printed, in fairseq's words)."""
    setup_logging(cfg.log_file)
    if cfg.path is None:
        raise UserError("--path is required: the checkpoint to evaluate")
    device = torch.device("cuda" if torch.cuda.is_available() and not cfg.cpu else "cpu")
    models, task, train_args = inference.load_ensemble(cfg.path, cfg.data, device)
    tokens_per_sample = cfg.tokens_per_sample or train_args.tokens_per_sample
    max_positions = models[0].max_positions()
    if tokens_per_sample + cfg.context_window > max_positions:
        raise UserError(f"--tokens-per-sample {tokens_per_sample} + --context-window {cfg.context_window} "
                        f"exceeds the model's {max_positions} positions; lower one of them")
    task.load_dataset(cfg.gen_subset)  # clear errors for a missing split
    split = MMapIndexedDataset(os.path.join(task.cfg.data.split(":")[0], cfg.gen_subset))
    stream = torch.from_numpy(split.tokens.astype("int64"))
    logger.info(f"num. model params: {sum(p.numel() for p in models[0].parameters()):,}")
    logger.info(f"{task.cfg.data} {cfg.gen_subset} {len(split)} examples, {len(stream)} tokens")

    start = time.time()
    log_probs = inference.score_stream(models, stream, task.dictionary.eos(), tokens_per_sample,
                                       cfg.context_window, cfg.max_tokens, cfg.batch_size, device)
    elapsed = time.time() - start
    if cfg.output_word_probs:
        print_word_probs(task.dictionary, stream, log_probs)
    avg_nll_base2 = -log_probs.mean().item() / math.log(2)
    ppl = 2 ** avg_nll_base2
    logger.info(f"Evaluated {len(stream):,} tokens in {elapsed:.1f}s ({len(stream) / max(elapsed, 1e-9):.2f} tokens/s)")
    logger.info(f"Loss (base 2): {avg_nll_base2:.4f}, Perplexity: {ppl:.2f}")
    return ppl


def print_word_probs(dictionary, stream: torch.Tensor, log_probs: torch.Tensor) -> None:
    """One line per sentence (ending at </s>), as fairseq's --output-word-probs."""
    words: List[str] = []
    for tok, lp in zip(stream.tolist(), log_probs.tolist()):
        words.append(f"{dictionary[tok]} [{lp / math.log(2):.2f}]")
        if tok == dictionary.eos():
            logger.info(" ".join(words))
            words = []
    if words:
        logger.info(" ".join(words))


def cli_main(argv: Optional[List[str]] = None) -> None:
    args = options.parse_with_components("toolkit-eval-lm", [EvalLMConfig], argv, selectors=(), arch=False,
                                         description="Evaluate a language model's perplexity.")
    try:
        main(options.config_from_args(EvalLMConfig, args))
    except UserError as e:
        print(f"toolkit-eval-lm: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
