"""A checkpoint only runs on the dictionary it was trained with: same symbols, same order.

Checkpoints record :meth:`Dictionary.symbols_hash` (``extra_state["dictionary_hash"]``);
resume, ``toolkit-eval-lm`` and the hub compare it with the data-bin's ``dict.txt``.
Checkpoints written before the hash existed still load, with a warning.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional

from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)

HASH_KEY = "dictionary_hash"


def dict_path_of(task) -> str:
    """The ``dict.txt`` the task's dictionary came from (the first data-bin of a ``:`` list)."""
    return os.path.join(str(task.cfg.data).split(":")[0], "dict.txt")


def saved_hash(extra_state: Optional[Dict[str, Any]]) -> Optional[str]:
    value = (extra_state or {}).get(HASH_KEY) if isinstance(extra_state, dict) else None
    return value if isinstance(value, str) else None


def check_dictionary(checkpoint: str, recorded: Optional[str], dictionary, dict_path: str) -> None:
    """Refuse a data-bin whose dictionary differs from the checkpoint's (one line naming both)."""
    if recorded is None:
        logger.warning(
            f"{checkpoint}: records no dictionary hash (written by an older version); cannot check "
            f"that {dict_path} is the dictionary it was trained with"
        )
        return
    ours = dictionary.symbols_hash()
    if recorded != ours:
        raise UserError(
            f"{checkpoint}: trained with dictionary {recorded} but {dict_path} is {ours} "
            f"(other symbols or another order); use the data-bin the checkpoint was trained on"
        )
