"""``toolkit-train --config FILE.yaml`` and ``toolkit-hydra-train``: a fairseq config as toolkit-train's argv.

Both give the flags of :func:`toolkit.compat.fairseq.yaml_config.config_to_argv` followed by the
user's own flags, so flags given on the command line win over the file (argparse keeps the last
value) and the run resolves through the same parser as typed flags. That parser is toolkit-train's, a layer
above this package: callers pass it in (``build_parser(argv) -> argparse.ArgumentParser``;
:mod:`toolkit.train.config_file` does).
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Optional, Sequence

from toolkit.compat.fairseq import yaml_config

PROG = "toolkit-train"
ParserBuilder = Callable[[List[str]], argparse.ArgumentParser]


def train_argv(
    config: Dict, source: str, build_parser: ParserBuilder, choices: Optional[Dict[str, str]] = None
) -> List[str]:
    """The toolkit-train argv equivalent to the fairseq-layout ``config`` read from ``source``."""
    return yaml_config.config_to_argv(config, source, PROG, build_parser, choices)


def expand_config_flag(argv: Sequence[str], build_parser: ParserBuilder) -> List[str]:
    """``argv`` with ``--config FILE.yaml`` replaced by the file's flags (the rest after them); a DATA given
    on the command line replaces the file's ``task.data``, as a flag replaces the file's value."""
    yaml_config.check_no_overrides(argv, PROG)
    path, rest = yaml_config.split_config_flag(argv)
    if path is None:
        return list(argv)
    config = yaml_config.load_config_file(path)
    task = config.get("task")
    if isinstance(task, dict) and task.get("data") and _gives_data(config, path, rest, build_parser):
        config = dict(config, task={k: v for k, v in task.items() if k != "data"})
    return train_argv(config, path, build_parser) + rest


def _gives_data(config: Dict, path: str, rest: List[str], build_parser: ParserBuilder) -> bool:
    """Whether ``rest`` holds the positional DATA (parsed with the options of the components the file chooses)."""
    argv = yaml_config.selector_argv(config, path) + rest
    values, _ = build_parser(argv).parse_known_args(argv)
    return bool(getattr(values, "data", None))


def hydra_train_argv(
    config_dir: Optional[str], config_name: str, overrides: Sequence[str], build_parser: ParserBuilder
) -> List[str]:
    """fairseq-hydra-train's ``--config-dir DIR --config-name NAME key=value ...`` as toolkit-train's argv."""
    from toolkit.compat.fairseq.hydra_compose import compose

    config, choices = compose(config_dir, config_name, overrides)
    return train_argv(
        config, f"{config_dir}/{config_name}.yaml" if config_dir else "the overrides", build_parser, choices
    )
