"""``toolkit-train --config FILE.yaml`` and ``toolkit-hydra-train``: a fairseq config as toolkit-train's argv.

Both give the flags of :func:`toolkit.compat.fairseq.yaml_config.config_to_argv` followed by the
user's own flags, so flags given on the command line win over the file (argparse keeps the last
value) and the run resolves through the same parser as typed flags.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from toolkit.compat.fairseq import yaml_config

PROG = "toolkit-train"


def train_argv(config: Dict, source: str, choices: Optional[Dict[str, str]] = None) -> List[str]:
    """The toolkit-train argv equivalent to the fairseq-layout ``config`` read from ``source``."""
    from toolkit import options
    from toolkit.config import TRAIN_CONFIGS
    from toolkit.resolve import implied_selectors

    def build_parser(selectors: List[str]):
        return options.build_parser(PROG, TRAIN_CONFIGS, selectors, imply=implied_selectors)[0]

    return yaml_config.config_to_argv(config, source, PROG, build_parser, choices)


def expand_config_flag(argv: Sequence[str]) -> List[str]:
    """``argv`` with ``--config FILE.yaml`` replaced by the file's flags (the rest after them)."""
    yaml_config.check_no_overrides(argv, PROG)
    path, rest = yaml_config.split_config_flag(argv)
    if path is None:
        return list(argv)
    return train_argv(yaml_config.load_config_file(path), path) + rest


def hydra_train_argv(config_dir: Optional[str], config_name: str, overrides: Sequence[str]) -> List[str]:
    """fairseq-hydra-train's ``--config-dir DIR --config-name NAME key=value ...`` as toolkit-train's argv."""
    from toolkit.compat.fairseq.hydra_compose import compose

    config, choices = compose(config_dir, config_name, overrides)
    return train_argv(config, f"{config_dir}/{config_name}.yaml" if config_dir else "the overrides", choices)
