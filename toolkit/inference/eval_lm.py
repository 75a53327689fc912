"""Perplexity of language models with fairseq-eval-lm's arithmetic.

The split is cut into blocks by the language-modeling task with
``tokens_per_sample - context_window`` tokens each (``--tokens-per-sample`` counts the
context, as in fairseq). With ``--context-window`` each block's input is prefixed by
the last ``context_window`` input tokens of the blocks before it, in dataset order
(fairseq's ``LMContextWindowDataset``): with 512 and 400, every block scores 112 new
tokens after up to 400 tokens of context, and the first block has none.

The sum and count follow ``fairseq_cli/eval_lm.py``: every target token counts once
(``<s>`` removed under ``--add-bos-token``), and with
``--post-process subword_nmt`` a BPE continuation's score is added to the next
token's and the pair counts as one word. Perplexity is ``2 ** (-sum / count / ln 2)``.

Unlike fairseq, a non-finite score is an error (:func:`check_finite`), not a token
dropped from the count: one NaN weight made every score NaN, all were dropped, and the
command printed perplexity 1.00 with exit 0. An evaluation that counts no token at all
is an error too, for the same reason.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np
import torch

from toolkit import inference
from toolkit.data.batching import batch_by_size, filter_by_size
from toolkit.core.errors import UserError

logger = logging.getLogger("toolkit.eval_lm")  # the logger name log lines and filters already use

DEFAULT_MAX_TOKENS = 36000  # fairseq-eval-lm's default --max-tokens


class ContextWindow:
    """fairseq's LMContextWindowDataset collater: carries the last inputs across batches."""

    def __init__(self, tokens_per_sample: int, context_window: int, pad: int, relink=None):
        self.max_sample_len = tokens_per_sample + context_window
        self.context_window = context_window
        self.pad = pad
        self.prev = np.empty(0, dtype=np.int64)
        # (sample id -> whether its first input is BOS standing for </s>, eos): with context before it, the
        # row continues the stream, so </s> goes back (no BOS in the middle of the text)
        self.relink = relink

    def __call__(self, sample: Dict[str, Any]) -> Dict[str, Any]:
        pad, cw = self.pad, self.context_window
        toks, tgt = sample["net_input"]["src_tokens"], sample["target"]
        bsz, tsz = toks.shape
        new_toks = np.full((bsz, tsz + cw), pad, dtype=np.int64)
        new_tgt = np.full((bsz, tsz + cw), pad, dtype=np.int64)
        starts = []
        for i in range(bsz):
            sample_len = int(toks[i].ne(pad).sum())
            extra = len(self.prev) + sample_len - self.max_sample_len
            if extra > 0:
                self.prev = self.prev[extra:]
            row = np.concatenate([self.prev, toks[i].numpy()])
            if self.relink is not None and len(self.prev) and self.relink[0](int(sample["id"][i])):
                row[len(self.prev)] = self.relink[1]
            new_toks[i, : len(row)] = row
            new_tgt[i, len(self.prev) : len(self.prev) + tgt.shape[1]] = tgt[i].numpy()
            starts.append(len(self.prev))
            self.prev = new_toks[i][new_toks[i] != pad][-cw:]
        sample["net_input"]["src_tokens"] = torch.from_numpy(new_toks)
        sample["target"] = torch.from_numpy(new_tgt)
        sample["start_indices"] = starts
        return sample


