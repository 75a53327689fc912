"""``fairseq-hydra-train``'s composition: ``--config-dir DIR --config-name NAME key=value ...``.

Hydra composes ``DIR/NAME.yaml`` with its ``defaults:`` list and the group choices given on the
command line (``model=transformer_lm/2_layers`` reads ``DIR/model/transformer_lm/2_layers.yaml``).
fairseq's own schema holds every option, so its overrides of keys a file does not mention still
work; a plain YAML file has no schema, so here such overrides (``task.data=...``, ``task=NAME``
without a ``DIR/task/NAME.yaml``) are applied after composition, before ``${...}`` resolves, which
gives the same result.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

from toolkit.compat.fairseq.yaml_config import (
    HYDRA_MISSING,
    SELECTORS,
    _check_mapping,
    _first_line,
    check_yaml_bounded,
    check_yaml_file_bounded,
)
from toolkit.core import yaml_syntax
from toolkit.core.errors import UserError, import_optional


def split_overrides(
    config_dir: str, overrides: Sequence[str], no_files: bool = False
) -> Tuple[List[str], List[Tuple[str, str]]]:
    """(overrides for Hydra: group choices with a file, ``+``/``~`` forms; (key, value) pairs applied after)."""
    hydra_side: List[str] = []
    after: List[Tuple[str, str]] = []
    for item in overrides:
        if "=" not in item:
            raise UserError(f"{item}: expected key=value (e.g. optimization.max_update=100)")
        key, value = item.split("=", 1)
        if no_files:
            after.append((key.lstrip("+"), value))
        elif key[:1] in "+~" or os.path.isfile(os.path.join(config_dir, key, value + ".yaml")):
            hydra_side.append(item)
        else:
            after.append((key, value))
    return hydra_side, after


def compose(
    config_dir: Optional[str], config_name: str, overrides: Sequence[str]
) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """The composed config as a plain dict (``${...}`` resolved) and Hydra's group choices.

    Without ``config_dir`` the overrides alone make the config, as fairseq's bundled defaults
    do (docs/hydra_integration.md, example 1): ``model=transformer_lm/transformer_lm_gpt`` names
    the architecture, whose registered defaults are those of fairseq's YAML file of that name.
    """
    import_optional("hydra", HYDRA_MISSING)
    from omegaconf import OmegaConf

    if config_dir is None:
        _, after = split_overrides("", overrides, no_files=True)
        cfg = OmegaConf.create({})
        try:
            for key, value in after:
                _apply(cfg, key, value)
            return _check_mapping(OmegaConf.to_container(cfg, resolve=True), "the overrides"), {}
        except Exception as e:
            raise UserError(f"the overrides: {_first_line(e)}") from None
    return _compose_dir(os.path.abspath(config_dir), config_name, overrides)


def _compose_dir(config_dir: str, config_name: str, overrides: Sequence[str]) -> Tuple[Dict[str, Any], Dict[str, str]]:
    from hydra import compose as hydra_compose, initialize_config_dir
    from omegaconf import OmegaConf

    if not os.path.isfile(os.path.join(config_dir, config_name + ".yaml")):
        raise UserError(f"--config-name {config_name}: no {config_name}.yaml in --config-dir {config_dir}")
    hydra_side, after = split_overrides(config_dir, overrides)
    source = os.path.join(config_dir, config_name + ".yaml")
    for path in yaml_syntax.yaml_files(config_dir):  # any of them may be composed in
        error = yaml_syntax.syntax_error(path)  # Hydra would name the primary config, without the line
        if error is not None:
            raise UserError(f"--config-dir {error}; fix the file")
        check_yaml_file_bounded(path)
    try:
        # Hydra 1.1's rules read fairseq's files as written ("# @package _group_" headers); its notes about
        # them are for Hydra's users, not fairseq's.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with initialize_config_dir(config_dir=config_dir, version_base="1.1", job_name="toolkit_hydra_train"):
                cfg = hydra_compose(config_name=config_name, overrides=hydra_side, return_hydra_config=True)
        choices = {
            k: v
            for k, v in OmegaConf.to_container(cfg.hydra.runtime.choices).items()
            if isinstance(v, str) and not k.startswith("hydra")
        }
        OmegaConf.set_struct(cfg, False)
        del cfg["hydra"]
        for key, value in after:
            _apply(cfg, key, value)
        data = OmegaConf.to_container(cfg, resolve=True)
    except UserError:
        raise
    except Exception as e:  # Hydra's and omegaconf's errors name the file, key or override
        raise UserError(f"{source}: {_first_line(e)}") from None
    return _check_mapping(data, source), choices


def _apply(cfg: Any, key: str, text: str) -> None:
    """``a.b=v`` sets (or adds) that key; ``task=NAME`` names the component, keeping the group's options."""
    import yaml
    from omegaconf import OmegaConf

    check_yaml_bounded(text, f"{key}={text[:40]}")
    value = yaml.safe_load(text) if text else ""
    if "." not in key and key in SELECTORS:
        value = str(value).split("/")[-1]  # model=transformer_lm/transformer_lm_gpt: the architecture
        section = cfg.get(key)
        if isinstance(section, str) or section is None:
            cfg[key] = {"_name": value}
        else:
            section["_name"] = value
        return
    OmegaConf.update(cfg, key, value, merge=False, force_add=True)
