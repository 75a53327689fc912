"""``toolkit-preprocess``: build a fairseq data-bin for language modeling.

    toolkit-preprocess --only-source --trainpref wiki.train.tokens --validpref wiki.valid.tokens \\
        --testpref wiki.test.tokens --destdir data-bin/wikitext-2 --workers 4
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from toolkit.config.commands import PreprocessConfig
from toolkit.config.options import config_from_args, parse_with_components
from toolkit.core.registry import TOKENIZER_REGISTRY

from toolkit_cli.command import one_line_errors

if TYPE_CHECKING:
    from toolkit.data.preprocess import PreprocessResult

PROG = "toolkit-preprocess"


def parse(argv: Optional[List[str]] = None) -> Tuple[PreprocessConfig, Optional[str], Any, argparse.Namespace]:
    """The options, the ``--bpe`` name and its options: ``--help`` and argument errors exit here, before torch."""
    args = parse_with_components(
        PROG,
        [PreprocessConfig],
        argv,
        selectors=(TOKENIZER_REGISTRY,),
        arch=False,
        description="Build a fairseq data-bin (dict.txt + mmap .bin/.idx) for language modeling.",
    )
    cfg = config_from_args(PreprocessConfig, args)
    bpe_cfg = None
    if args.bpe is not None:
        bpe_cfg = config_from_args(TOKENIZER_REGISTRY.get(args.bpe).config, args)
    return cfg, args.bpe, bpe_cfg, args


def run(cfg: PreprocessConfig, bpe: Optional[str], bpe_cfg: Any, args: argparse.Namespace) -> PreprocessResult:
    if cfg.chat_template:
        from toolkit.data.chat_preprocess import preprocess_chat

        return preprocess_chat(cfg, bpe, args=args)
    from toolkit.data.preprocess import preprocess

    return preprocess(cfg, bpe, bpe_cfg, args=args)


def main(argv: Optional[List[str]] = None) -> PreprocessResult:
    return run(*parse(argv))


def cli_main(argv: Optional[List[str]] = None) -> None:
    # Ctrl-C: the temporary folder is already removed (atomic_directory)
    with one_line_errors(PROG, interrupted="interrupted; nothing was written to --destdir (run the command again)"):
        parsed = parse(argv)  # --help and argument errors exit here, before torch is imported
        from toolkit.logging.setup import DATE_FORMAT, LOG_FORMAT

        logging.basicConfig(
            format=LOG_FORMAT, datefmt=DATE_FORMAT, level=os.environ.get("LOGLEVEL", "INFO").upper(), stream=sys.stdout
        )
        run(*parsed)


if __name__ == "__main__":
    cli_main()
