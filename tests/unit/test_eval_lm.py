"""toolkit-eval-lm reproduces fairseq-eval-lm's block, context and counting arithmetic.

The reference scores every token with an explicit loop over the split: each block's
input is built by hand (the context is the last tokens of everything fed before it,
at most ``context_window``, and at most what fits in ``tokens_per_sample`` with the
block), and the logits come from a direct forward pass over fairseq-named weights
(tests/helpers/fairseq_layout.py), not from the toolkit's model.
"""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import pytest
import torch

from tests.helpers.eval_lm_setup import LINES, MAX_POS, make_eval_lm_files
from tests.helpers.fairseq_layout import (
    fairseq_main_checkpoint,
    model_options,
    random_fairseq_model,
    reference_logits,
    task_options,
)
from tests.helpers.lm_fixtures import make_data_bin
from toolkit.core.errors import UserError
from toolkit.inference.eval_lm_main import EvalLMConfig, main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_eval_lm_files(tmp_path_factory.mktemp("evallm"))


def split_lines(dictionary, lines):
    return [dictionary.encode_line(line, append_eos=True).long().tolist() for line in lines]


def reference(sd, dictionary, lines, tokens_per_sample, context_window, break_mode="none", add_bos=False):
    """(sum of natural-log scores, count) by fairseq-eval-lm's rules, one block at a time."""
    eos, bos = dictionary.eos(), dictionary.bos()
    items = split_lines(dictionary, lines)
    stream = [t for item in items for t in item]
    block = tokens_per_sample - context_window if context_window else tokens_per_sample
    if break_mode == "none":
        bounds = [(s, min(s + block, len(stream))) for s in range(0, len(stream), block)]
    else:  # eos: one line per block
        starts = np.cumsum([0] + [len(i) for i in items])
        bounds = [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]
    history, total, count = [], 0.0, 0
    for s, e in bounds:
        inputs = ([eos] if s == 0 or break_mode == "eos" else [stream[s - 1]]) + stream[s : e - 1]
        targets = stream[s:e]
        if add_bos:
            inputs, targets = [bos] + inputs, [bos] + targets
        keep = min(context_window, tokens_per_sample - len(inputs), len(history)) if context_window else 0
        context = history[len(history) - keep :] if keep > 0 else []
        row = torch.tensor([context + inputs])
        logp = torch.log_softmax(reference_logits(sd, row, heads=2, pad=1, learned=True, tied=False)[0], -1)
        scores = [logp[len(context) + j, t].item() for j, t in enumerate(targets)]
        if add_bos:
            scores = scores[1:]
        total += sum(scores)
        count += len(scores)
        history += inputs
    return total, count


@pytest.mark.parametrize("tokens_per_sample,context_window", [(8, 0), (8, 3), (12, 11), (MAX_POS, 30), (5, 1)])
def test_perplexity_matches_fairseq_arithmetic(setup, tokens_per_sample, context_window):
    data, path, sd, dictionary = setup
    result = main(
        EvalLMConfig(
            data=data, path=path, tokens_per_sample=tokens_per_sample, context_window=context_window, batch_size=3
        )
    )
    total, count = reference(sd, dictionary, LINES, tokens_per_sample, context_window)
    assert result["count"] == count == sum(len(x) for x in split_lines(dictionary, LINES))
    assert result["loss"] == pytest.approx(-total / count / math.log(2), rel=1e-5)


@pytest.mark.parametrize(
    "break_mode,add_bos,tokens_per_sample,context_window",
    [("none", True, 9, 4), ("eos", False, 20, 8), ("eos", True, 20, 8)],
)
def test_break_modes_and_bos(setup, break_mode, add_bos, tokens_per_sample, context_window):
    data, path, sd, dictionary = setup
    result = main(
        EvalLMConfig(
            data=data,
            path=path,
            tokens_per_sample=tokens_per_sample,
            context_window=context_window,
            sample_break_mode=break_mode,
            add_bos_token=add_bos,
            max_tokens=64,
        )
    )
    total, count = reference(sd, dictionary, LINES, tokens_per_sample, context_window, break_mode, add_bos)
    assert result["count"] == count
    assert result["loss"] == pytest.approx(-total / count / math.log(2), rel=1e-5)


