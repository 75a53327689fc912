"""toolkit-train's ``--config FILE.yaml`` and toolkit-hydra-train: fairseq's YAML layout read by
:mod:`toolkit.compat.fairseq.train_config`, parsed with toolkit-train's own parser (which lives in this
layer, so it is handed down rather than imported from below)."""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence

from toolkit.compat.fairseq import train_config
from toolkit.config import TRAIN_CONFIGS, options
from toolkit.train.arguments import implied_selectors


def train_parser(argv: List[str]) -> argparse.ArgumentParser:
    """toolkit-train's full parser for ``argv`` (the components it chooses, ``--cpu-offload``'s implied ones)."""
    return options.build_parser(train_config.PROG, TRAIN_CONFIGS, argv, imply=implied_selectors)[0]


def expand_config_flag(argv: Sequence[str]) -> List[str]:
    """``argv`` with ``--config FILE.yaml`` replaced by the file's flags (see ``train_config.expand_config_flag``)."""
    return train_config.expand_config_flag(argv, train_parser)


def hydra_train_argv(config_dir: Optional[str], config_name: str, overrides: Sequence[str]) -> List[str]:
    """fairseq-hydra-train's ``--config-dir DIR --config-name NAME key=value ...`` as toolkit-train's argv."""
    return train_config.hydra_train_argv(config_dir, config_name, overrides, train_parser)
