"""What every family's ``--from hf`` import shares: the checkpoint a trainer would have written, and the
``toolkit-train`` flags that rebuild the model (logged, so the user knows how to fine-tune it).

Here, below ``toolkit.export``, because the families' adapters (``toolkit/models/<family>/``) build
them and models never import the export package (the layer order in ``docs/design.md``).
"""

from __future__ import annotations

import json
import os
from typing import Dict

CHECKPOINT = "model.pt"
#: the options whose values an imported model brings as its own conventions (``model_conventions``)
CONVENTION_OPTIONS = ("add_bos_token", "tokens_per_sample", "max_target_positions")


def checkpoint(state, arch: str, given, out_dir: str, tokens_per_sample: int, add_bos_token: bool = False) -> dict:
    """``add_bos_token``: the tokenizer puts BOS first (read as the model's context, see
    ``toolkit.tasks.language_modeling.bos_as_context``)."""
    from toolkit.config import options

    cfg = {
        "task": "language_modeling",
        "arch": arch,
        "data": os.path.abspath(out_dir),
        "tokens_per_sample": tokens_per_sample,
        "sample_break_mode": "none",
        "add_bos_token": add_bos_token,
        **options.architecture_defaults(arch, given),
    }
    cfg["model_conventions"] = model_conventions(cfg)
    fresh = {
        "train_iterator": {"epoch": 1, "iterations_in_epoch": 0, "shuffle": True},
        "val_loss": None,
        "best": None,
        "trainer": {"num_updates": 0, "lr_scheduler": None, "loss_scaler": None},
        "metrics": {},
    }
    return {"cfg": cfg, "model": state, "extra_state": fresh}


def model_conventions(cfg: Dict[str, object]) -> str:
    """The model's own conventions, recorded in its checkpoint: whether its tokenizer puts BOS first, its
    context, the sample length of its import; ``toolkit-train`` takes them as defaults when it starts from the
    checkpoint (``toolkit.checkpoint.conventions``), as eval-lm, the hub and generation read its ``cfg``. JSON:
    a checkpoint's ``cfg`` holds plain values only (``weights_only=True`` loads)."""
    return json.dumps({key: cfg[key] for key in CONVENTION_OPTIONS if key in cfg}, sort_keys=True)


def training_flags(arch: str, given: Dict[str, object]) -> str:
    """The toolkit-train flags that rebuild this model (for the log: how to fine-tune it)."""
    from toolkit.config import options

    defaults = options.architecture_defaults(arch)
    flags = [f"--arch {arch}"]
    for key, value in given.items():
        follows_width = (
            key in ("decoder_input_dim", "decoder_output_dim")
            and defaults.get(key) is None
            and value == given.get("decoder_embed_dim")
        )  # None: the named archs' "same as the width"
        if defaults.get(key) == value or follows_width:
            continue
        flag = "--" + key.replace("_", "-")
        flags.append(flag if value is True else f"{flag} {value}")
    return " ".join(flags)
