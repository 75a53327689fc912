"""toolkit-eval-lm: perplexity of trained language models on a data-bin split (fairseq-eval-lm's flags).

    toolkit-eval-lm data-bin/wikitext-103 --path checkpoints/checkpoint_best.pt \
        --batch-size 2 --tokens-per-sample 512 --context-window 400

``--tokens-per-sample`` counts the context, as in fairseq: here each block scores 112
new tokens after up to 400 earlier ones. ``--path`` also reads fairseq's own
``transformer_lm`` checkpoints. The work is in :mod:`toolkit.inference.eval_lm_main`.
"""

from __future__ import annotations

from typing import List, Optional

from toolkit.config.commands import EvalLMConfig
from toolkit_cli.command import run_command

PROG = "toolkit-eval-lm"


def main(cfg: EvalLMConfig):
    from toolkit.inference.eval_lm_main import main  # torch: after parsing (--help and argument errors exit first)

    return main(cfg)


def cli_main(argv: Optional[List[str]] = None) -> None:
    run_command(
        PROG,
        EvalLMConfig,
        main,
        argv,
        "Evaluate a language model's perplexity (--post-process/--remove-bpe [subword_nmt]: merge BPE).",
    )


if __name__ == "__main__":
    cli_main()
