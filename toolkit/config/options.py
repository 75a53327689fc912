"""The command line, generated from options dataclasses.

Every component declares its options once, as a dataclass whose fields carry
``metadata={"help": ...}`` (and optionally ``"choices"``, ``"positional"``).
This module turns those into argparse flags with fairseq's names
(``decoder_embed_dim`` -> ``--decoder-embed-dim``) and back into dataclasses.

Parsing happens in two passes, as in fairseq: the first pass reads which task,
architecture, criterion, optimizer, scheduler and tokenizer were chosen (and
imports ``--user-dir``); the second adds those components' options. A named
architecture's values become defaults, so the user's own flags override them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Type, TypeVar

from toolkit.config.flag_types import finite_float
from toolkit.config.foreign_flags import explain_unrecognized
from toolkit.core import registry
from toolkit.core.errors import UserError, print_error_line
from toolkit.core.registry import (
    ARCH_CONFIG_FN,
    CRITERION_REGISTRY,
    LR_SCHEDULER_REGISTRY,
    OPTIMIZER_REGISTRY,
    TASK_REGISTRY,
    TOKENIZER_REGISTRY,
    Registry,
    UnknownComponentError,
)

T = TypeVar("T")


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


# A field's flag type when it names none: no float flag takes nan or inf.
_DEFAULT_TYPES: Dict[Any, Any] = {int: int, float: finite_float, str: str}


def flag_type(config_cls: type, name: str) -> Optional[Callable[[str], Any]]:
    """The type that parses option ``name`` of ``config_cls`` from the command line (what checks its value); None
    for a flag without one (a switch, a choice, an unknown name)."""
    for f in fields(config_cls):
        if f.name == name:
            tp = _unwrap_optional(typing.get_type_hints(config_cls)[f.name])
            return None if tp is bool or f.metadata.get("choices") else f.metadata.get("type") or _DEFAULT_TYPES.get(tp)
    return None


def add_dataclass_options(parser: argparse.ArgumentParser, config_cls: type, title: Optional[str] = None) -> None:
    """Add one flag per dataclass field; a flag some other component already added is shared."""
    assert is_dataclass(config_cls), config_cls
    existing = {action.dest for action in parser._actions}
    hints = typing.get_type_hints(config_cls)
    group = parser.add_argument_group(title or config_cls.__name__)
    for f in fields(config_cls):
        if f.name in existing or f.metadata.get("cli") is False:
            continue
        tp = _unwrap_optional(hints[f.name])
        default = _field_default(f)
        kwargs: Dict[str, Any] = {"help": f.metadata.get("help", "")}
        choices = f.metadata.get("choices")
        if choices is None and typing.get_origin(tp) is typing.Literal:
            choices = list(typing.get_args(tp))
            tp = type(choices[0])
        if tp is bool:
            # --no-X where the default is on, or where a named architecture may turn it on ("negatable")
            negatable = default or f.metadata.get("negatable", False)
            kwargs["action"] = argparse.BooleanOptionalAction if negatable else "store_true"
            kwargs["default"] = default
        else:
            kwargs["type"] = f.metadata.get("type") or _DEFAULT_TYPES.get(tp, str)
            kwargs["default"] = default
            if choices is not None:
                kwargs["choices"] = choices
            kwargs["metavar"] = f.metadata.get("metavar", f.name.upper().replace("_", "-"))
        if default is not None and kwargs["help"] and "%(default)" not in kwargs["help"]:
            kwargs["help"] += " (default: %(default)s)"
        if f.metadata.get("positional"):
            kwargs.pop("default", None)
            if default is not None:
                kwargs["nargs"] = "?"
                kwargs["default"] = default
            kwargs["metavar"] = f.name.upper()
            group.add_argument(f.name, **kwargs)
        else:
            names = [flag_name(f.name)] + list(f.metadata.get("aliases", ()))
            group.add_argument(*names, dest=f.name, **kwargs)


def config_from_args(config_cls: Type[T], args: Any, **overrides: Any) -> T:
    """Build a dataclass from a namespace (or dict), ignoring keys it does not declare."""
    values = args if isinstance(args, dict) else vars(args)
    kwargs = {}
    for f in fields(config_cls):  # type: ignore[arg-type]
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return config_cls(**kwargs)


class _ArchView:
    """What an architecture function sees: the options the user gave keep their values.

    fairseq's architectures read each option with a default (``getattr``), so a value derived from
    another option follows the user's choice (``transformer_lm_gpt3_xl --decoder-embed-dim 1024``
    gets an FFN of 4096). Here assignments to given options are ignored and reads see them.
    """

    def __init__(self, cfg: Any, given: Dict[str, Any]):
        for name, value in given.items():
            setattr(cfg, name, value)
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "_given", set(given))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._given:
            setattr(self._cfg, name, value)


def architecture_defaults(arch: str, given: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The model option values a named architecture sets, around the options the user ``given``."""
    entry = registry.resolve_arch(arch)
    if entry.config is None:
        return {}
    cfg = entry.config()
    view = _ArchView(cfg, dict(given or {}))
    if arch in ARCH_CONFIG_FN:
        ARCH_CONFIG_FN[arch](view)
    return dataclasses.asdict(cfg)


