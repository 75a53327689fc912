"""toolkit-plan: predict per-rank memory and step time of a toolkit-train command, whether it fits, and the fastest
layouts that fit.

    toolkit-plan --arch transformer_lm_gpt3_13 --cpu-offload --adam-state-precision 8bit --bf16-host-grads \
        --gpu-memory 80GiB --host-memory 126GiB
    toolkit-plan --arch qwen3_30b_a3b --tokens-per-sample 32768 --bf16 --distributed-world-size 8 \
        --gpu h100 --host-memory 2TiB

Takes toolkit-train's flags (the data directory is optional: without it the vocabulary is the
arch's published one, or ``--vocab-size``) plus the hardware flags of ``toolkit.plan.hardware``
(host memory: this machine's unless ``--host-memory`` says otherwise). After the plan of the command as
given, it searches every layout toolkit-train takes for the same model, world and update
(``toolkit.plan.search``) and prints the fastest that fit with the flags to add.
Exit status 0 when the run as given fits, 3 when it does not, 1 on bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

from toolkit.config.options import OneLineErrorParser
from toolkit.core.errors import UserError
from toolkit.plan.hardware import add_hardware_args, hardware_from_args, split_hardware_args
from toolkit.train.arguments import parse_train_args
from toolkit_cli.command import one_line_errors

PROG = "toolkit-plan"


def cli_main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        help_parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], add_help=False)
        add_hardware_args(help_parser)
        help_parser.add_argument("--vocab-size", type=int, help="dictionary size when no data directory is given")
        help_parser.print_help()
        print("\nand every toolkit-train flag (toolkit-train --help)")
        return
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    vocab = OneLineErrorParser(prog=PROG, add_help=False, allow_abbrev=False)
    vocab.add_argument("--vocab-size", type=int, default=None)
    with one_line_errors(PROG):
        ns, rest = split_hardware_args(argv)
        vs, rest = vocab.parse_known_args(rest)
        if vs.vocab_size is not None and vs.vocab_size < 1:
            raise UserError(f"--vocab-size {vs.vocab_size}: must be positive")
        hw = hardware_from_args(ns)
        logging.getLogger("toolkit").setLevel(logging.ERROR)  # resolve's choices are for training runs
        if "--cpu-offload" in rest and not any(a.startswith("--ddp-backend") for a in rest):
            print("--cpu-offload: planning with --ddp-backend fully_sharded (toolkit-train needs it given)")
            rest = ["--ddp-backend", "fully_sharded"] + rest
        parse_train_args(rest, PROG)  # argument errors exit here, before torch is imported
        from toolkit.plan.report import layouts, table
        from toolkit.plan.search import plan_command

        plan, found = plan_command(rest, hw, vs.vocab_size, PROG)
    print(table(plan, found))
    print(layouts(plan, found))
    sys.exit(0 if plan.fits else 3)


if __name__ == "__main__":
    cli_main()
