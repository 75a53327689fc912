"""``toolkit-preprocess``: build a fairseq data-bin for language modeling.

    toolkit-preprocess --only-source --trainpref wiki.train.tokens --validpref wiki.valid.tokens \\
        --testpref wiki.test.tokens --destdir data-bin/wikitext-2 --workers 4
"""
from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional

from toolkit.data.preprocess import PreprocessConfig, PreprocessResult, preprocess
from toolkit.logging.setup import DATE_FORMAT, LOG_FORMAT
from toolkit.config.options import config_from_args, parse_with_components
from toolkit.core.registry import TOKENIZER_REGISTRY

from toolkit_cli.command import one_line_errors

PROG = "toolkit-preprocess"


def main(argv: Optional[List[str]] = None) -> PreprocessResult:
    args = parse_with_components(PROG, [PreprocessConfig], argv, selectors=(TOKENIZER_REGISTRY,), arch=False,
                                 description="Build a fairseq data-bin (dict.txt + mmap .bin/.idx) for "
                                             "language modeling.")
    cfg = config_from_args(PreprocessConfig, args)
    bpe_cfg = None
    if args.bpe is not None:
        bpe_cfg = config_from_args(TOKENIZER_REGISTRY.get(args.bpe).config, args)
    return preprocess(cfg, args.bpe, bpe_cfg, args=args)


def cli_main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(format=LOG_FORMAT, datefmt=DATE_FORMAT,
                        level=os.environ.get("LOGLEVEL", "INFO").upper(), stream=sys.stdout)
    # Ctrl-C: the temporary folder is already removed (atomic_directory)
    with one_line_errors(PROG, interrupted="interrupted; nothing was written to --destdir (run the command again)"):
        main(argv)


if __name__ == "__main__":
    cli_main()
