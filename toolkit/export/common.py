"""What every export shares: the loaded model, step progress, optional packages, the data-bin files.

Progress is per step (load, convert, write, check): a tqdm bar on a terminal, one log line per
step otherwise, so a long export into a log file still says where it is.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Dict, List

import torch

from toolkit.config.commands import DTYPE_NAMES
from toolkit.core.errors import UserError, require  # noqa: F401  (the exporters' optional packages)
from toolkit.logging.step_progress import StepProgress  # noqa: F401  (the exporters' progress)
from toolkit.tokenizers import BPE_JSON

logger = logging.getLogger("toolkit.export")

DTYPES: Dict[str, torch.dtype] = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))
"""``--dtype``'s names (declared torch-free for the parser) as torch dtypes."""


@dataclass
class LoadedModel:
    """A checkpoint's model (eval mode, fp32, CPU) with what rebuilds it elsewhere."""

    model: torch.nn.Module
    task: object
    args: object
    path: str

    @property
    def dictionary(self):
        return self.task.dictionary

    @property
    def first_symbol(self) -> int:
        """What our LMs see before a sentence's first token: </s> (fairseq), or <s> with --add-bos-token."""
        d = self.dictionary
        return d.bos() if self.task.cfg.add_bos_token else d.eos()

    @property
    def data_dir(self) -> str:
        """The folder with the model's dictionary and tokenizer (a --data-mixture run's first source)."""
        return self.task.model_files_dir()


def data_bin_files(data_dir: str) -> List[str]:
    """``dict.txt`` and the tokenizer record with its model files (see ``toolkit.tokenizers``)."""
    import json

    files = ["dict.txt"]
    record_path = os.path.join(data_dir, BPE_JSON)
    if os.path.isfile(record_path):
        files.append(BPE_JSON)
        with open(record_path, encoding="utf-8") as f:
            files += list(json.load(f).get("files", {}).values())
    return files


def copy_data_bin_files(data_dir: str, out_dir: str) -> List[str]:
    """Copy the dictionary and BPE model beside the weights, so the folder is self-contained."""
    copied = []
    for name in data_bin_files(data_dir):
        src = os.path.join(data_dir, name)
        if not os.path.isfile(src):
            raise UserError(f"{src}: listed in the data-bin but missing; re-run toolkit-preprocess")
        shutil.copyfile(src, os.path.join(out_dir, name))
        copied.append(name)
    return copied
