"""Chat data for supervised fine-tuning: conversations, the tokens each one trains, and their samples.

A chat data-bin (``toolkit-preprocess --chat-template``) keeps each split twice, item for item:

* ``{split}.bin/.idx``: each conversation's token ids as its chat template renders and the tokenizer
  encodes them (specials included, nothing added);
* ``{split}.loss_mask.bin/.idx`` (uint8, the same sizes): 1 where the token is trained (predicted and
  counted in the loss), 0 elsewhere (system and user turns, the template's headers).

A sample is whole conversations: ``source`` is each conversation's ids but its last, ``target`` its ids but
its first, where the mask is 0 the dictionary's pad. So the loss is a target-side thing: the criterion
ignores padding, the fused head and loss keep working, and ``ntokens`` (what the trainer normalizes the
update by, summed over micro-batches and ranks) counts the trained tokens only. Position t of a conversation
predicts token t + 1 from tokens 0..t, as transformers scores ``labels`` (its shift inside the loss).

Several conversations share a sample under ``--sample-break-mode complete`` (greedily, in stored order, up to
``--tokens-per-sample`` positions): each one's ``document_ids`` and ``positions`` go with the batch, so
under ``--document-attention-mask --reset-position-ids`` every conversation attends and counts positions as
it would alone. ``eos`` gives each conversation a sample of its own. A conversation longer than
``--tokens-per-sample`` is a sample of its own (skipped or refused by the batching's size filter), or cut to
its first ``--tokens-per-sample + 1`` tokens with ``--shorten-method truncate``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from toolkit.core.errors import UserError
from toolkit.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from toolkit.data.lm_dataset import collate, collate_tokens
from toolkit.data.token_block_dataset import block_slices

LOSS_MASK = ".loss_mask"
"""The suffix of a split's loss-mask dataset: ``train.loss_mask.bin/.idx`` beside ``train.bin/.idx``."""
PADDING_DOCUMENT = -1  # document id of a row's right padding: it attends only to itself


def mask_prefix(prefix: str) -> str:
    return prefix + LOSS_MASK


def is_mask_split(name: str) -> bool:
    """Whether a ``.idx`` name of a data-bin is a loss mask, not a split."""
    return name.endswith(LOSS_MASK)


class ChatSplitWriter:
    """Writes a chat split: each conversation's ids to ``prefix.bin/.idx``, its mask to ``prefix.loss_mask``."""

    def __init__(self, prefix: str, dtype):
        self.prefix = prefix
        self.tokens = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        self.mask = MMapIndexedDatasetBuilder(mask_prefix(prefix) + ".bin", dtype=np.uint8)
        self.conversations = self.num_tokens = self.num_trained = 0

    def add(self, ids: Sequence[int], mask: Sequence[int]) -> None:
        if len(ids) != len(mask):
            raise ValueError(f"{len(ids)} token ids but {len(mask)} mask values")
        mask = np.asarray(mask, dtype=np.uint8)
        self.tokens.add_item(np.asarray(ids, dtype=np.int64))
        self.mask.add_item(mask)
        self.conversations += 1
        self.num_tokens += len(ids)
        self.num_trained += int(mask.sum())

    def finalize(self) -> None:
        self.tokens.finalize(self.prefix + ".idx")
        self.mask.finalize(mask_prefix(self.prefix) + ".idx")


