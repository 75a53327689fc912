"""fairseq's YAML training configs (``fairseq-hydra-train``'s layout) as ``toolkit-train`` flags.

A fairseq config groups its options: ``common``, ``distributed_training``, ``dataset``,
``optimization``, ``checkpoint``, ``ema``, and the components ``model``, ``task``, ``criterion``,
``optimizer``, ``lr_scheduler`` (each a mapping with ``_name``, or just the name). The option
names are fairseq's flag names with underscores, which are ours too, so a config becomes the
flag list that says the same thing and goes through the one parser: ``toolkit-train --config
FILE.yaml``, ``toolkit-hydra-train`` and the equivalent flags resolve to the same ``TrainConfig``
by construction, not by a second mapping that could drift.

A key we do not have is refused in one line unless its value is the one that turns the
feature off (``null``, ``false``, ``0``) or fairseq's default (fairseq writes every field when
it dumps a config), so a config never runs differently from what it says without a word.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)

HYDRA_MISSING = "toolkit-hydra-train needs Hydra: pip install hydra-core"
YAML_MISSING = "--config FILE.yaml needs a YAML reader: pip install omegaconf (or pip install pyyaml)"

# fairseq's group -> the selector flag its _name sets.
SELECTORS = {
    "task": "--task",
    "model": "--arch",
    "criterion": "--criterion",
    "optimizer": "--optimizer",
    "lr_scheduler": "--lr-scheduler",
    "bpe": "--bpe",
}
OPTION_GROUPS = ("common", "distributed_training", "dataset", "optimization", "checkpoint", "ema")
# Groups fairseq's dumped configs carry that training does not read (generation, scoring, ...).
IGNORED_GROUPS = (
    "common_eval",
    "eval_lm",
    "generation",
    "interactive",
    "scoring",
    "bmuf",
    "tokenizer",
    "job_logging_cfg",
    "simul_type",
    "hydra",
)
# fairseq options without a counterpart here whose fairseq default is inert (a dumped config has them all).
INERT_DEFAULTS: Dict[str, Any] = {
    "character_filters": "[(1, 64), (2, 128), (3, 192), (4, 256), (5, 256), (6, 256), (7, 256)]",
    "character_embedding_dim": 4,
    "char_embedder_highway_layers": 2,
    "quant_noise_scalar": 0,
    "all_gather_list_size": 16384,
    "tpu": False,
    "azureml_logging": False,
    "profile": False,
    "reset_logging": False,
    "suppress_crashes": False,
    "use_plasma_view": False,
    "plasma_path": "/tmp/plasma",
    "fp16_adam_stats": False,
    "on_cpu_convert_precision": False,
    "model_parallel_size": 1,
    "distributed_num_procs": 1,
    "distributed_rank": 0,
    "distributed_init_method": None,
    "pipeline_model_parallel": False,
    "zero_sharding": "none",
    "fast_stat_sync": False,
    "heartbeat_timeout": -1,
    "broadcast_buffers": False,
    "slowmo_momentum": None,
    "slowmo_base_algorithm": "localsgd",
    "localsgd_frequency": 3,
    "gradient_as_bucket_view": False,
    "not_fsdp_flatten_parameters": False,
    "dataset_impl": None,
    "data_buffer_size": 10,
    "checkpoint_suffix": "",
    "checkpoint_shard_count": 1,
    "load_checkpoint_on_all_dp_ranks": False,
    "write_checkpoints_asynchronously": False,
    "model_parallel": False,
    "continue_once": None,
    "use_old_adam": False,
    "sentence_avg": False,
    "seed_sample": False,
}
# A training config is hundreds of values; anchors and aliases (``&a`` / ``*a``) may repeat a part, but
# a file that expands past this many values is an alias bomb: 9 levels of 9 aliases are 9**9 values, which
# the readers (omegaconf, Hydra) copy out one by one, without bound in time and memory.
MAX_YAML_VALUES = 100_000
_INTERPOLATION = re.compile(r"\$\{([^${}]+)\}")
_NO_OP = (None, False, 0, "", [], {})


def _children(node: Any) -> List[Any]:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _expanded_values(root: Any, source: str) -> int:
    """How many values ``root`` is once its aliases are copied out (each shared node counted once, so the
    count costs the file's size, not the expansion's); a node that holds itself is refused."""
    size: Dict[int, int] = {}
    visiting = set()
    stack = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            visiting.discard(id(node))
            size[id(node)] = min(1 + sum(size[id(c)] for c in _children(node)), MAX_YAML_VALUES + 1)
            continue
        if id(node) in size:
            continue
        if id(node) in visiting:
            raise UserError(
                f"{source}: an alias refers to the value that holds it (a value that contains "
                f"itself); write the value out"
            )
        visiting.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in size)
    return size[id(root)]


def check_yaml_bounded(text: str, source: str) -> None:
    """Refuse YAML whose aliases expand past ``MAX_YAML_VALUES`` values, before any reader copies them out.
    Every YAML text the toolkit reads (``--config``, Hydra's config folder, an override's value) passes here;
    a syntax error is left to the reader, which reports it with its line."""
    try:
        import yaml
    except ImportError:
        return
    try:
        documents = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError:
        return
    total = sum(_expanded_values(d, source) for d in documents if d is not None)
    if total > MAX_YAML_VALUES:
        raise UserError(
            f"{source}: its aliases (*name) expand to more than {MAX_YAML_VALUES:,} values, which "
            f"would take unbounded time and memory to read (an alias bomb); write the config out "
            f"without nested aliases"
        )


def check_yaml_file_bounded(path: str, source: Optional[str] = None) -> None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return  # the reader reports it
    check_yaml_bounded(text, source or path)


def load_config_file(path: str) -> Dict[str, Any]:
    """``path`` read as a plain dict with ``${...}`` resolved: omegaconf if installed, else PyYAML."""
    if not os.path.isfile(path):
        raise UserError(f"--config {path}: no such file; give a YAML file in fairseq's layout (common:, task:, ...)")
    check_yaml_file_bounded(path, f"--config {path}")
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return _load_with_pyyaml(path)
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # omegaconf's parse and interpolation errors name the line or key
        raise UserError(f"--config {path}: {_first_line(e)}") from None
    return _check_mapping(data, path)


def _load_with_pyyaml(path: str) -> Dict[str, Any]:
    try:
        import yaml
    except ImportError:
        raise UserError(YAML_MISSING) from None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise UserError(f"--config {path}: {_first_line(e)} {getattr(e, 'problem_mark', '') or ''}".strip()) from None
    return resolve_interpolations(_check_mapping(data, path), path)


def _check_mapping(data: Any, path: str) -> Dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"--config {path}: expected a mapping of groups (common:, task:, model:, ...), got a {type(data).__name__}"
        )
    defaults = [d for d in data.get("defaults") or [] if not (isinstance(d, dict) and None in d.values())]
    if defaults:
        raise UserError(
            f"--config {path}: its 'defaults:' list composes other files, which needs Hydra: run "
            f"toolkit-hydra-train --config-dir {os.path.dirname(path) or '.'} --config-name "
            f"{os.path.splitext(os.path.basename(path))[0]}"
        )
    data.pop("defaults", None)
    return data


def resolve_interpolations(data: Dict[str, Any], source: str) -> Dict[str, Any]:
    """``${group.key}`` replaced by that value (typed when it is the whole string), as omegaconf does."""

    def lookup(dotted: str, seen: Tuple[str, ...]) -> Any:
        if dotted in seen:
            raise UserError(f"{source}: ${{{dotted}}} refers to itself")
        node: Any = data
        for part in dotted.strip().split("."):
            if not isinstance(node, dict) or part not in node:
                raise UserError(f"{source}: ${{{dotted}}}: no key {dotted!r} in the config")
            node = node[part]
        return resolve(node, seen + (dotted,))

    def resolve(value: Any, seen: Tuple[str, ...] = ()) -> Any:
        if isinstance(value, dict):
            return {k: resolve(v, seen) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, seen) for v in value]
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _INTERPOLATION.fullmatch(value)
        if whole:
            return lookup(whole.group(1), seen)
        return _INTERPOLATION.sub(lambda m: str(lookup(m.group(1), seen)), value)

    return resolve(data)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def selector_argv(config: Dict[str, Any], source: str, choices: Optional[Dict[str, str]] = None) -> List[str]:
    """The component flags (``--task``, ``--arch``, ...) and ``--user-dir``: they decide which options exist."""
    argv: List[str] = []
    for group, flag in SELECTORS.items():
        name = component_name(config.get(group), group, source, (choices or {}).get(group))
        if name is not None:
            argv += [flag, name]
    user_dir = (config.get("common") or {}).get("user_dir")
    if user_dir:
        argv += ["--user-dir", str(user_dir)]
    return argv


def component_name(section: Any, group: str, source: str, choice: Optional[str]) -> Optional[str]:
    """``criterion: cross_entropy`` or ``criterion: {_name: cross_entropy, ...}``; a model without ``_name``
    is named by the Hydra choice that composed it (``model=transformer_lm/transformer_lm_gpt``)."""
    if section is None:
        return None
    if isinstance(section, str):
        return section
    if not isinstance(section, dict):
        raise UserError(f"{source}: {group}: expected a name or a mapping with _name, got {section!r}")
    if section.get("_name"):
        return str(section["_name"])
    if choice:
        return choice.split("/")[-1]
    if group == "model" and section:
        raise UserError(f"{source}: model: no _name; add '_name: transformer_lm' (or the architecture) to it")
    return None


def option_argv(config: Dict[str, Any], parser: argparse.ArgumentParser, source: str) -> List[str]:
    """Every option of every group as the flag that sets it; unknown keys refused (see the module doc)."""
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    argv: List[str] = []
    ignored = []
    for group, section in config.items():
        if group in IGNORED_GROUPS:
            ignored.append(group)
            continue
        if group not in OPTION_GROUPS and group not in SELECTORS:
            raise UserError(
                f"{source}: unknown group {group!r}; fairseq's groups are {', '.join(OPTION_GROUPS + tuple(SELECTORS))}"
            )
        if not isinstance(section, dict):
            if group in SELECTORS:
                continue
            raise UserError(f"{source}: {group}: expected a mapping of options, got {section!r}")
        for key, value in section.items():
            if key == "_name" or (group == "common" and key == "user_dir"):
                continue
            action = actions.get(key)
            if action is None:
                _check_unknown(group, key, value, source)
                continue
            argv += _flag(action, value)
    if ignored:
        logger.info(f"{source}: accepted, not read by training (no effect): {', '.join(ignored)}")
    return argv


def _check_unknown(group: str, key: str, value: Any, source: str) -> None:
    if value in _NO_OP or (key in INERT_DEFAULTS and INERT_DEFAULTS[key] == value):
        return
    raise UserError(
        f"{source}: {group}.{key}={value!r}: toolkit-train has no --{key.replace('_', '-')}; remove "
        f"the key (or set it to null) to train without it"
    )


def _flag(action: argparse.Action, value: Any) -> List[str]:
    """The argv that gives ``action`` this value (nothing for a null: the default stays)."""
    if not action.option_strings:  # the positional DATA
        return [] if value in (None, "") else [str(value)]
    flag = action.option_strings[0]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [] if value is None else [flag if value else "--no-" + flag[2:]]
    if isinstance(action, argparse._StoreTrueAction):
        return [flag] if value else []
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        if action.dest in ("lr", "update_freq") or action.type is not str:
            return [flag, ",".join(str(v) for v in value)]
        return [flag, str(tuple(value))]  # --adam-betas [0.9, 0.98] -> "(0.9, 0.98)"
    return [flag, str(value).lower() if isinstance(value, bool) else str(value)]


def config_to_argv(
    config: Dict[str, Any], source: str, prog: str, build_parser, choices: Optional[Dict[str, str]] = None
) -> List[str]:
    """The ``toolkit-train`` argv equivalent to ``config``; ``build_parser(argv)`` gives the parser for
    the components those flags choose (the same two-pass parser toolkit-train uses)."""
    selectors = selector_argv(config, source, choices)
    parser = build_parser(selectors)
    return selectors + option_argv(config, parser, source)


def split_config_flag(argv: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """``--config FILE`` (or ``--config=FILE``) taken out of ``argv``."""
    rest: List[str] = []
    path = None
    i = 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise UserError("--config: expected a YAML file after it")
            path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


OVERRIDE = re.compile(r"^[+~]*(" + "|".join(OPTION_GROUPS + tuple(SELECTORS) + IGNORED_GROUPS) + r")(\.[\w.]+)?=")


def check_no_overrides(argv: Sequence[str], prog: str) -> None:
    """fairseq-hydra-train's ``key=value`` overrides given to toolkit-train would be read as DATA."""
    previous = ""
    for arg in argv:
        # A bare group=value right after an option may be that option's value (--data-mixture dataset=...:1).
        bare_after_option = previous.startswith("-") and "." not in arg.split("=", 1)[0]
        previous = arg
        if OVERRIDE.match(arg) and not bare_after_option and not os.path.exists(arg):
            raise UserError(
                f"{arg}: a Hydra override (key=value) is not a toolkit-train argument; run "
                f"toolkit-hydra-train --config-dir DIR --config-name NAME {arg} ..., or give "
                f"toolkit-train --config FILE.yaml and flags"
            )