def eval_batches(
    dataset,
    context_window: int,
    tokens_per_sample: int,
    pad: int,
    max_tokens: Optional[int] = None,
    batch_size: Optional[int] = None,
    max_positions: Optional[int] = None,
    num_shards: int = 1,
    shard_id: int = 0,
    seed: int = 1,
) -> CollatedBatches:
    """Collated batches as fairseq's ``eval_lm_dataloader`` makes them (this shard's share).

    ``tokens_per_sample`` is the block size (already reduced by the context window).
    Samples longer than ``max_positions`` are skipped with a warning, as fairseq does.
    """
    indices = np.arange(len(dataset), dtype=np.int64) if context_window > 0 else dataset.ordered_indices(seed)
    indices, dropped = filter_by_size(indices, dataset.sizes, max_positions)
    if len(dropped) and not len(indices):
        raise UserError(
            f"--tokens-per-sample/--sample-break-mode: every block is longer than the model's "
            f"{max_positions} positions; lower --tokens-per-sample"
        )
    if len(dropped):
        logger.warning(
            f"{len(dropped)} samples have invalid sizes (longer than the model's {max_positions} "
            f"positions) and will be skipped, e.g. sample {int(dropped[0])}"
        )
    batches = batch_by_size(
        indices, dataset.sizes, max_tokens=max_tokens or DEFAULT_MAX_TOKENS, max_sentences=batch_size
    )
    relink = (dataset.starts_with_bos, dataset.dictionary.eos()) if dataset.bos_as_context else None
    window = ContextWindow(tokens_per_sample, context_window, pad, relink) if context_window > 0 else None
    return CollatedBatches(dataset, batches[shard_id::num_shards], window)


class CollatedBatches:
    """The shard's batches, collated one at a time as they are read; sized, so progress says "i / total"."""

    def __init__(self, dataset, batches: List[Any], window: Optional[ContextWindow]):
        self.dataset, self.batches, self.window = dataset, batches, window

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        for batch in self.batches:
            sample = self.dataset.collater([self.dataset[int(i)] for i in batch])
            yield self.window(sample) if self.window is not None else sample


def score_sample(
    models: List[torch.nn.Module],
    sample: Dict[str, Any],
    pad: int,
    max_positions: int,
    softmax_batch: int,
    device: torch.device,
) -> List[Tuple[int, torch.Tensor, torch.Tensor]]:
    """(sample id, target tokens, positional scores) per row, as fairseq's SequenceScorer."""
    src, target = sample["net_input"]["src_tokens"], sample["target"]
    width = int(src.ne(pad).sum(1).max()) if src.numel() else 0  # trailing all-pad columns change nothing
    src, target = src[:, : max(width, 1)], target[:, : max(width, 1)]
    if src.size(1) > max_positions:
        raise UserError(
            f"--tokens-per-sample/--context-window: a block with its context has {src.size(1)} tokens, "
            f"more than the model's {max_positions} positions; lower --tokens-per-sample"
        )
    lp = inference.target_log_probs(models, src.to(device), target.to(device), softmax_batch).cpu()
    starts = sample.get("start_indices") or [0] * src.size(0)
    rows = []
    for i, start in enumerate(starts):
        ref = target[i, start:]
        ref = ref[ref.ne(pad)]
        rows.append((int(sample["id"][i]), ref, lp[i, start : start + len(ref)].clone()))
    return rows


@dataclass
class WordStat:
    """fairseq's --output-word-stats line: word, count, sum of log-probs, is_bpe, next word's, their count."""

    word: str
    is_bpe: bool
    log_prob: float = 0.0
    next_word_prob: float = 0.0
    count: int = 0
    missing_next_words: int = 0

    def add(self, log_prob: float, next_word_prob: Optional[float]) -> None:
        if next_word_prob is not None:
            self.next_word_prob += next_word_prob
        else:
            self.missing_next_words += 1
        self.log_prob += log_prob
        self.count += 1

    def __str__(self) -> str:
        return (
            f"{self.word}\t{self.count}\t{self.log_prob}\t{self.is_bpe}\t{self.next_word_prob}\t"
            f"{self.count - self.missing_next_words}"
        )


@dataclass
class Totals:
    score_sum: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))  # fairseq: fp32
    count: int = 0
    ntokens: int = 0
    word_stats: Dict[str, WordStat] = field(default_factory=dict)


def bpe_continuations(dictionary, post_process: Optional[str]) -> Tuple[Optional[Set[int]], int]:
    """Token ids that continue into the next token (ending in ``@@``), and the marker's length."""
    if post_process is None:
        return None, 0
    if post_process not in ("subword_nmt", "@@ "):
        raise UserError(f"--post-process {post_process}: eval-lm implements only subword_nmt ('@@ '), as fairseq")
    marker = post_process.rstrip() if post_process == "@@ " else "@@"
    return {i for i in range(len(dictionary)) if dictionary[i].endswith(marker)}, len(marker)


