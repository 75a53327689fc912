"""toolkit-train's command line, parsed without torch: ``--help`` and every argument error (an unknown flag, a
bad choice, a bad value, an unregistered ``--arch``) exit here, before the resolver and the loop import torch.

:mod:`toolkit.train.resolve` turns the parsed namespace into the one ``TrainConfig``.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence, Set, Tuple

from toolkit.config import DEFAULT_ARCH, OFFLOAD_OPTIMIZER, TRAIN_CONFIGS, implied_selectors, options  # noqa: F401


def parse_train_args(
    argv: Sequence[str], prog: str = "toolkit-train", description: Optional[str] = None
) -> Tuple[argparse.Namespace, Set[str]]:
    """The parsed flags and the options the user gave (not defaulted or implied)."""
    argv = list(argv)
    parser, full_argv = options.build_parser(
        prog, TRAIN_CONFIGS, argv, description=description, imply=implied_selectors
    )
    args, unknown = parser.parse_known_args(full_argv)
    if unknown:  # another family's model option: one line naming the family; else argparse's own error
        options.refuse_other_family_options(parser, unknown, args.arch)
        parser.parse_args(full_argv)
    return args, options.explicit_options(parser, argv)
