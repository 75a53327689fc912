"""toolkit-hydra-train: fairseq-hydra-train's command line.

    toolkit-hydra-train --config-dir configs --config-name wiki103 \
        task.data=data-bin/wikitext-103 optimization.max_update=1000 model=transformer_lm/2_layers

The composed config (Hydra: ``pip install hydra-core``) becomes toolkit-train's flags
(:mod:`toolkit.compat.fairseq.train_config`) and trains as toolkit-train does.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from toolkit.train.config_file import hydra_train_argv
from toolkit.logging.setup import setup_logging
from toolkit.config.options import OneLineErrorParser
from toolkit_cli import train as train_cli
from toolkit_cli.command import one_line_errors

PROG = "toolkit-hydra-train"


def parse(argv: List[str]) -> argparse.Namespace:
    parser = OneLineErrorParser(prog=PROG, description="Train from a fairseq-layout Hydra config.", allow_abbrev=False)
    parser.add_argument(
        "--config-dir",
        "--config-path",
        "-cd",
        "-cp",
        dest="config_dir",
        default=None,
        help="folder holding NAME.yaml and its group folders (model/, task/, ...); without it the "
        "overrides alone make the config (group=name names the component)",
    )
    parser.add_argument(
        "--config-name", "-cn", default="config", help="the config file, without .yaml (default: %(default)s)"
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="key=value (optimization.max_update=100), group=option "
        "(model=transformer_lm/2_layers), +key=value adds a key",
    )
    return parser.parse_args(argv)


def cli_main(argv: Optional[List[str]] = None) -> None:
    args = parse(list(sys.argv[1:] if argv is None else argv))
    setup_logging(None, rank=int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0))
    with one_line_errors(PROG):
        train_argv = hydra_train_argv(args.config_dir, args.config_name, args.overrides)
    train_cli.cli_main(train_argv, prog=PROG)


if __name__ == "__main__":
    cli_main()
