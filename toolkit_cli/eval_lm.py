"""toolkit-eval-lm: perplexity of trained language models on a data-bin split (fairseq-eval-lm's flags).

    toolkit-eval-lm data-bin/wikitext-103 --path checkpoints/checkpoint_best.pt \
        --batch-size 2 --tokens-per-sample 512 --context-window 400

``--tokens-per-sample`` counts the context, as in fairseq: here each block scores 112
new tokens after up to 400 earlier ones. ``--path`` also reads fairseq's own
``transformer_lm`` checkpoints.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from toolkit.config import options
from toolkit.core.errors import UserError
from toolkit.inference.eval_lm_main import EvalLMConfig, main

PROG = "toolkit-eval-lm"


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    argv = options.fill_optional_values(list(sys.argv[1:] if argv is None else argv))  # bare: subword_nmt
    return options.parse_with_components(PROG, [EvalLMConfig], argv, selectors=(), arch=False,
                                         description="Evaluate a language model's perplexity "
                                                     "(--post-process/--remove-bpe [subword_nmt]: merge BPE).")


def cli_main(argv: Optional[List[str]] = None) -> None:
    args = parse(argv)
    try:
        main(options.config_from_args(EvalLMConfig, args))
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
