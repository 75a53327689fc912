"""toolkit-eval-lm's options (fairseq-eval-lm's names and meanings) and its main loop.

The command line module only parses these options and calls :func:`main`. The
arithmetic lives in :mod:`toolkit.inference.eval_lm`.
"""

from __future__ import annotations

import ast
import logging
import time
from typing import Any, Dict, List

import torch

from toolkit.inference import eval_lm as E
from toolkit import inference
from toolkit import ops
from toolkit.core.errors import UserError
from toolkit.logging import progress_bar
from toolkit.logging.setup import setup_logging
from toolkit.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask, bos_as_context
from toolkit.config.commands import EvalLMConfig  # noqa: F401  (torch-free for --help)

logger = logging.getLogger("toolkit_cli.eval_lm")


_NO_EFFECT = {
    "criterion": "eval-lm scores with the model's log-probabilities whatever the criterion",
    "max_target_positions": "the model's positions come from the checkpoint (use --model-overrides)",
    "skip_invalid_size_inputs_valid_test": "eval-lm always skips blocks longer than the model's positions",
    "num_workers": "batches are built in this process",
    "quiet": "eval-lm prints only its final scores and the outputs asked for",
    "results_path": "fairseq-eval-lm writes no results file either",
    "required_batch_size_multiple": "fairseq-eval-lm's batches do not apply it either (same batches, same sums)",
    "distributed_world_size": "eval-lm runs in one process here (one device evaluates the whole model)",
    "model_parallel_size": "the model is loaded whole and evaluated in one process",
}
_DEFAULTS = {
    "criterion": None,
    "max_target_positions": None,
    "skip_invalid_size_inputs_valid_test": False,
    "num_workers": 1,
    "quiet": False,
    "results_path": None,
    "required_batch_size_multiple": 8,
    "distributed_world_size": 1,
    "model_parallel_size": 1,
}


def announce_ignored(cfg: EvalLMConfig) -> None:
    for name, why in _NO_EFFECT.items():
        if getattr(cfg, name) != _DEFAULTS[name]:
            logger.info(f"--{name.replace('_', '-')} accepted for fairseq compatibility, no effect: {why}")


def parse_overrides(text: str) -> Dict[str, Any]:
    try:
        value = ast.literal_eval(text or "{}")
    except (ValueError, SyntaxError):
        value = None
    if not isinstance(value, dict):
        raise UserError(f"--model-overrides: {text!r} is not a Python dict literal, e.g. \"{{'dropout': 0.0}}\"")
    return value


def check_options(cfg: EvalLMConfig, tokens_per_sample: int) -> None:
    if cfg.task != "language_modeling":
        raise UserError(f"--task {cfg.task}: eval-lm evaluates language_modeling models only")
    if cfg.context_window < 0:
        raise UserError(f"--context-window must be >= 0, got {cfg.context_window}")
    if cfg.context_window > 0 and tokens_per_sample - cfg.context_window < 1:
        raise UserError(
            f"--context-window {cfg.context_window} must be smaller than --tokens-per-sample "
            f"{tokens_per_sample} (which counts the context, as in fairseq)"
        )
    if not 0 <= cfg.shard_id < max(cfg.num_shards, 1):
        raise UserError(f"--shard-id {cfg.shard_id} must be in [0, --num-shards {cfg.num_shards})")


def reads_bos_first(cfg: EvalLMConfig, dictionary, train_args) -> bool:
    """``--add-bos-token`` as the evaluation applies it: a model imported from Hugging Face whose tokenizer
    puts BOS first (the checkpoint's ``add_bos_token`` with the tokenizer's vocabulary) always reads BOS
    first, with or without the flag: without it every line would start from ``</s>``, which transformers
    never gives that model (see :func:`toolkit.tasks.language_modeling.bos_as_context`)."""
    imported = bos_as_context(bool(vars(train_args).get("add_bos_token")), dictionary)
    if imported and not cfg.add_bos_token:
        logger.info(
            "the model's tokenizer puts BOS first (imported with toolkit-export --from hf): each line "
            "starts from BOS, as in transformers (--add-bos-token implied)"
        )
    return cfg.add_bos_token or imported


