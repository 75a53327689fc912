"""fairseq's ``options`` module, which users import as ``from toolkit import options`` (``toolkit.options``
re-exports this one).

The toolkit's parsers live in :mod:`toolkit.config.options` (re-exported here); this module adds
fairseq's ``get_training_parser`` / ``get_eval_lm_parser`` / ``parse_args_and_arch``. Library code imports the
layered modules, never this one.

Why: fairseq scripts build their command line with
``args = options.parse_args_and_arch(options.get_training_parser(), input_args)``, often after
adding their own ``parser.add_argument(...)``. The toolkit's command line is generated in two
passes from the chosen components (:func:`toolkit.config.options.build_parser`); the parser returned
here holds the first pass and remembers what the script added, and ``parse_args_and_arch`` does
the second pass (task, arch, criterion, optimizer options, the architecture's values as
defaults) with the script's arguments replayed on it.
"""

from __future__ import annotations

from toolkit.config.options import (  # noqa: F401
    OneLineErrorParser,
    add_dataclass_options,
    architecture_defaults,
    build_parser,
    config_from_args,
    explicit_options,
    fill_optional_values,
    flag_name,
    given_options,
    parse_with_components,
)

import argparse
import sys
from typing import Any, Callable, List, Optional, Sequence

from toolkit.config import TRAIN_CONFIGS, implied_selectors, options
from toolkit.config.commands import EvalLMConfig
from toolkit.core import registry


class FairseqParser(options.OneLineErrorParser):
    """A first-pass parser of one command; ``add_argument`` calls made on it are kept and replayed."""

    def __init__(
        self,
        prog: str,
        configs: Sequence[type],
        arch: bool,
        selectors: Sequence[registry.Registry],
        imply: Optional[Callable] = None,
    ):
        super().__init__(prog=prog, allow_abbrev=False)
        self.toolkit_configs, self.toolkit_arch = tuple(configs), arch
        self.toolkit_selectors, self.toolkit_imply = tuple(selectors), imply
        self.user_arguments: List[Any] = []
        options._selectors(self, selectors, arch)
        for config in configs:
            options.add_dataclass_options(self, config)
        self._recording = True

    def add_argument(self, *args: Any, **kwargs: Any):
        action = super().add_argument(*args, **kwargs)
        if getattr(self, "_recording", False):
            self.user_arguments.append((args, kwargs))
        return action


_COMPONENTS = (
    registry.TASK_REGISTRY,
    registry.CRITERION_REGISTRY,
    registry.OPTIMIZER_REGISTRY,
    registry.LR_SCHEDULER_REGISTRY,
    registry.TOKENIZER_REGISTRY,
)


def get_training_parser(default_task: str = "language_modeling") -> FairseqParser:
    """toolkit-train's options (fairseq's ``default_task`` is ignored: ``--task`` defaults to language_modeling)."""
    return FairseqParser("toolkit-train", TRAIN_CONFIGS, True, _COMPONENTS, implied_selectors)


def get_eval_lm_parser(default_task: str = "language_modeling") -> FairseqParser:
    """toolkit-eval-lm's options, ``--post-process/--remove-bpe [subword_nmt]`` included."""
    return FairseqParser("toolkit-eval-lm", (EvalLMConfig,), False, ())


def parse_args_and_arch(
    parser: argparse.ArgumentParser,
    input_args: Optional[Sequence[str]] = None,
    parse_known: bool = False,
    suppress_defaults: bool = False,
    modify_parser: Optional[Callable[[argparse.ArgumentParser], None]] = None,
):
    """The namespace of ``input_args`` (default ``sys.argv[1:]``) with every chosen component's options.

    ``--user-dir`` is imported first; the architecture's values are the defaults the flags override.
    ``parse_known``: ``(args, unknown)``. ``suppress_defaults``: only the options given.
    """
    if not isinstance(parser, FairseqParser):
        raise TypeError(
            "parse_args_and_arch: pass a parser from toolkit.options.get_training_parser() or get_eval_lm_parser()"
        )
    argv = options.fill_optional_values(list(sys.argv[1:] if input_args is None else input_args))
    full, argv = options.build_parser(
        parser.prog,
        parser.toolkit_configs,
        argv,
        selectors=parser.toolkit_selectors,
        arch=parser.toolkit_arch,
        imply=parser.toolkit_imply,
    )
    for args, kwargs in parser.user_arguments:
        full.add_argument(*args, **kwargs)
    if modify_parser is not None:
        modify_parser(full)
    if suppress_defaults:
        given = options.explicit_options(full, argv)
        parsed, extra = full.parse_known_args(argv)
        parsed = argparse.Namespace(**{k: v for k, v in vars(parsed).items() if k in given})
        return (parsed, extra) if parse_known else parsed
    return full.parse_known_args(argv) if parse_known else full.parse_args(argv)
