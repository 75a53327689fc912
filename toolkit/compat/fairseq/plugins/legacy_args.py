"""A plugin's legacy ``add_args(parser)`` options, turned into an options dataclass.

Why: the toolkit builds its command line, the ``cfg`` saved in checkpoints and the model
rebuilt on load from one options dataclass per component (:mod:`toolkit.config.options`). fairseq
plugins written before fairseq's dataclasses declare options by calling
``parser.add_argument`` in a static ``add_args``. Running that method once on a scratch parser
and making each argument a dataclass field gives those options every path a dataclass
component has (flags, ``--help``, saved and restored with the checkpoint) instead of
``unrecognized arguments: --decoder-embed-dim 64``.

fairseq parses model options with ``argument_default=SUPPRESS``: an option the user did not
give is absent, so an architecture's getattr-with-default (``"x", 256``) supplies its value. The
fields of such options default to ``None`` and are listed in ``__fairseq_unset__``;
:class:`UnsetHidden` makes them absent again for architecture functions and ``build_model``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Callable, FrozenSet, List, Optional, Tuple

from toolkit.core.errors import UserError

UNSET_ATTR = "__fairseq_unset__"
_SIMPLE_TYPES = (int, float, str)


def unset_names(config: Optional[type]) -> FrozenSet[str]:
    """The options of ``config`` that fairseq would leave out of ``args`` when not given."""
    return getattr(config, UNSET_ATTR, frozenset())


def _where(kind: str, name: str, action: argparse.Action) -> str:
    return f"{kind} {name}: add_args option {'/'.join(action.option_strings) or action.dest}"


def _bool_field(action: argparse.Action, meta: dict) -> Tuple[str, type, Any]:
    default = not action.const  # store_true: False, store_false: True
    meta["aliases"] = tuple(a for a in meta["aliases"] if a != "--no-" + action.dest.replace("_", "-"))
    return action.dest, bool, dataclasses.field(default=default, metadata=meta)


def _field_spec(kind: str, name: str, action: argparse.Action) -> Tuple[str, type, Any]:
    """One dataclass field (name, type, field) for one argparse action, or one line saying why not."""
    where = _where(kind, name, action)
    if not action.option_strings:
        raise UserError(f"{where}: positional arguments are not supported; declare it as --{action.dest}")
    flag = "--" + action.dest.replace("_", "-")
    meta = {"help": action.help or "", "aliases": tuple(o for o in action.option_strings if o != flag)}
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return _bool_field(action, meta)
    if type(action) is not argparse._StoreAction:
        raise UserError(
            f"{where}: action {type(action).__name__} is not supported; use a typed option "
            f"(type=...), store_true or store_false, or declare the plugin's options in a dataclass"
        )
    if action.nargs not in (None, "?"):
        raise UserError(
            f"{where}: nargs={action.nargs!r} is not supported; take one comma-separated value "
            f"instead, or declare the plugin's options in a dataclass"
        )
    tp = action.type or str
    if tp not in _SIMPLE_TYPES:
        meta["type"] = tp
        tp = str
    if action.choices is not None:
        meta["choices"] = list(action.choices)
    if action.metavar is not None:
        meta["metavar"] = action.metavar
    default = None if action.default is argparse.SUPPRESS else action.default
    return action.dest, Optional[tp], dataclasses.field(default=default, metadata=meta)


def dataclass_from_add_args(kind: str, name: str, owner: type, add_args: Callable) -> type:
    """The options dataclass of a component that declares them with ``add_args(parser)``.

    The class is set as an attribute of ``owner``'s module, so configs holding it pickle (the
    spawned workers of a multi-process run import ``--user-dir`` first, then unpickle).
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, argument_default=argparse.SUPPRESS)
    add_args(parser)
    specs: List[Tuple[str, type, Any]] = []
    unset = set()
    for action in parser._actions:
        specs.append(_field_spec(kind, name, action))
        if action.default is argparse.SUPPRESS and specs[-1][1] is not bool:
            unset.add(action.dest)
    cls_name = f"{owner.__name__}LegacyConfig"
    config = dataclasses.make_dataclass(cls_name, specs)
    config.__module__ = owner.__module__
    setattr(config, UNSET_ATTR, frozenset(unset))
    module = sys.modules.get(owner.__module__)
    if module is not None:
        setattr(module, cls_name, config)
    return config


def declares_add_args(cls: type, base_add_args: Any) -> bool:
    """Whether ``cls`` (or a plugin base between it and the toolkit's base) overrides ``add_args``."""
    own = getattr(cls, "add_args", None)
    return own is not None and getattr(own, "__func__", own) is not getattr(base_add_args, "__func__", base_add_args)


class UnsetHidden:
    """What a legacy architecture function sees: options left unset are absent, as in fairseq.

    a getattr of ``"decoder_embed_dim"`` with default 256 then gives 256 when the user did not pass
    ``--decoder-embed-dim``; assignments go through to the options being resolved.
    """

    def __init__(self, inner: Any, unset: FrozenSet[str]):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_unset", unset)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if value is None and name in self._unset:
            raise AttributeError(name)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


def legacy_args(section: Any, task: Any, unset: FrozenSet[str]) -> argparse.Namespace:
    """fairseq's ``args`` for a legacy ``build_model(args, task)``: the task's options, then the model's.

    fairseq hands every model the whole namespace (``args.tokens_per_sample`` is there); here
    the task's section stands in for the rest. Unset model options are left out, as in fairseq.
    """
    values = {}
    for part in (getattr(task, "cfg", None), section):
        if part is None:
            continue
        items = (
            dataclasses.asdict(part)
            if dataclasses.is_dataclass(part)
            else dict(part if isinstance(part, dict) else vars(part))
        )
        values.update({k: v for k, v in items.items() if not (v is None and k in unset)})
    return argparse.Namespace(**values)


def _parent_config(reg: Any, cls: type) -> Optional[type]:
    """The options dataclass of the nearest registered ancestor of ``cls`` (registered as is or wrapped)."""
    for base in cls.__mro__[1:]:
        for entry in reg.entries.values():
            if base in (entry.cls, getattr(entry.cls, "wrapped_class", None)) and entry.config is not None:
                return entry.config
    return None


def legacy_config(reg: Any, kind: str, name: str, cls: type, base_add_args: Any) -> Optional[type]:
    """The options of a component registered in ``reg`` without a dataclass: its ``add_args`` options on top
    of its registered parent's (``class MyTask(LanguageModelingTask)`` keeps --tokens-per-sample), or the
    parent's alone, or None."""
    parent = _parent_config(reg, cls)
    if not declares_add_args(cls, base_add_args):
        return parent
    own = dataclass_from_add_args(kind, name, cls, cls.add_args)
    if parent is None:
        return own
    fields = [(f.name, f.type, f) for f in dataclasses.fields(own)]
    merged = dataclasses.make_dataclass(own.__name__, fields, bases=(parent,))
    merged.__module__ = own.__module__
    setattr(merged, UNSET_ATTR, unset_names(own) | unset_names(parent))
    setattr(sys.modules[own.__module__], own.__name__, merged)
    return merged