def given_options(config: type, argv: Sequence[str], prog: Optional[str] = None) -> Dict[str, Any]:
    """The options of dataclass ``config`` that appear in ``argv``, with their parsed values (a bad value is
    ``prog``'s one-line error: this parse comes before the command's own)."""
    parser = OneLineErrorParser(prog=prog, add_help=False, allow_abbrev=False)
    add_dataclass_options(parser, config)
    values, _ = parser.parse_known_args(list(argv))
    given = {}
    for action in parser._actions:
        if any(a == opt or a.startswith(opt + "=") for opt in action.option_strings for a in argv):
            given[action.dest] = getattr(values, action.dest)
    return given


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the usage (ten lines for a big parser) then the error and exits 2; every command's
    parser prints only the ``prog: error: ...`` line and exits 1, as for any other bad input (``-h`` shows the
    usage)."""

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        known = [option for action in self._actions for option in action.option_strings]
        print_error_line(self.prog, explain_unrecognized(message, known))
        self.exit(1)


def _selectors(parser: argparse.ArgumentParser, selectors: Iterable[Registry], arch: bool) -> None:
    group = parser.add_argument_group("components")
    for reg in selectors:  # the help lists the names registered so far (all of them once imported)
        group.add_argument(
            reg.flag,
            default=reg.default,
            metavar=reg.kind.upper(),
            help=f"registered {reg.kind} to use: {_listed(reg.names())} (default: %(default)s)",
        )
    if arch:
        group.add_argument(
            "--arch",
            "-a",
            default=None,
            metavar="ARCH",
            help=f"model architecture: {_listed(registry.architecture_names())}",
        )
    parser.add_argument("--user-dir", default=None, help="folder of plugins to import before parsing")


def _listed(names: Sequence[str]) -> str:
    return ", ".join(sorted(names)).replace("%", "%%") or "none registered yet"


def _selected(reg: Registry, name: Optional[str]) -> Optional[type]:
    if name is None:
        return None
    return reg.get(name).config


def build_parser(
    prog: str,
    base_configs: Sequence[type],
    argv: Sequence[str],
    selectors: Sequence[Registry] = (
        TASK_REGISTRY,
        CRITERION_REGISTRY,
        OPTIMIZER_REGISTRY,
        LR_SCHEDULER_REGISTRY,
        TOKENIZER_REGISTRY,
    ),
    arch: bool = True,
    description: Optional[str] = None,
    imply: Optional[Callable[[argparse.Namespace, Set[str]], List[str]]] = None,
) -> Tuple[argparse.ArgumentParser, List[str]]:
    """The parser for the components ``argv`` chooses, and the argv to parse with it.

    A first pass reads the selector flags (and imports ``--user-dir``); ``imply`` may then
    add selector flags the user did not give (e.g. ``--optimizer cpu_adam`` under
    ``--cpu-offload``), returned in front of ``argv``. Unknown component names exit with one
    line listing the registered names.
    """
    argv = list(argv)

    def fresh_parser(add_help: bool) -> argparse.ArgumentParser:
        p = OneLineErrorParser(prog=prog, description=description, add_help=add_help, allow_abbrev=False)
        _selectors(p, selectors, arch)
        for cfg in base_configs:
            add_dataclass_options(p, cfg)
        return p

    first_parser = fresh_parser(add_help=False)
    for action in first_parser._actions:  # a missing positional (toolkit-generate --help) is the second pass's error
        if not action.option_strings and action.nargs is None:
            action.nargs, action.required = "?", False
    first, _ = first_parser.parse_known_args(argv)
    if first.user_dir:
        registry.import_user_module(first.user_dir)
    registry.declare_builtin_components()  # names and options only: a component's code is imported at its use
    if imply is not None:
        argv = imply(first, explicit_options(first_parser, argv)) + argv
        first, _ = first_parser.parse_known_args(argv)

    parser = fresh_parser(add_help=True)
    try:
        for reg in selectors:
            cfg = _selected(reg, getattr(first, reg.flag[2:].replace("-", "_")))
            if cfg is not None:
                add_dataclass_options(parser, cfg, title=f"{reg.kind} options")
        if arch and first.arch is not None:
            entry = registry.resolve_arch(first.arch)
            if entry.config is not None:
                add_dataclass_options(parser, entry.config, title=f"model options ({first.arch})")
                parser.set_defaults(**architecture_defaults(first.arch, given_options(entry.config, argv, prog)))
    except UnknownComponentError as e:
        parser.error(str(e))
    return parser, argv


def _option_strings(config: Optional[type]) -> Set[str]:
    if config is None or not is_dataclass(config):
        return set()
    return {name for f in fields(config) for name in [flag_name(f.name), *f.metadata.get("aliases", ())]}


def refuse_other_family_options(parser: argparse.ArgumentParser, argv: Sequence[str], arch: str) -> None:
    """A model option of another family (``--arch llama --dropout 0.1``) is one line saying so, not argparse's
    "unrecognized arguments": the user asked for something the chosen family does not have. A family may
    say why in its options class (``ABSENT_OPTIONS = {"dropout": "it has no dropout"}``), also of a flag no
    family has (one that names the family to use instead)."""
    known = {option for action in parser._actions for option in action.option_strings}
    chosen = registry.resolve_arch(arch).config
    absent = getattr(chosen, "ABSENT_OPTIONS", {})
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--") or flag in known:
            continue
        owners = sorted(
            name
            for name in registry.MODEL_REGISTRY.names()
            if flag in _option_strings(registry.MODEL_REGISTRY.get(name).config)
        )
        why = absent.get(flag[2:].replace("-", "_"))
        if owners or why:
            why = why or f"it is an option of {', '.join(owners)}"
            raise UserError(f"{flag}: --arch {arch} has no such option ({why}); drop the flag")


def parse_with_components(
    prog: str, base_configs: Sequence[type], argv: Optional[List[str]] = None, **kwargs: Any
) -> argparse.Namespace:
    """Two-pass parse: the chosen components decide which options exist (see :func:`build_parser`)."""
    parser, argv = build_parser(prog, base_configs, list(sys.argv[1:] if argv is None else argv), **kwargs)
    return parser.parse_args(argv)


def explicit_options(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Set[str]:
    """The destinations of the options that appear in ``argv`` (given by the user, not defaulted)."""
    given = set()
    for action in parser._actions:
        for option in action.option_strings:
            if any(a == option or a.startswith(option + "=") for a in argv):
                given.add(action.dest)
    return given


VALUE_FLAGS_WITH_DEFAULT = {"--remove-bpe": "subword_nmt", "--post-process": "subword_nmt"}


def fill_optional_values(argv: List[str]) -> List[str]:
    """fairseq's ``--remove-bpe`` / ``--post-process`` alone mean ``... subword_nmt`` (argparse's const): filled in
    before parsing, so every command (eval-lm, generate, interactive) reads the flag the same way."""
    out: List[str] = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg in VALUE_FLAGS_WITH_DEFAULT and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            out.append(VALUE_FLAGS_WITH_DEFAULT[arg])
    return out