def test_batching_softmax_batch_and_shards_do_not_change_sums(setup):
    data, path, _, _ = setup
    base = main(EvalLMConfig(data=data, path=path, tokens_per_sample=10, context_window=4, batch_size=1))
    other = main(
        EvalLMConfig(data=data, path=path, tokens_per_sample=10, context_window=4, max_tokens=30, softmax_batch=5)
    )
    assert other["loss"] == pytest.approx(base["loss"], rel=1e-6) and other["count"] == base["count"]
    halves = [
        main(EvalLMConfig(data=data, path=path, tokens_per_sample=10, batch_size=2, num_shards=2, shard_id=i))
        for i in (0, 1)
    ]
    whole = main(EvalLMConfig(data=data, path=path, tokens_per_sample=10, batch_size=2))
    assert halves[0]["count"] + halves[1]["count"] == whole["count"]
    assert 0 < halves[0]["count"] < whole["count"]


def test_progress_counts_against_the_shards_batches(setup, caplog):
    """The progress line reads "i / total" with the total of this shard's batches (not "i / 0")."""
    data, path, _, _ = setup
    with caplog.at_level(logging.INFO):
        main(
            EvalLMConfig(
                data=data,
                path=path,
                tokens_per_sample=10,
                batch_size=1,
                log_format="simple",
                log_interval=1,
                num_shards=2,
                shard_id=1,
            )
        )
    counts = [
        re.search(r"(\d+) / (\d+)", r.getMessage()).groups() for r in caplog.records if r.name.endswith("progress_bar")
    ]
    totals = {int(total) for _, total in counts}
    assert len(totals) == 1 and int(counts[-1][0]) == totals.pop() > 1, counts


def test_remove_bpe_merges_continuations(tmp_path):
    lines = ["th@@ e cat s@@ at", "a d@@ o@@ g ran"] * 4
    data = str(tmp_path / "bpe")
    dictionary = make_data_bin(data, {"train": lines, "test": lines})
    sd = random_fairseq_model(V=len(dictionary), max_pos=MAX_POS, seed=5)
    path = str(tmp_path / "m.pt")
    torch.save(fairseq_main_checkpoint(sd, model_options(max_pos=MAX_POS), task_options(data, MAX_POS)), path)
    # one line per block: no continuation ends a block (fairseq leaves a block's last token unmerged)
    plain = main(EvalLMConfig(data=data, path=path, tokens_per_sample=MAX_POS, sample_break_mode="eos"))
    merged = main(
        EvalLMConfig(
            data=data,
            path=path,
            tokens_per_sample=MAX_POS,
            sample_break_mode="eos",
            post_process="subword_nmt",
            output_word_stats=True,
            output_word_probs=True,
        )
    )
    continuations = sum(line.count("@@") for line in lines)
    assert merged["count"] == plain["count"] - continuations
    total = -plain["loss"] * plain["count"] * math.log(2)  # the same scores, summed over fewer words
    assert merged["loss"] == pytest.approx(-total / merged["count"] / math.log(2), rel=1e-5)


@pytest.mark.parametrize(
    "tokens_per_sample,context_window,message",
    [(8, 8, "must be smaller than --tokens-per-sample"), (64, 8, "longer than the model's 40 positions")],
)
def test_bad_window_is_one_line(setup, tokens_per_sample, context_window, message):
    data, path, _, _ = setup
    with pytest.raises(UserError) as e:
        main(EvalLMConfig(data=data, path=path, tokens_per_sample=tokens_per_sample, context_window=context_window))
    assert message in str(e.value) and "\n" not in str(e.value)
