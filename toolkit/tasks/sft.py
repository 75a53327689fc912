"""The ``sft`` task: supervised fine-tuning on a chat data-bin, the loss over the trained tokens only.

``DATA`` is a data-bin made by ``toolkit-preprocess --chat-template`` (each split's conversations and their
loss masks, :mod:`toolkit.data.sft_dataset`). Everything else is the language-modeling task's: the same
batching, resumable sample positions, ``--data-mixture``, validation, model and criterion. The trained tokens
reach the loss as the only non-pad targets, so ``cross_entropy`` (and its fused head) sums the loss over them,
``ntokens``/``sample_size`` count them, and the trainer divides the update's gradient by their number over
every micro-batch and data-parallel rank of the update: one process with ``--update-freq N`` and N ranks take
the same step whatever the number of trained tokens in each micro-batch.
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Any

from toolkit.config import options
from toolkit.config.components import SFT_BREAK_MODES, SFTConfig
from toolkit.core.errors import UserError
from toolkit.core.preflight import check_token_ids
from toolkit.core.registry import register_task
from toolkit.data import sft_dataset
from toolkit.data.concat_indexed import numbered_splits
from toolkit.data.sft_dataset import SFTDataset
from toolkit.tasks.language_modeling import LanguageModelingTask

logger = logging.getLogger(__name__)


def _sft_config(cfg: Any) -> SFTConfig:
    return cfg if isinstance(cfg, SFTConfig) else options.config_from_args(SFTConfig, cfg)


@register_task("sft", dataclass=SFTConfig)
class SFTTask(LanguageModelingTask):
    def __init__(self, cfg: SFTConfig, dictionary):
        cfg = _sft_config(cfg)
        super().__init__(cfg, dictionary)
        if cfg.sample_break_mode not in SFT_BREAK_MODES:
            raise UserError(
                f"--sample-break-mode {cfg.sample_break_mode}: --task sft keeps conversations whole; choose "
                f"{' or '.join(SFT_BREAK_MODES)} (several conversations a sample, or one each)"
            )
        if cfg.shorten_method == "random_crop":
            raise UserError(
                "--shorten-method random_crop: a conversation cropped at a random start loses its template's "
                "beginning; use --shorten-method truncate (keeps the first --tokens-per-sample positions) or none"
            )
        if cfg.add_bos_token:
            logger.info("--add-bos-token: not applied under --task sft (the chat template places BOS itself)")

    @classmethod
    def setup_task(cls, cfg: Any) -> SFTTask:
        return super().setup_task(_sft_config(cfg))

    def max_positions(self):
        return None if self.cfg.sample_break_mode == "eos" else self.cfg.tokens_per_sample

    def _load_split(self, data_path: str, split: str, combine: bool) -> SFTDataset:
        prefix = os.path.join(data_path, split)
        if not sft_dataset.exists(prefix):
            masks = glob.glob(os.path.join(glob.escape(data_path), f"*{sft_dataset.LOSS_MASK}.idx"))
            found = sorted(os.path.basename(p)[: -len(sft_dataset.LOSS_MASK) - 4] for p in masks)
            missing = f"{prefix}.bin/.idx" if not os.path.isfile(prefix + ".idx") else f"{prefix}.loss_mask.bin/.idx"
            raise UserError(
                f"{missing}: not found; chat splits in {data_path}: {', '.join(found) or 'none'} (--task sft reads "
                f"data-bins made by toolkit-preprocess --chat-template; choose with --train-subset/--valid-subset)"
            )
        names = numbered_splits(data_path, split) if combine else [split]
        prefixes = [os.path.join(data_path, name) for name in names]
        dataset = SFTDataset(
            prefixes,
            pad=self.dictionary.pad(),
            tokens_per_sample=self.cfg.tokens_per_sample,
            break_mode=self.cfg.sample_break_mode,
            truncate=self._truncates(split),
            document_mask=self.cfg.document_attention_mask,
            reset_positions=self.cfg.reset_position_ids,
        )
        for part in dataset.splits:
            check_token_ids(part.prefix, part.tokens, len(self.dictionary), os.path.join(data_path, "dict.txt"))
        logger.info(
            f"{data_path} {'+'.join(names)} {len(dataset.kept)} conversations, {len(dataset)} samples, "
            f"{dataset.trained_tokens()} trained tokens"
        )
        return dataset

    def _truncates(self, split: str) -> bool:
        from toolkit.data.shorten import applies_to

        return self.cfg.shorten_method == "truncate" and applies_to(split, self.cfg.shorten_data_split_list)
