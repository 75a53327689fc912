"""Cut a split's token stream into language-model blocks (fairseq's ``TokenBlockDataset``).

A binarized split is its items (lines, each ending in ``</s>``) stored back to back,
so the whole split is one flat token array. A block is a slice ``[start, end)`` of
that array; which slices depends on ``--sample-break-mode``:

``none``
    fixed windows of ``block_size`` tokens across line and document boundaries
    (the last one may be shorter).
``complete``
    whole lines packed greedily up to ``block_size`` tokens; a line longer than
    ``block_size`` becomes a block of its own.
``complete_doc``
    as ``complete``, but a block never crosses a document boundary. Documents are
    separated by empty lines (items of ``document_sep_len`` tokens, i.e. a lone
    ``</s>``); the separators themselves belong to no block.
``eos``
    one block per line, whatever its length.

Every block gives the LM target (the block's tokens) and the source (the target
shifted right by one: each token's previous token). As in fairseq, a block that
starts at the beginning of a line gets ``</s>`` as its first source token; one that
starts inside a line gets the token before it.

With ``context_bos`` (a tokenizer's vocabulary whose documents carry its BOS, as ``AutoTokenizer`` puts it
first: ``toolkit-preprocess`` of records), a block that would start at an item beginning with BOS starts one
token later: BOS is its first source token, the context transformers starts a text from, never a target.

The slices are computed with vectorized numpy (``none`` and ``eos``) or one cheap
step per *block* (``complete*``), never a Python loop over every line of a corpus.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np
import torch

from toolkit.config.components import BREAK_MODES  # noqa: F401  (the names, torch-free for --help)


def _item_offsets(sizes: np.ndarray) -> np.ndarray:
    """``offsets[i]`` = start of item i in the flat stream; ``offsets[-1]`` = total tokens."""
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return offsets


def _pack_greedily(offsets: np.ndarray, first: np.ndarray, stop: np.ndarray, block_size: int) -> np.ndarray:
    """Greedy packing of whole items into blocks of at most ``block_size`` tokens.

    Items ``first[k] .. stop[k]-1`` form segment k (a document, or the whole split);
    a block takes items while they fit, but always at least one. Returns the block
    boundaries as item indices, shape [num_blocks, 2].
    """
    n = len(offsets) - 1
    if n == 0 or len(first) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    # For every item j: the first item that no longer fits in a block starting at j.
    fits_until = np.searchsorted(offsets, offsets[:-1] + block_size, side="right") - 1
    nxt = np.maximum(fits_until, np.arange(1, n + 1))
    starts, ends = [], []
    for j, end in zip(first.tolist(), stop.tolist()):
        while j < end:  # one step per block
            k = min(int(nxt[j]), end)
            starts.append(j)
            ends.append(k)
            j = k
    return np.stack([np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)], axis=1)


def skip_leading_bos(slices: np.ndarray, offsets: np.ndarray, tokens, bos: int) -> np.ndarray:
    """``slices`` where each block starting at an item that begins with ``bos`` starts after it (a block of
    that one token stays). Reads one token per block that starts an item, not one per item."""
    starts = slices[:, 0]
    pos = np.minimum(np.searchsorted(offsets, starts), len(offsets) - 1)
    candidates = np.flatnonzero((offsets[pos] == starts) & (slices[:, 1] - starts > 1))
    if not len(candidates):
        return slices
    first = np.asarray(tokens[starts[candidates]])
    moved = slices.copy()
    moved[candidates[first == bos], 0] += 1
    return moved


def block_slices(
    sizes: np.ndarray, block_size: Optional[int], break_mode: str = "none", document_sep_len: int = 1
) -> np.ndarray:
    """Token slices ``[start, end)`` of the flat stream, shape [num_blocks, 2] (int64)."""
    if break_mode is None:
        break_mode = "none"
    if break_mode not in BREAK_MODES:
        raise ValueError(f"--sample-break-mode: unknown mode {break_mode!r}; choose from {', '.join(BREAK_MODES)}")
    sizes = np.asarray(sizes, dtype=np.int64)
    offsets = _item_offsets(sizes)
    total = int(offsets[-1])
    if break_mode == "eos":
        return np.stack([offsets[:-1], offsets[1:]], axis=1)
    if block_size is None or block_size <= 0:
        raise ValueError(f"--tokens-per-sample must be positive for --sample-break-mode {break_mode}, got {block_size}")
    if break_mode == "none":
        starts = np.arange(0, total, block_size, dtype=np.int64)
        return np.stack([starts, np.minimum(starts + block_size, total)], axis=1)
    if break_mode == "complete":
        items = _pack_greedily(offsets, np.array([0]), np.array([len(sizes)]), block_size)
        return offsets[items]
    # complete_doc: segments are the runs of items between separators.
    is_sep = sizes == document_sep_len
    not_sep = (~is_sep).astype(np.int8)
    change = np.diff(np.concatenate([[0], not_sep, [0]]))
    first, stop = np.flatnonzero(change == 1), np.flatnonzero(change == -1)
    items = _pack_greedily(offsets, first, stop, block_size)
    slices = offsets[items] if len(items) else np.zeros((0, 2), dtype=np.int64)
    return slices[(slices[:, 1] - slices[:, 0]) > 1]  # as fairseq: drop blocks of <= 1 token


class TokenBlockDataset(torch.utils.data.Dataset):
    """Blocks of a tokenized split; item ``i`` is ``(source, target)`` LongTensors.

    Args:
        dataset: the split, e.g. a :class:`~toolkit.data.indexed_dataset.MMapIndexedDataset`.
            Its ``.tokens`` (flat array of all items back to back) and ``.sizes`` are
            used when present; any dataset of 1-D tensors with ``.sizes`` also works
            (its items are then concatenated in memory, fine for small data).
        block_size: ``--tokens-per-sample`` (ignored by ``eos``).
        pad, eos: dictionary indices.
        break_mode: one of :data:`BREAK_MODES`.
        include_targets: return ``(source, target)``; otherwise just the block's tokens.
        document_sep_len: size of an item that separates documents (``complete_doc``).
        context_bos: the BOS id a document's item may begin with, read as context (module docstring).

    Attributes:
        sizes: int64 array, tokens in each block (what batching counts).
        slice_indices: int64 array [num_blocks, 2], token offsets of each block.
    """

    def __init__(
        self,
        dataset,
        block_size: Optional[int],
        pad: int,
        eos: int,
        break_mode: str = "none",
        include_targets: bool = True,
        document_sep_len: int = 1,
        context_bos: Optional[int] = None,
    ):
        super().__init__()
        self.pad, self.eos = pad, eos
        self.block_size = block_size
        self.break_mode = break_mode or "none"
        self.include_targets = include_targets
        self._prefix = getattr(dataset, "prefix", None)
        self.dataset = dataset
        item_sizes = np.asarray(dataset.sizes, dtype=np.int64)
        self.tokens = self.flat_tokens(dataset, item_sizes)
        self.slice_indices = block_slices(item_sizes, block_size, self.break_mode, document_sep_len)
        offsets = _item_offsets(item_sizes)
        if context_bos is not None:
            self.slice_indices = skip_leading_bos(self.slice_indices, offsets, self.tokens, context_bos)
        self.sizes = self.slice_indices[:, 1] - self.slice_indices[:, 0]
        # Whether each block starts exactly where a line starts (its first source token is </s>).
        starts = self.slice_indices[:, 0]
        pos = np.minimum(np.searchsorted(offsets, starts), len(offsets) - 1)
        self.starts_item = offsets[pos] == starts

    @staticmethod
    def flat_tokens(dataset, item_sizes: np.ndarray) -> np.ndarray:
        tokens = getattr(dataset, "tokens", None)
        if tokens is not None:
            return tokens
        if len(item_sizes) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.asarray(dataset[i], dtype=np.int64).reshape(-1) for i in range(len(dataset))])

    def __len__(self) -> int:
        return len(self.slice_indices)

    def block(self, index: int) -> Tuple[np.ndarray, np.ndarray]:
        """``(source, target)`` of block ``index`` as int64 numpy arrays."""
        s, e = int(self.slice_indices[index, 0]), int(self.slice_indices[index, 1])
        target = np.asarray(self.tokens[s:e], dtype=np.int64)
        source = np.empty(e - s, dtype=np.int64)
        if e > s:
            if self.starts_item[index]:
                source[0] = self.eos
                source[1:] = self.tokens[s : e - 1]
            else:
                source[:] = self.tokens[s - 1 : e - 1]
        return source, target

    def __getitem__(self, index: int) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        source, target = self.block(index)
        if self.include_targets:
            return torch.from_numpy(source), torch.from_numpy(target)
        return torch.from_numpy(target)

    # DataLoader workers started by spawn/forkserver get a pickled copy: re-open the
    # memory map there instead of pickling the whole token array.
    def __getstate__(self):
        state = dict(self.__dict__)
        if self._prefix is not None:
            state["dataset"] = None
            state["tokens"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.tokens is None:
            from toolkit.data.indexed_dataset import MMapIndexedDataset

            self.dataset = MMapIndexedDataset(self._prefix)
            self.tokens = self.dataset.tokens
