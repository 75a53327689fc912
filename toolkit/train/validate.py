"""``toolkit-validate`` (fairseq-validate): a checkpoint's loss and perplexity on ``--valid-subset`` splits.

    toolkit-validate data-bin/wikitext-103 --path checkpoints/checkpoint_best.pt --valid-subset valid,test

The splits are batched as the trainer batches them (``--max-tokens-valid``/``--batch-size-valid``,
else the training values saved in the checkpoint; the same seed, ``--required-batch-size-multiple``
and skipping rules), scored by the checkpoint's criterion in eval mode, and summed and logged by
the training loop's own ``valid_totals``: the ``valid`` line equals the one the training run
printed for that checkpoint (a run on several ranks splits the batches, the sums are the same).
Any checkpoint evaluation reads (fairseq's, sharded folders, safetensors exports) is accepted.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any, Dict, List

import torch

from toolkit.config import options
from toolkit import ops
from toolkit.core import registry
from toolkit.core.errors import UserError
from toolkit.data.indexed_dataset import MMapIndexedDataset
from toolkit.distributed.parallel_dims import ParallelDims
from toolkit.inference.eval_lm_main import parse_overrides
from toolkit.evaluation.loading import load_for_eval
from toolkit.logging import metrics, progress_bar
from toolkit.logging.setup import setup_logging
from toolkit.train.train_loop import refuse_empty_split, valid_totals, weighted_valid_totals
from toolkit.train.trainer import forward_and_loss, move_to_device
from toolkit.config.commands import ValidateConfig  # noqa: F401  (torch-free for --help)

logger = logging.getLogger("toolkit_cli.validate")


class _Validator:
    """What ``train_loop.valid_totals`` asks of a Trainer, for one process and no optimizer."""

    def __init__(self, model: torch.nn.Module, criterion, device: torch.device):
        self.model, self.criterion, self.device = model, criterion, device
        self.strategy = SimpleNamespace(dims=ParallelDims.single())

    @torch.no_grad()
    def valid_step(self, sample: Dict[str, Any]) -> Dict[str, float]:
        sample = move_to_device(sample, self.device)
        _, sample_size, logging_output = forward_and_loss(self.model, self.criterion, sample)
        out = {k: float(v) for k, v in logging_output.items()}
        out["_sample_size"] = float(sample_size)
        return out


def _criterion(task, saved: Dict[str, Any]):
    entry = registry.CRITERION_REGISTRY.get(saved.get("criterion") or "cross_entropy")
    return entry.cls(task, options.config_from_args(entry.config, saved) if entry.config else None)


def _batches(task, saved: Dict[str, Any], cfg: ValidateConfig, subset: str, max_positions: int):
    """The subset's batches as ``train_loop.valid_iterator`` makes them on one replica."""
    task.load_dataset(subset)
    refuse_empty_split(subset, task.dataset(subset))
    max_tokens = cfg.max_tokens_valid or saved.get("max_tokens_valid") or saved.get("max_tokens")
    batch_size = cfg.batch_size_valid or saved.get("batch_size_valid") or saved.get("batch_size")
    return task.get_batch_iterator(
        task.dataset(subset),
        max_tokens=max_tokens,
        batch_size=batch_size,
        required_batch_size_multiple=saved.get("required_batch_size_multiple", 8),
        seed=saved.get("seed", 1),
        epoch=1,
        max_positions=max_positions,
        ignore_invalid_inputs=cfg.skip_invalid_size_inputs_valid_test,
    ).next_epoch_itr(shuffle=False)


def main(cfg: ValidateConfig) -> Dict[str, Dict[str, Any]]:
    """``{subset: stats}`` (fairseq's valid stats, also logged as the training run logs them)."""
    setup_logging(cfg.log_file)
    if cfg.path is None:
        raise UserError("--path is required: the checkpoint to validate")
    device = torch.device("cuda" if torch.cuda.is_available() and not cfg.cpu else "cpu")
    ops.select(cfg.cpu_matmul, device)
    overrides = parse_overrides(cfg.model_overrides)
    if cfg.task:
        overrides["task"] = cfg.task
    model, task, args = load_for_eval(cfg.path, cfg.data or None, device, overrides)
    saved = vars(args)
    validator = _Validator(model, _criterion(task, saved), device)
    max_positions = min(task.max_positions(), model.max_positions())
    results = {}
    for subset in _subsets(task, [s for s in cfg.valid_subset.split(",") if s]):
        logger.info(f'begin validation on "{subset}" subset')
        progress = progress_bar.progress_bar(
            _batches(task, saved, cfg, subset, max_positions),
            log_format=cfg.log_format,
            log_interval=cfg.log_interval,
            prefix=f"valid on '{subset}' subset",
            default_log_format="simple" if cfg.no_progress_bar else "tqdm",
        )
        with metrics.aggregate(new_root=True) as agg:
            sums = valid_totals(validator, progress)
        stats = agg.get_smoothed_values()
        progress.print(stats, tag=subset)
        results[subset] = dict(stats, _sums=sums)  # the printed values are rounded; the sums are not
    mixture = getattr(task, "mixture", None)
    if mixture:  # the run's `valid` line: the same function over the same per-source values
        for tag, values in weighted_valid_totals(mixture, results, "loss").items():
            progress_bar.progress_bar(
                [],
                log_format=cfg.log_format,
                prefix=f"valid on '{tag}' subset",
                default_log_format="simple" if cfg.no_progress_bar else "tqdm",
            ).print(values, tag=tag)
            results[tag] = values
    return results


def _subsets(task, names: List[str]) -> List[str]:
    """A --data-mixture checkpoint is validated as its run validated: each split per source (X_NAME, for the
    sources that have X), then their weighted total (a draw from the mixed split would give another number
    than the `valid` that --best-checkpoint-metric followed)."""
    mixture = getattr(task, "mixture", None)
    if not mixture:
        return names
    return [
        f"{name}_{source.name}"
        for name in names
        for source in mixture
        if MMapIndexedDataset.exists(os.path.join(source.path, name))
    ]
