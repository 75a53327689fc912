"""What every family's ``--from hf`` import shares: the checkpoint a trainer would have written, the
``toolkit-train`` flags that rebuild the model (logged, so the user knows how to fine-tune it), and the checks
every reader makes of a folder: each tensor the model needs read from it, none NaN, each config value one that
``toolkit-train`` accepts.

Here, below ``toolkit.export``, because the families' adapters (``toolkit/models/<family>/``) build
them and models never import the export package (the layer order in ``docs/design.md``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable, Dict, Tuple

import torch

from toolkit.core.errors import UserError

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
        if value is False:  # an option on by default (or by the arch) is turned off by its --no- form
            flag = "--no-" + key.replace("_", "-")
        flags.append(flag if isinstance(value, bool) else f"{flag} {value}")
    return " ".join(flags)


# ---- what every family's reader checks: the folder holds the whole model, and nothing impossible ----


def check_every_tensor_read(
    found: Dict[str, Tuple[str, Tuple[int, ...]]],
    needed: Dict[str, Tuple[int, ...]],
    missing_from: Callable[[str], str],
) -> None:
    """Every tensor the model needs (``needed``: Hugging Face name -> shape, the model's whole state dict under
    the folder's names) is among the tensors the folder holds (``found``: name -> (file, shape)), with its
    shape. Why here, once: a reader that fills a model as tensors come (stacked experts, a row at a time) would
    otherwise leave what never came as the memory it allocated (zeros), and the import would succeed.
    ``missing_from(name)``: the file that should have held a missing tensor (the index, or the shard it names)."""
    missing = [name for name in needed if name not in found]
    if missing:
        raise UserError(
            f"{missing_from(missing[0])}: no tensor {missing[0]}"
            + (f" (and {len(missing) - 1} more of the model's {len(needed)})" if len(missing) > 1 else "")
            + "; every weight must come from the folder: download it again or save it with save_pretrained"
        )
    for name, shape in needed.items():
        path, have = found[name]
        if tuple(have) != tuple(shape):
            raise UserError(
                f"{path}: tensor {name} has shape {list(have)} where config.json makes it {list(shape)}; "
                "give the config.json saved with these weights"
            )


def check_finite(name: str, tensor: torch.Tensor, path: str) -> None:
    """A weight holding NaN or infinity computes NaN everywhere it reaches: refused at import, naming it."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise UserError(
            f"{path}: tensor {name} holds {bad} NaN/infinite value(s) of {tensor.numel()}; the model computes "
            "NaN from it: download the folder again or fix the weights"
        )


def check_option_values(config_cls: type, given: Dict[str, Any], where: str, hf_keys: Dict[str, str]) -> None:
    """Each value read from ``config.json`` passes the check ``toolkit-train`` applies to its flag (finite,
    positive, at least 1, ...: the flag's type), refused naming the config key (``hf_keys``: our option -> theirs)
    so that an impossible value stops the import, not the first update of training."""
    from toolkit.config import options

    for name, value in given.items():
        parse = options.flag_type(config_cls, name)
        if parse is None or value is None or isinstance(value, bool):
            continue
        try:
            parse(str(value))
        except argparse.ArgumentTypeError as e:
            reason = str(e).split(": ", 1)[-1]
            raise UserError(
                f"{where}: {hf_keys.get(name, name)} {value!r}: {reason}, as for toolkit-train's "
                f"{options.flag_name(name)}; give the config.json transformers saved with the model"
            ) from None