class ChatSplit:
    """One chat split read back: flat token ids, flat mask, each conversation's size (memory-mapped)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        if not MMapIndexedDataset.exists(mask_prefix(prefix)):
            raise UserError(
                f"{mask_prefix(prefix)}.bin/.idx: not found beside {prefix}.bin; --task sft reads chat data-bins "
                f"(toolkit-preprocess --chat-template), which keep which tokens are trained"
            )
        tokens, mask = MMapIndexedDataset(prefix), MMapIndexedDataset(mask_prefix(prefix))
        if len(tokens.sizes) != len(mask.sizes) or not np.array_equal(tokens.sizes, mask.sizes):
            raise UserError(
                f"{mask_prefix(prefix)}.idx: its {len(mask.sizes)} items do not match the {len(tokens.sizes)} "
                f"conversations of {prefix}.idx; the data-bin is damaged, re-run toolkit-preprocess --chat-template"
            )
        self.sizes = np.asarray(tokens.sizes, dtype=np.int64)
        self.tokens, self.mask = tokens.tokens, mask.tokens


class SFTDataset(torch.utils.data.Dataset):
    """Samples of whole conversations over one or more :class:`ChatSplit` (``--combine-val``: in order).

    ``sizes``: each sample's positions (what ``--max-tokens`` batches and the size filter reads).
    """

    def __init__(
        self,
        prefixes: List[str],
        pad: int,
        tokens_per_sample: Optional[int],
        break_mode: str = "complete",
        truncate: bool = False,
        document_mask: bool = True,
        reset_positions: bool = True,
    ):
        self.prefixes, self.pad = list(prefixes), pad
        self.tokens_per_sample, self.break_mode, self.truncate = tokens_per_sample, break_mode, truncate
        self.document_mask, self.reset_positions = document_mask, reset_positions
        self.shuffle, self.add_bos_token, self.bos_as_context = True, False, False
        self._open()
        conversation_sizes = np.concatenate([split.sizes for split in self.splits]) if self.splits else np.zeros(0)
        self.starts = np.zeros(len(conversation_sizes) + 1, dtype=np.int64)
        np.cumsum(conversation_sizes, out=self.starts[1:])
        used = np.asarray(conversation_sizes, dtype=np.int64)
        if truncate and tokens_per_sample:
            used = np.minimum(used, tokens_per_sample + 1)
        self.kept = np.flatnonzero(used >= 2)  # a conversation of one token predicts nothing
        self.lengths = used[self.kept]  # tokens read from each kept conversation
        self.samples = self._pack(self.lengths - 1)  # [num_samples, 2]: ranges of kept conversations
        positions = np.concatenate([[0], np.cumsum(self.lengths - 1)])
        self.sizes = positions[self.samples[:, 1]] - positions[self.samples[:, 0]]

    def _open(self) -> None:
        self.splits = [ChatSplit(prefix) for prefix in self.prefixes]
        flat = lambda arrays: arrays[0] if len(arrays) == 1 else np.concatenate(arrays)  # noqa: E731
        self.tokens = flat([s.tokens for s in self.splits]) if self.splits else np.zeros(0, np.int64)
        self.mask = flat([s.mask for s in self.splits]) if self.splits else np.zeros(0, np.uint8)

    def _pack(self, positions: np.ndarray) -> np.ndarray:
        """Conversation ranges of the samples: one each (``eos``), or packed greedily (``complete``)."""
        n = len(positions)
        if self.break_mode == "eos" or n == 0:
            return np.stack([np.arange(n), np.arange(1, n + 1)], axis=1).astype(np.int64).reshape(-1, 2)
        slices = block_slices(positions, self.tokens_per_sample, "complete")
        offsets = np.concatenate([[0], np.cumsum(positions)])
        return np.searchsorted(offsets, slices, side="left").astype(np.int64)

    def __len__(self) -> int:
        return len(self.samples)

    def conversation(self, k: int) -> Dict[str, np.ndarray]:
        """Kept conversation ``k``'s ids and mask (cut under ``truncate``)."""
        start = int(self.starts[self.kept[k]])
        end = start + int(self.lengths[k])
        return {"ids": np.asarray(self.tokens[start:end], np.int64), "mask": np.asarray(self.mask[start:end])}

    def __getitem__(self, index: int) -> Dict[str, Any]:
        sources, targets, documents, positions = [], [], [], []
        first, stop = (int(i) for i in self.samples[index])
        for document, k in enumerate(range(first, stop)):
            item = self.conversation(k)
            ids, trained = item["ids"], item["mask"][1:] != 0
            sources.append(ids[:-1])
            targets.append(np.where(trained, ids[1:], self.pad))
            documents.append(np.full(len(ids) - 1, document, dtype=np.int64))
            positions.append(np.arange(len(ids) - 1, dtype=np.int64))
        return {
            "id": index,
            "source": torch.from_numpy(np.concatenate(sources)),
            "target": torch.from_numpy(np.concatenate(targets)),
            "document_ids": torch.from_numpy(np.concatenate(documents)),
            "positions": torch.from_numpy(np.concatenate(positions)),
        }

    def num_tokens(self, index: int) -> int:
        return int(self.sizes[index])

    def size(self, index: int) -> int:
        return int(self.sizes[index])

    def seq_lengths(self) -> np.ndarray:
        return self.sizes

    def starts_with_bos(self, index: int) -> bool:
        return False

    def trained_tokens(self) -> int:
        """Tokens the loss counts over the samples (a conversation's first token is never predicted)."""
        if len(self.kept) == 0:
            return 0
        first = self.starts[self.kept] + 1
        bounds = np.stack([first, first - 1 + self.lengths], axis=1).reshape(-1)
        if bounds[-1] == len(self.mask):  # the last range runs to the end: reduceat's last sum does
            bounds = bounds[:-1]
        return int(np.add.reduceat(self.mask, bounds, dtype=np.int64)[::2].sum())

    def ordered_indices(self, seed: int = 1) -> np.ndarray:
        """By size, ties in a ``seed``-fixed random order (the language-modeling task's order)."""
        n = len(self)
        tiebreak = np.random.RandomState(seed).permutation(n) if self.shuffle else np.arange(n)
        return np.lexsort([tiebreak, self.sizes]).astype(np.int64)

    def collater(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The language-modeling batch with ``ntokens`` the trained targets, and each conversation's
        ``document_ids`` (right padding a document of its own) and ``positions`` under the mask flags."""
        batch = collate(samples, self.pad)
        if not batch:
            return batch
        batch["ntokens"] = int(batch["target"].ne(self.pad).sum())
        if self.document_mask:
            net_input = batch["net_input"]
            net_input["document_ids"] = collate_tokens([s["document_ids"] for s in samples], PADDING_DOCUMENT)
            if self.reset_positions:
                net_input["positions"] = collate_tokens([s["positions"] for s in samples], 0)
        return batch

    def set_epoch(self, epoch: int) -> None:
        pass

    # DataLoader workers started by spawn get the prefixes and map the files again
    def __getstate__(self):
        state = dict(self.__dict__)
        state["splits"] = state["tokens"] = state["mask"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()


def split_files(prefix: str) -> List[str]:
    """The files of a chat split (tokens and mask), for renames and listings."""
    return [prefix + ext for ext in (".bin", ".idx")] + [mask_prefix(prefix) + ext for ext in (".bin", ".idx")]


def exists(prefix: str) -> bool:
    return MMapIndexedDataset.exists(prefix) and MMapIndexedDataset.exists(mask_prefix(prefix))