def eval_task(
    cfg: EvalLMConfig, dictionary, data: str, tokens_per_sample: int, add_bos_token: bool = False
) -> LanguageModelingTask:
    """The task as fairseq-eval-lm sets it up: blocks of tokens_per_sample - context_window tokens."""
    block = tokens_per_sample - cfg.context_window if cfg.context_window > 0 else tokens_per_sample
    task_cfg = LanguageModelingConfig(
        data=data,
        sample_break_mode=cfg.sample_break_mode,
        tokens_per_sample=block,
        add_bos_token=cfg.add_bos_token or add_bos_token,
    )
    task = LanguageModelingTask(task_cfg, dictionary)
    task.load_dataset(cfg.gen_subset)
    return task


def main(cfg: EvalLMConfig) -> Dict[str, float]:
    """Returns ``{"loss", "perplexity", "count"}`` (also logged, in fairseq's words)."""
    setup_logging(cfg.log_file)
    if not cfg.data:
        raise UserError("DATA: the data-bin folder to evaluate is required (toolkit-eval-lm DATA --path ...)")
    if cfg.path is None:
        raise UserError("--path is required: the checkpoint to evaluate")
    announce_ignored(cfg)
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not cfg.cpu else "cpu")
    ops.select(cfg.cpu_matmul, device)
    models, train_task, train_args = inference.load_ensemble(
        cfg.path, cfg.data, device, parse_overrides(cfg.model_overrides)
    )
    tokens_per_sample = cfg.tokens_per_sample or train_args.tokens_per_sample
    check_options(cfg, tokens_per_sample)
    if cfg.fp16:
        models = [m.half() for m in models]
    logger.info(f"num. model params: {sum(p.numel() for p in models[0].parameters()):,}")
    task = eval_task(
        cfg,
        train_task.dictionary,
        train_task.cfg.data,
        tokens_per_sample,
        reads_bos_first(cfg, train_task.dictionary, train_args),
    )
    dataset = task.dataset(cfg.gen_subset)
    logger.info(f"{train_task.cfg.data} {cfg.gen_subset} {len(dataset):,} examples")
    return evaluate(cfg, models, task, dataset, device)


def evaluate(cfg: EvalLMConfig, models: List[torch.nn.Module], task, dataset, device) -> Dict[str, float]:
    dictionary, pad = task.dictionary, task.dictionary.pad()
    max_positions = min(m.max_positions() for m in models)
    batches = E.eval_batches(
        dataset,
        cfg.context_window,
        task.cfg.tokens_per_sample,
        pad,
        cfg.max_tokens,
        cfg.batch_size,
        max_positions,
        max(cfg.num_shards, 1),
        cfg.shard_id,
        cfg.seed,
    )
    progress = progress_bar.progress_bar(
        batches,
        log_format=cfg.log_format,
        log_interval=cfg.log_interval,
        default_log_format="simple" if cfg.no_progress_bar else "tqdm",
    )
    bpe = E.bpe_continuations(dictionary, cfg.post_process)
    totals, elapsed = E.Totals(), 0.0
    for sample in progress:
        if not sample:
            continue
        start = time.time()
        rows = E.score_sample(models, sample, pad, max_positions, cfg.softmax_batch, device)
        elapsed += time.time() - start
        E.check_finite(rows, cfg.gen_subset, cfg.path)
        totals.ntokens += int(sample["ntokens"])
        for line in E.accumulate(
            totals,
            dictionary,
            rows,
            bpe,
            task.cfg.add_bos_token and not dataset.bos_as_context,
            cfg.output_word_probs or cfg.output_word_stats,
            dataset.context_bos,
        ):
            if cfg.output_word_probs:
                logger.info(line)
        progress.log({"ntokens": totals.ntokens, "ppl": round(E.perplexity(totals)["perplexity"], 2)})
    E.check_counted(totals, cfg.gen_subset, task.cfg.data)
    rate = totals.ntokens / elapsed if elapsed > 0 else 0.0
    logger.info(f"Evaluated {totals.ntokens:,} tokens in {elapsed:.1f}s ({rate:.2f} tokens/s)")
    if cfg.output_word_stats:
        for stat in sorted(totals.word_stats.values(), key=lambda s: s.count, reverse=True):
            logger.info(str(stat))
    result = E.perplexity(totals)
    logger.info(f"Loss (base 2): {result['loss']:.4f}, Perplexity: {result['perplexity']:.2f}")
    return result
