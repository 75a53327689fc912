"""fairseq's documented wikitext-103 adaptive-input command (examples/language_model/README.adaptive_inputs.md),
verbatim, and the same command shrunk to a tiny model: toolkit-train must accept what fairseq's README prints."""

from __future__ import annotations

import re
import shlex

README_COMMAND = """fairseq-train --task language_modeling \
    data-bin/wikitext-103 \
    --save-dir checkpoints/transformer_wikitext-103 \
    --arch transformer_lm_wiki103 \
    --max-update 286000 --lr 1.0 --t-mult 2 --lr-period-updates 270000 --lr-scheduler cosine --lr-shrink 0.75 \
    --warmup-updates 16000 --warmup-init-lr 1e-07 --stop-min-lr 1e-09 --optimizer nag --min-lr 0.0001 --clip-norm 0.1 \
    --criterion adaptive_loss --max-tokens 3072 --update-freq 3 --tokens-per-sample 3072 --seed 1 \
    --sample-break-mode none --skip-invalid-size-inputs-valid-test --ddp-backend=legacy_ddp"""
TINY = [
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "64",
    "--decoder-attention-heads",
    "2",
    "--adaptive-input-cutoff",
    "20,60",
    "--adaptive-softmax-cutoff",
    "20,60",
    "--cpu",
    "--log-format",
    "json",
    "--log-interval",
    "1",
]


def readme_argv(data: str, save_dir: str, *drop: str) -> list:
    """The README's command, binary name dropped, sizes shrunk (2 updates, 64-token blocks, a tiny model)."""
    text = README_COMMAND.replace("data-bin/wikitext-103", data).replace(
        "checkpoints/transformer_wikitext-103", save_dir
    )
    text = re.sub(r"--max-update \d+", "--max-update 2", text)
    text = re.sub(r"--(max-tokens|tokens-per-sample) 3072", r"--\1 64", text)
    argv = [a for a in shlex.split(text)[1:] if a not in drop]
    return argv + TINY
