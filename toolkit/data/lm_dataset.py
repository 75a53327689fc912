"""Language-model samples and their collation (fairseq's ``MonolingualDataset``, future target).

Each sample is ``{"id", "source", "target"}`` where ``target`` is a block of the
token stream and ``source`` is the same block shifted right by one token (see
:mod:`toolkit.data.token_block_dataset`), so position t of the model's output is
scored against ``target[t]``. With ``--add-bos-token``, ``<s>`` is prepended to
*both* source and target, exactly as fairseq does (the first position then learns
to predict ``<s>`` from ``<s>``; it keeps losses identical to fairseq's).

With ``bos_as_context`` (a model imported from Hugging Face whose tokenizer puts BOS first, see
:func:`toolkit.tasks.language_modeling.bos_as_context`) a block that starts a line reads BOS where
fairseq reads ``</s>``, and nothing is prepended: the sample is then exactly what transformers
computes for the text, ``model([BOS] + ids)`` scored on ``ids`` (no ``</s>`` after BOS, no BOS
in the middle of the text, no score for BOS itself).

Documents binarized with such a tokenizer (records) carry their BOS in the data, as ``AutoTokenizer`` puts
it first (``context_bos``): a block starting at one reads that BOS as its context (see
:mod:`toolkit.data.token_block_dataset`), whatever ``--add-bos-token`` says, and under
``--document-attention-mask`` each document starts at its BOS.

The collater right-pads with the dictionary's pad index and returns::

    {"id": LongTensor[B], "nsentences": B, "ntokens": non-pad target tokens (int),
     "net_input": {"src_tokens": LongTensor[B, T], "src_lengths": LongTensor[B]},
     "target": LongTensor[B, T]}
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from toolkit.data.token_block_dataset import TokenBlockDataset


def collate_tokens(values: Sequence[Any], pad_idx: int, pad_to_length: Optional[int] = None) -> torch.Tensor:
    """Right-pad 1-D token sequences (tensors or arrays) into one LongTensor [B, T]."""
    lengths = [len(v) for v in values]
    width = max(lengths, default=0)
    if pad_to_length is not None:
        width = max(width, pad_to_length)
    out = np.full((len(values), width), pad_idx, dtype=np.int64)
    for row, (v, n) in enumerate(zip(values, lengths)):
        if n:
            out[row, :n] = v.numpy() if isinstance(v, torch.Tensor) else v
    return torch.from_numpy(out)


def collate(samples: List[Dict[str, Any]], pad_idx: int) -> Dict[str, Any]:
    """Merge ``{"id", "source", "target"}`` samples into a batch (empty dict for no samples)."""
    if len(samples) == 0:
        return {}
    sources = [s["source"] for s in samples]
    targets = [s["target"] for s in samples]
    return {
        "id": torch.tensor([int(s["id"]) for s in samples], dtype=torch.long),
        "nsentences": len(samples),
        "ntokens": int(sum(len(t) for t in targets)),
        "net_input": {
            "src_tokens": collate_tokens(sources, pad_idx),
            "src_lengths": torch.tensor([len(s) for s in sources], dtype=torch.long),
        },
        "target": collate_tokens(targets, pad_idx),
    }


def document_layout(src_tokens: torch.Tensor, eos: int, bos: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(document_ids, positions)`` [B, T]: a new document wherever the input token is ``eos``;
    positions count from 0 at each document start (and at the start of the row).

    ``bos``: documents that carry the tokenizer's BOS start at it, not at the ``eos`` before it (which then
    ends the previous document, predicting this BOS), so each reads ``[BOS] + text`` from position 0, as
    transformers does."""
    starts = src_tokens == eos
    if bos is not None:
        before_bos = starts[:, :-1] & (src_tokens[:, 1:] == bos)
        starts[:, :-1] &= ~before_bos
        starts[:, 1:] |= before_bos
    document_ids = starts.long().cumsum(dim=1)
    T = src_tokens.size(1)
    steps = torch.arange(T, device=src_tokens.device).expand_as(src_tokens)
    last_start = torch.where(starts, steps, torch.zeros_like(steps)).cummax(dim=1).values
    return document_ids, steps - last_start


class MonolingualDataset(torch.utils.data.Dataset):
    """LM samples over a :class:`TokenBlockDataset` built with ``include_targets=True``.

    ``sizes`` are the blocks' sizes *without* the optional ``<s>``: that is what
    fairseq batches by (``--max-tokens``) and filters by, so batches are the same as
    fairseq's; with ``--add-bos-token`` each row is one token longer than counted.
    """

    def __init__(
        self,
        blocks: TokenBlockDataset,
        dictionary,
        add_bos_token: bool = False,
        shuffle: bool = True,
        document_mask: bool = False,
        reset_positions: bool = False,
        bos_as_context: bool = False,
        context_bos: Optional[int] = None,
    ):
        self.blocks = blocks
        self.context_bos = context_bos  # documents carry this BOS (TokenBlockDataset's context_bos)
        self.bos_as_context = bos_as_context
        self.document_mask, self.reset_positions = document_mask, reset_positions
        self.dictionary = dictionary
        self.add_bos_token = add_bos_token
        self.shuffle = shuffle
        self.sizes = blocks.sizes
        self._pad, self._bos = dictionary.pad(), dictionary.bos()

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        source, target = self.blocks.block(index)
        if self.bos_as_context:
            if len(source) and self.blocks.starts_item[index]:
                source[0] = self._bos  # block() returns a fresh array: the stream is not changed
        elif self.add_bos_token:
            source = np.concatenate([[self._bos], source])
            target = np.concatenate([[self._bos], target])
        return {"id": index, "source": torch.from_numpy(source), "target": torch.from_numpy(target)}

    def num_tokens(self, index: int) -> int:
        return int(self.sizes[index])

    def size(self, index: int) -> int:
        return int(self.sizes[index])

    def seq_lengths(self) -> np.ndarray:
        """Length of every sample's rows as the model sees them (``<s>`` included)."""
        return self.sizes + (1 if self.add_bos_token and not self.bos_as_context else 0)

    def starts_with_bos(self, index: int) -> bool:
        """Whether the sample's first source token is the BOS that stands for the line's ``</s>`` context
        (``bos_as_context``): a context window carried in front of it puts the ``</s>`` back."""
        return self.bos_as_context and bool(self.blocks.starts_item[index]) and self.sizes[index] > 0

    def ordered_indices(self, seed: int = 1) -> np.ndarray:
        """Indices sorted by size, ties in a random order fixed by ``seed`` (fairseq's order).

        Equals fairseq's ``ordered_indices`` under ``numpy_seed(seed)``:
        ``np.lexsort([permutation, sizes])``.
        """
        n = len(self)
        tiebreak = np.random.RandomState(seed).permutation(n) if self.shuffle else np.arange(n)
        return np.lexsort([tiebreak, self.sizes]).astype(np.int64)

    def collater(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The batch; with ``--document-attention-mask`` its net_input also holds ``document_ids`` (and
        ``positions`` with ``--reset-position-ids``), see :func:`document_layout` and :mod:`toolkit.models.document_mask`."""
        batch = collate(samples, self._pad)
        if batch and self.document_mask:
            net_input = batch["net_input"]
            net_input["document_ids"], positions = document_layout(
                net_input["src_tokens"], self.dictionary.eos(), self.context_bos
            )
            if self.reset_positions:
                net_input["positions"] = positions
        return batch

    def set_epoch(self, epoch: int) -> None:  # nothing changes between epochs
        pass
