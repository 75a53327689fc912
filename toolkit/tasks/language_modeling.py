"""The ``language_modeling`` task: a data-bin's splits as next-token prediction batches.

Same options and data semantics as fairseq's task of that name: ``DATA`` is a
folder made by ``toolkit-preprocess`` (``dict.txt`` + ``{split}.bin/.idx``); several
folders separated by ``:`` are used round-robin, one per epoch (the dictionary is
read from the first).
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Any, Dict, Optional

import numpy as np

from toolkit.config import options
from toolkit.core import registry
from toolkit.data.batching import batch_by_size, filter_by_size
from toolkit.data.concat_indexed import ConcatIndexedDataset, numbered_splits
from toolkit.data.dictionary import Dictionary
from toolkit.data.indexed_dataset import MMapIndexedDataset
from toolkit.data.iterators import EpochBatchIterator
from toolkit.data.lm_dataset import MonolingualDataset
from toolkit.data.mixture import MixtureDataset, parse_mixture
from toolkit.data.sample_position import Batching
from toolkit.data.shorten import SHORTEN_METHODS, ShortenedDataset, applies_to
from toolkit.data.token_block_dataset import BREAK_MODES, TokenBlockDataset
from toolkit.core.errors import UserError
from toolkit.core.preflight import check_token_ids
from toolkit.core.registry import CRITERION_REGISTRY, register_task
from toolkit.config.components import LanguageModelingConfig  # noqa: F401  (its options, torch-free for --help)

logger = logging.getLogger(__name__)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def _as_dict(cfg: Any) -> Dict[str, Any]:
    return dict(cfg) if isinstance(cfg, dict) else dict(vars(cfg))


def bos_as_context(add_bos_token: bool, dictionary) -> bool:
    """Whether ``--add-bos-token`` means transformers' BOS-first layout rather than fairseq's prepended ``<s>``.

    Why: a dictionary that is a tokenizer's vocabulary (``toolkit-export --from hf``) belongs to a model
    pretrained on ``[BOS] + text``; fairseq's layout gives it ``<s> </s> text`` and scores ``<s>``
    itself, which is neither what it was trained on nor what transformers computes. Then BOS takes the
    place of the ``</s>`` a line starts from (see :class:`toolkit.data.lm_dataset.MonolingualDataset`).
    """
    return bool(add_bos_token) and dictionary.fixed_ids and dictionary.bos() != dictionary.eos()


def prepends_bos(add_bos_token: bool, dictionary) -> bool:
    """Whether ``--add-bos-token`` makes every sample one token longer (fairseq's prepended ``<s>``), rather than
    reading BOS as context (:func:`bos_as_context`)."""
    return bool(add_bos_token) and not bos_as_context(add_bos_token, dictionary)


def document_bos(dictionary) -> Optional[int]:
    """The BOS a document may begin with in the data, read as its context (a tokenizer's vocabulary whose
    documents were binarized as ``AutoTokenizer`` encodes them, BOS first), whatever ``--add-bos-token`` says;
    None for fairseq's dictionaries, whose data never holds ``<s>``."""
    return dictionary.bos() if dictionary.fixed_ids and dictionary.bos() != dictionary.eos() else None


def _load_dictionary(data: str) -> Dictionary:
    dict_path = os.path.join(data, "dict.txt")
    if not os.path.isfile(dict_path):
        raise UserError(f"{dict_path}: not found; is {data} a data-bin made by toolkit-preprocess?")
    return Dictionary.load(dict_path)


def _mixture_dictionary(spec: str) -> Dictionary:
    """The one dictionary of every --data-mixture source (the same ids in each, checked)."""
    sources = parse_mixture(spec)
    dictionary = _load_dictionary(sources[0].path)
    for source in sources[1:]:
        if _load_dictionary(source.path) != dictionary:
            raise UserError(
                f"--data-mixture: {os.path.join(source.path, 'dict.txt')} differs from "
                f"{os.path.join(sources[0].path, 'dict.txt')}; the sources must share one dictionary "
                f"(binarize them with toolkit-preprocess --srcdict {sources[0].path}/dict.txt)"
            )
    logger.info(f"dictionary: {len(dictionary)} types (shared by the {len(sources)} sources of --data-mixture)")
    return dictionary


@register_task("language_modeling", dataclass=LanguageModelingConfig)
class LanguageModelingTask:
    def __init__(self, cfg: LanguageModelingConfig, dictionary: Dictionary):
        if not isinstance(cfg, LanguageModelingConfig):
            cfg = options.config_from_args(LanguageModelingConfig, cfg)
        if cfg.sample_break_mode not in BREAK_MODES:
            raise UserError(
                f"--sample-break-mode: unknown mode {cfg.sample_break_mode!r}; choose from {', '.join(BREAK_MODES)}"
            )
        if cfg.shorten_method not in SHORTEN_METHODS:
            raise UserError(
                f"--shorten-method: unknown method {cfg.shorten_method!r}; choose from {', '.join(SHORTEN_METHODS)}"
            )
        if cfg.mixture_epoch_samples < 0:
            raise UserError(
                f"--mixture-epoch-samples {cfg.mixture_epoch_samples}: must be >= 0 (0: all sources' samples together)"
            )
        if cfg.reset_position_ids and not cfg.document_attention_mask:
            raise UserError(
                "--reset-position-ids: restarts positions per document of a packed sample, which "
                "needs --document-attention-mask; add it"
            )
        if cfg.sample_break_mode != "eos" and cfg.tokens_per_sample < 1:
            raise UserError(f"--tokens-per-sample must be >= 1, got {cfg.tokens_per_sample}")
        self.cfg = cfg
        self.dictionary = dictionary
        self.datasets: Dict[str, MonolingualDataset] = {}
        self._loaded_from: Dict[str, str] = {}
        self._checked_splits: set = set()
        self.mixture = parse_mixture(cfg.data_mixture) if cfg.data_mixture else []

    @property
    def source_dictionary(self) -> Dictionary:
        return self.dictionary

    @property
    def target_dictionary(self) -> Dictionary:
        return self.dictionary

    def model_files_dir(self) -> str:
        """The folder holding the dictionary and the tokenizer the model reads text with: DATA's first folder,
        else the first ``--data-mixture`` source's (the sources share one dictionary), so a consumer finds the
        model's tokenizer whichever way the run read its data."""
        if self.cfg.data:
            return self.data_paths()[0]
        return self.mixture[0].path if self.mixture else ""

    def data_paths(self):
        if not self.cfg.data:
            raise UserError("DATA: no data-bin folder given; pass the folder made by toolkit-preprocess")
        return [p for p in self.cfg.data.split(":") if p]

    @classmethod
    def setup_task(cls, cfg: Any) -> LanguageModelingTask:
        if not isinstance(cfg, LanguageModelingConfig):
            cfg = options.config_from_args(LanguageModelingConfig, cfg)
        if cfg.data_mixture:
            if cfg.data:
                raise UserError(f"--data-mixture: also given DATA {cfg.data}; give one of them")
            return cls(cfg, _mixture_dictionary(cfg.data_mixture))
        if not cfg.data:
            raise UserError(
                "DATA: no data-bin folder given; pass the folder made by toolkit-preprocess (or --data-mixture)"
            )
        shards = [p for p in cfg.data.split(":") if p]
        missing = [p for p in shards if not os.path.isdir(p)]
        if missing:
            raise UserError(
                f"{missing[0]}: data shard not found (DATA is {cfg.data}); every ':'-separated "
                f"folder must be a data-bin made by toolkit-preprocess"
            )
        dictionary = _load_dictionary(shards[0])
        logger.info(f"dictionary: {len(dictionary)} types")
        return cls(cfg, dictionary)

    # --- data -----------------------------------------------------------------------
    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False, **kwargs: Any):
        """Load ``split`` from the data-bin of this epoch (round-robin over ``DATA``'s folders); with
        ``combine`` (fairseq's ``--combine-val``), ``split``, ``split1``, ``split2``, ... as one.
        With ``--data-mixture``: ``split`` of every source as the weighted mixture, and ``split_NAME``
        that split of source NAME alone (what validation per source reads)."""
        if self.mixture:
            dataset = self._load_mixture_split(split, combine)
        else:
            paths = self.data_paths()
            data_path = paths[(max(epoch, 1) - 1) % len(paths)]
            if len(paths) > 1 and split not in self._checked_splits:
                self._check_shards(split, paths)
            dataset = self._load_split(data_path, split, combine)
            self._loaded_from[split] = data_path
        self.datasets[split] = dataset
        return dataset

    def _load_mixture_split(self, split: str, combine: bool):
        for source in self.mixture:
            if split.endswith("_" + source.name):
                return self._load_split(source.path, split[: -len(source.name) - 1], combine)
        parts = [self._load_split(source.path, split, combine) for source in self.mixture]
        mixed = MixtureDataset(self.mixture, parts, self.cfg.mixture_epoch_samples)
        shares = ", ".join(f"{s.name} {s.weight:.3f}" for s in self.mixture)
        logger.info(f"{split}: mixture of {shares}; {mixed.num_samples} samples per epoch")
        return mixed

    def _load_split(self, data_path: str, split: str, combine: bool) -> MonolingualDataset:
        prefix = os.path.join(data_path, split)
        if not MMapIndexedDataset.exists(prefix):
            found = sorted(
                os.path.basename(p)[:-4]
                for p in glob.glob(os.path.join(glob.escape(data_path), "*.idx"))
                if MMapIndexedDataset.exists(p[:-4])
            )
            raise UserError(
                f"{prefix}.bin/.idx: not found; splits in {data_path}: {', '.join(found) or 'none'} "
                f"(choose with --train-subset/--valid-subset, or binarize it with toolkit-preprocess)"
            )
        names = numbered_splits(data_path, split) if combine else [split]
        parts = [MMapIndexedDataset(os.path.join(data_path, n)) for n in names]
        for part in parts:  # before any update: an id past the dictionary was an IndexError hundreds of updates in
            check_token_ids(part.prefix, part.tokens, len(self.dictionary), os.path.join(data_path, "dict.txt"))
        split_data = parts[0] if len(parts) == 1 else ConcatIndexedDataset(parts)
        split_data = self._maybe_shorten(split_data, split)
        blocks = TokenBlockDataset(
            split_data,
            self.cfg.tokens_per_sample,
            pad=self.dictionary.pad(),
            eos=self.dictionary.eos(),
            break_mode=self.cfg.sample_break_mode,
            include_targets=True,
            context_bos=document_bos(self.dictionary),
        )
        dataset = MonolingualDataset(
            blocks,
            self.dictionary,
            add_bos_token=self.cfg.add_bos_token,
            shuffle=True,
            document_mask=self.cfg.document_attention_mask,
            reset_positions=self.cfg.reset_position_ids,
            bos_as_context=bos_as_context(self.cfg.add_bos_token, self.dictionary),
            context_bos=document_bos(self.dictionary),
        )
        logger.info(f"{data_path} {'+'.join(names)} {len(split_data)} examples, {len(dataset)} samples")
        return dataset

    def _maybe_shorten(self, split_data, split: str):
        """fairseq's maybe_shorten_dataset: --shorten-method on the splits of --shorten-data-split-list."""
        method = self.cfg.shorten_method
        if method == "none" or not applies_to(split, self.cfg.shorten_data_split_list):
            return split_data
        shortened = ShortenedDataset(split_data, self.cfg.tokens_per_sample, method, self.cfg.seed)
        cut = int((np.asarray(split_data.sizes) > self.cfg.tokens_per_sample).sum())
        logger.info(
            f"--shorten-method {method}: {cut} of {len(shortened)} {split} lines cut to "
            f"{self.cfg.tokens_per_sample} tokens"
        )
        return shortened

    def _check_shards(self, split: str, paths) -> None:
        """A split found in several shards (the train split) must be in every one."""
        present = [MMapIndexedDataset.exists(os.path.join(p, split)) for p in paths]
        if sum(present) > 1 and not all(present):
            lacking = paths[present.index(False)]
            raise UserError(
                f"{os.path.join(lacking, split)}.bin/.idx: not found, but {split} is in other shards "
                f"of {self.cfg.data}; binarize it there or drop that shard"
            )
        self._checked_splits.add(split)

    def has_sharded_data(self) -> bool:
        return not self.mixture and len(self.data_paths()) > 1

    def dataset_for_epoch(self, split: str, epoch: int) -> MonolingualDataset:
        """The split as epoch ``epoch`` sees it: reloaded from that epoch's shard when DATA has several."""
        if self.mixture:
            return self.datasets[split] if split in self.datasets else self.load_dataset(split)
        paths = self.data_paths()
        wanted = paths[(max(epoch, 1) - 1) % len(paths)]
        if split not in self.datasets or (len(paths) > 1 and self._loaded_from.get(split) != wanted):
            return self.load_dataset(split, epoch=epoch)
        return self.datasets[split]

    def dataset(self, split: str) -> MonolingualDataset:
        if split not in self.datasets:
            raise KeyError(f"dataset not loaded: {split} (call task.load_dataset({split!r}) first)")
        return self.datasets[split]

    def max_positions(self) -> Optional[int]:
        """The longest sample (a prepended ``<s>`` included) that fixed-size break modes produce."""
        if self.cfg.sample_break_mode == "eos":
            return None
        return self.cfg.tokens_per_sample + (1 if prepends_bos(self.cfg.add_bos_token, self.dictionary) else 0)

    def get_batch_iterator(
        self,
        dataset: MonolingualDataset,
        max_tokens: Optional[int] = None,
        batch_size: Optional[int] = None,
        required_batch_size_multiple: int = 1,
        seed: int = 1,
        num_shards: int = 1,
        shard_id: int = 0,
        num_workers: int = 0,
        epoch: int = 1,
        max_positions: Optional[int] = None,
        ignore_invalid_inputs: bool = False,
    ) -> EpochBatchIterator:
        """Batches of ``dataset`` for this rank, as a resumable :class:`EpochBatchIterator`.

        Samples are sorted by size with ties in a ``seed``-fixed random order, cut into
        batches by ``max_tokens``/``batch_size``, and the batches shuffled per epoch
        (``seed + epoch``). With ``max_positions``, samples longer than that (``<s>``
        included) are an error, or are dropped with a warning if ``ignore_invalid_inputs``.
        """
        indices = dataset.ordered_indices(seed)
        if max_positions is not None:
            indices, dropped = filter_by_size(indices, dataset.seq_lengths(), max_positions)
            if len(dropped):
                first = int(dropped[0])
                msg = (
                    f"{len(dropped)} samples are longer than the model's {max_positions} positions "
                    f"(e.g. sample {first}: {int(dataset.seq_lengths()[first])} tokens)"
                )
                if not ignore_invalid_inputs:
                    raise UserError(
                        f"--tokens-per-sample/--sample-break-mode: {msg}; lower --tokens-per-sample, "
                        f"use a break mode that bounds the sample size, or skip them with "
                        f"--skip-invalid-size-inputs-valid-test"
                    )
                if len(indices) == 0:
                    raise UserError(
                        f"--tokens-per-sample/--sample-break-mode: every sample is skipped ({msg}); "
                        f"raise --tokens-per-sample or pass --shorten-method truncate"
                    )
                logger.warning(
                    f"{len(dropped):,} samples have invalid sizes and will be skipped, "
                    f"max_positions={max_positions}, first few sample ids={dropped[:10].tolist()}"
                )
        flags = {
            "max_tokens": max_tokens,
            "batch_size": batch_size,
            "required_batch_size_multiple": required_batch_size_multiple,
        }
        batching = self._batching(dataset, flags, max_positions)
        return EpochBatchIterator(
            dataset,
            dataset.collater,
            batching.make(indices, flags),
            seed=seed,
            num_shards=num_shards,
            shard_id=shard_id,
            num_workers=num_workers,
            epoch=epoch,
            batching=batching,
        )

    def _batching(self, dataset: MonolingualDataset, flags: Dict[str, Any], max_positions: Optional[int]) -> Batching:
        """How the batches are made, so a checkpoint's sample position maps onto other --batch-size etc."""

        def ordered(seed: int):
            indices = dataset.ordered_indices(seed)
            return (
                indices if max_positions is None else filter_by_size(indices, dataset.seq_lengths(), max_positions)[0]
            )

        def make(indices, batch_flags: Dict[str, Any]):
            return batch_by_size(
                indices,
                dataset.sizes,
                max_tokens=batch_flags["max_tokens"],
                max_sentences=batch_flags["batch_size"],
                required_batch_size_multiple=batch_flags["required_batch_size_multiple"],
            )

        samples = {"tokens_per_sample": self.cfg.tokens_per_sample, "sample_break_mode": self.cfg.sample_break_mode}
        return Batching(ordered, make, flags, samples)

    # --- components -----------------------------------------------------------------
    def build_model(self, cfg: Any):
        """The model of ``cfg.arch``: its options from ``cfg`` over the architecture's defaults."""
        from toolkit import models

        arch = _get(cfg, "arch")
        if arch is None:
            raise UserError("--arch: no model architecture given")
        return models.build_model(arch, cfg, self)

    def build_criterion(self, cfg: Any):
        name = _get(cfg, "criterion") or CRITERION_REGISTRY.default
        if name not in CRITERION_REGISTRY:
            registry.import_all_components()  # not parsed by the CLI (e.g. a library caller)
        entry = CRITERION_REGISTRY.get(name)
        criterion_cfg = options.config_from_args(entry.config, _as_dict(cfg)) if entry.config else None
        return entry.cls(self, criterion_cfg)