def merge_bpe(tokens: torch.Tensor, scores: torch.Tensor, bpe_toks: Optional[Set[int]], tgt_len: int) -> int:
    """Move each continuation's score onto the next token (in place); returns how many were merged."""
    skipped = 0
    if bpe_toks is None:
        return 0
    for i in range(min(tgt_len - 1, len(tokens) - 1)):
        if int(tokens[i]) in bpe_toks:
            skipped += 1
            scores[i + 1] += scores[i]
            scores[i] = 0
    return skipped


def word_probs(
    dictionary,
    tokens: torch.Tensor,
    scores: torch.Tensor,
    bpe_toks: Optional[Set[int]],
    bpe_len: int,
    stats: Dict[str, WordStat],
) -> List[Tuple[str, float]]:
    """Whole words with their log-probabilities (fairseq's --output-word-probs/--output-word-stats)."""
    words, w, is_bpe = [], "", False
    for i in range(len(tokens)):
        idx = int(tokens[i])
        w += dictionary[idx]
        if bpe_toks is not None and idx in bpe_toks:
            w, is_bpe = w[:-bpe_len], True
            continue
        words.append((w, float(scores[i])))
        nxt = i + 1
        while nxt < len(tokens) and float(scores[nxt]) == 0:
            nxt += 1
        next_prob = float(scores[nxt]) if nxt < len(tokens) else None
        stats.setdefault(w, WordStat(w, is_bpe)).add(float(scores[i]), next_prob)
        w, is_bpe = "", False
    return words


def accumulate(
    totals: Totals,
    dictionary,
    rows,
    bpe: Tuple[Optional[Set[int]], int],
    remove_bos: bool,
    word_output: bool,
    context_bos: Optional[int] = None,
) -> List[str]:
    """Add one batch's rows to the totals (fairseq's eval_lm loop); the --output-word-probs lines.
    ``context_bos``: the BOS documents carry in the data (``MonolingualDataset.context_bos``): the context a
    document starts from, never counted, as transformers never scores it."""
    bpe_toks, bpe_len = bpe
    lines = []
    for sample_id, tokens, scores in rows:
        if context_bos is not None:
            kept = tokens != context_bos
            tokens, scores = tokens[kept], scores[kept]
        tgt_len = len(tokens)
        if remove_bos:
            if len(tokens) == 0 or int(tokens[0]) != dictionary.bos():
                raise UserError(
                    "--add-bos-token: a block does not start with <s>; was the split binarized differently?"
                )
            tokens, scores = tokens[1:], scores[1:]
        skipped = merge_bpe(tokens, scores, bpe_toks, tgt_len)
        totals.score_sum = totals.score_sum + scores.float().sum()
        totals.count += len(scores) - skipped
        if word_output:
            words = word_probs(dictionary, tokens, scores, bpe_toks, bpe_len, totals.word_stats)
            lines.append(f"{sample_id} " + "\t".join(f"{w} [{p:2f}]" for w, p in words))
    return lines


def check_finite(rows, split: str, path: str) -> None:
    """Refuse the first NaN/inf score (a broken checkpoint), naming where it is: no perplexity is printed."""
    for sample_id, tokens, scores in rows:
        bad = (~torch.isfinite(scores)).nonzero()
        if len(bad):
            index = int(bad[0, 0])
            raise UserError(
                f"{path}: the model scores {float(scores[index])} for --gen-subset {split}, sample "
                f"{sample_id}, token {index} (id {int(tokens[index])}): the checkpoint looks broken "
                f"(NaN/inf weights?); evaluate an earlier checkpoint"
            )


def check_counted(totals: Totals, split: str, data: str) -> None:
    """An evaluation that counted no token has no perplexity (fairseq printed 1.00)."""
    if totals.count <= 0:
        raise UserError(
            f"{data}/{split}: no tokens to evaluate (the split is empty, or this --shard-id has no "
            f"batch); give a split with text in it (--gen-subset)"
        )


def perplexity(totals: Totals) -> Dict[str, float]:
    """fairseq's: loss in base 2 over the counted tokens (0 when nothing was counted)."""
    loss = -float(totals.score_sum) / totals.count / math.log(2) if totals.count > 0 else 0.0
    return {"loss": loss, "perplexity": 2**loss, "count": totals.count}
