"""fairseq's result lines: ``S-``, ``T-``, ``W-``, ``H-``, ``D-``, ``P-`` (tab-separated, scores in base 2).

``H-id<TAB>score<TAB>tokens``: the hypothesis as dictionary tokens (after ``--post-process``),
``D-``: the same detokenized by the data-bin's BPE, ``P-``: one score per token with
4 decimals (the final ``</s>`` included). The hypothesis score is printed as fairseq
prints a float32 tensor's value.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import torch

from toolkit.core.errors import UserError

POST_PROCESS_CHOICES = ("sentencepiece", "wordpiece", "letter", "silence", "_EOW", "subword_nmt", "@@ ", "@@", "none")


def post_process(sentence: str, symbol: Optional[str]) -> str:
    """fairseq's ``data_utils.post_process``: undo a segmentation marked in the token strings."""
    if symbol is None or symbol == "none":
        return sentence
    if symbol == "sentencepiece":
        return sentence.replace(" ", "").replace("\u2581", " ").strip()
    if symbol == "wordpiece":
        return sentence.replace(" ", "").replace("_", " ").strip()
    if symbol == "letter":
        return sentence.replace(" ", "").replace("|", " ").strip()
    if symbol == "silence":
        return " ".join(sentence.replace("<SIL>", "").split())
    if symbol == "_EOW":
        return sentence.replace(" ", "").replace("_EOW", " ").strip()
    if symbol in ("subword_nmt", "@@ ", "@@"):
        marker = "@@ " if symbol == "subword_nmt" else symbol
        return (sentence + " ").replace(marker, "").rstrip()
    raise UserError(f"--post-process {symbol}: unknown; choose from {', '.join(POST_PROCESS_CHOICES)}")


def base2(score: float) -> float:
    """A natural-log score in base 2, rounded through float32 as fairseq's tensors are."""
    return (torch.tensor(score, dtype=torch.float32) / math.log(2)).item()


def hypothesis_lines(
    sample_id: int,
    hypos: List[Dict],
    nbest: int,
    dictionary,
    tokenizer,
    symbol: Optional[str],
    decode_ids: Optional[Callable[[torch.Tensor], str]] = None,
) -> List[str]:
    """``decode_ids``: the D- text from the ids themselves (an imported model's own tokenizer), else the
    H- tokens decoded by the data-bin's BPE."""
    lines = []
    for hypo in hypos[:nbest]:
        hypo_str = post_process(dictionary.string(hypo["tokens"]), symbol)
        if decode_ids is not None:
            detok = decode_ids(hypo["tokens"])
        else:
            detok = tokenizer.decode(hypo_str) if tokenizer is not None else hypo_str
        score = base2(hypo["score"])
        positional = (hypo["positional_scores"].float() / math.log(2)).tolist()
        lines.append(f"H-{sample_id}\t{score}\t{hypo_str}")
        lines.append(f"D-{sample_id}\t{score}\t{detok}")
        lines.append(f"P-{sample_id}\t" + " ".join(f"{x:.4f}" for x in positional))
    return lines
