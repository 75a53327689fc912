"""toolkit-plan: predict per-rank memory and step time of a toolkit-train command, and whether it fits.

    toolkit-plan --arch transformer_lm_gpt3_13 --cpu-offload --adam-state-precision 8bit --bf16-host-grads \
        --gpu-memory 80GiB --host-memory 126GiB
    toolkit-plan --arch transformer_lm_gpt3_175 --distributed-world-size 64 --model-parallel-size 8 \
        --ddp-backend fully_sharded --checkpoint-activations --bf16 --batch-size 1 --gpu a100-80

Takes toolkit-train's flags (the data directory is optional: without it the vocabulary is the
arch's published one, or ``--vocab-size``) plus the hardware flags of ``toolkit.plan.hardware``.
Exit status 0 when the run fits, 3 when it does not, 1 on bad input.
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
        args, explicit = parse_train_args(rest, PROG)  # argument errors exit here, before torch is imported
        from toolkit.plan import make_plan, table
        from toolkit.train.resolve import resolve_and_log

        plan = make_plan(resolve_and_log(args, explicit), hw, vocab_size=vs.vocab_size)
    print(table(plan))
    sys.exit(0 if plan.fits else 3)


if __name__ == "__main__":
    cli_main()
