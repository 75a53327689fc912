"""toolkit-train: train a language model, fairseq-style.

    toolkit-train data-bin/wikitext-103 --task language_modeling --arch transformer_lm \
        --optimizer adam --lr 0.0005 --max-tokens 2048 --max-update 1000

``--config FILE.yaml`` reads fairseq's YAML layout (the flags given after it win; see
:mod:`toolkit.compat.fairseq.train_config`). This module only parses, resolves and launches; the loop
is :mod:`toolkit.train.train_loop`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional

from toolkit.train.arguments import parse_train_args
from toolkit.train.config_file import expand_config_flag
from toolkit_cli.command import one_line_errors

PROG = "toolkit-train"


def cli_main(argv: Optional[List[str]] = None, prog: str = PROG) -> None:
    with one_line_errors(prog, also=(FloatingPointError,), interrupted="interrupted before the first update"):
        argv = expand_config_flag(sys.argv[1:] if argv is None else argv)  # --config FILE.yaml: its flags first
        # --help and every argument error exit here, before torch is imported (the imports below bring it)
        args, explicit = parse_train_args(argv, prog=prog, description="Train a language model.")
        from toolkit.distributed import launch
        from toolkit.logging.setup import setup_logging
        from toolkit.train.resolve import resolve_and_log
        from toolkit.train.train_loop import train

        # The resolver's choices are logged once (by rank 0 under torchrun, task 0 under srun), before any
        # worker starts.
        setup_logging(None, rank=int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0))
        cfg = resolve_and_log(args, explicit)
        if cfg.common.plan:  # before the workers start: the prediction, then the measured MFU in the log
            from toolkit.plan import summary_for_train  # the planner only when asked (--plan)

            logging.getLogger("toolkit_cli.train").info(summary_for_train(cfg))
        launch.run(train, cfg)


if __name__ == "__main__":
    cli_main()
