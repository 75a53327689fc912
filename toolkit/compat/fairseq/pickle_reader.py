"""Read fairseq's checkpoint files without running the code a pickle names.

fairseq >= 0.12 saves its options as plain dicts, which ``torch.load(weights_only=True)``
reads as is. Older files cannot be read that way: fairseq 0.10 pickles its options as an
``argparse.Namespace``, fairseq 0.10.1-0.11 keep omegaconf ``DictConfig`` objects (with
their nodes and metadata) and fairseq's ``StrEnum`` choice values, and the optimizer or
metrics state may hold numpy scalars. A pickle can name *any* callable, so :func:`read`
lists the globals a file names (``torch.serialization.get_unsafe_globals_in_checkpoint``,
which reads the opcodes without running them), maps each through :func:`resolve` --
tensors and plain containers, and the known config classes as inert stand-ins turned into
plain dicts/lists/strings afterwards (:func:`to_plain`) -- and then lets torch's own
weights-only unpickler load the file with exactly that allowlist. Any other name stops the
load before anything is called: ``<path>: refusing to load: unexpected object <module.name>``.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import collections
import os
import pickle
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from toolkit.core.errors import UserError


class RefusedObject(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"unexpected object {module}.{name}")
        self.qualified_name = f"{module}.{name}"


class _Stub:
    """An unpickled config object, kept as its pickled state until :func:`to_plain`."""

    def __init__(self, *args: Any):
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class NamespaceStub(_Stub):
    pass


class ContainerStub(_Stub):  # omegaconf DictConfig / ListConfig
    pass


class NodeStub(_Stub):  # omegaconf value nodes: the value is in state["_val"]
    pass


class MetadataStub(_Stub):  # omegaconf (Container)Metadata: types and flags, dropped
    pass


class TypeRef:
    """A class named only as a type annotation (omegaconf metadata); never callable."""

    def __init__(self, qualified_name: str):
        self.qualified_name = qualified_name


def _enum_value(value: Any, *unused: Any) -> Any:
    """fairseq ``StrEnum``/``ChoiceEnum`` members pickle as ``Class(value)``: keep the value."""
    return value


def _path(*parts: str) -> str:
    return os.path.join(*parts) if parts else ""


_ALLOWED: Dict[Tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): collections.defaultdict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "complex"): complex,
    ("_codecs", "encode"): codecs.encode,  # protocol 2's spelling of bytes
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch", "Size"): torch.Size,
    ("numpy", "dtype"): np.dtype,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy.core.multiarray", "scalar"): np._core.multiarray.scalar,
    ("numpy._core.multiarray", "scalar"): np._core.multiarray.scalar,
    ("numpy.core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
    ("argparse", "Namespace"): NamespaceStub,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "Path"): _path,
}
_OMEGACONF_CONTAINERS = {"DictConfig", "ListConfig"}
_OMEGACONF_NODES = {
    "AnyNode",
    "StringNode",
    "IntegerNode",
    "FloatNode",
    "BooleanNode",
    "EnumNode",
    "BytesNode",
    "PathNode",
    "ValueNode",
    "InterpolationResultNode",
}
_OMEGACONF_METADATA = {"Metadata", "ContainerMetadata"}
_TYPE_NAMES = {
    ("builtins", n) for n in ("dict", "list", "tuple", "str", "int", "float", "bool", "bytes", "object", "NoneType")
}


def resolve(module: str, name: str) -> Any:
    """What a pickled global name becomes here; RefusedObject for anything not allowlisted."""
    if (module, name) in _ALLOWED:
        return _ALLOWED[(module, name)]
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    if module.startswith("omegaconf"):
        if name in _OMEGACONF_CONTAINERS:
            return ContainerStub
        if name in _OMEGACONF_NODES:
            return NodeStub
        if name in _OMEGACONF_METADATA:
            return MetadataStub
    if module == "fairseq.dataclass.constants":
        return _enum_value  # StrEnum / ChoiceEnum members
    if (
        module.startswith(("fairseq.dataclass", "fairseq.models", "fairseq.tasks"))
        or module == "typing"
        or (module, name) in _TYPE_NAMES
    ):
        return TypeRef(f"{module}.{name}")  # a type annotation in omegaconf metadata
    raise RefusedObject(module, name)


def to_plain(obj: Any) -> Any:
    """Config stand-ins -> dicts, lists and values (recursively); tensors and plain values unchanged."""
    if isinstance(obj, NamespaceStub):
        state = obj.state if isinstance(obj.state, dict) else {}
        return {k: to_plain(v) for k, v in state.items()}
    if isinstance(obj, ContainerStub):
        content = obj.state.get("_content") if isinstance(obj.state, dict) else None
        return to_plain(content)
    if isinstance(obj, NodeStub):
        return to_plain(obj.state.get("_val")) if isinstance(obj.state, dict) else None
    if isinstance(obj, (MetadataStub, TypeRef)):
        return None
    if isinstance(obj, collections.OrderedDict):
        return collections.OrderedDict((k, to_plain(v)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_plain(v) for v in obj) if not hasattr(obj, "_fields") else obj
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _allowlist(path: str) -> List[Tuple[Any, str]]:
    """(stand-in, qualified name) for every global the file names; a one-line refusal for any other."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # not a zip-format torch file, or a damaged one
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: cannot read checkpoint ({text})") from None
    allowed = []
    for qualified in names:
        module, _, name = qualified.rpartition(".")
        if (module, name) in _compat_pickle.NAME_MAPPING:  # Python 2 spellings, e.g. __builtin__.set
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        try:
            allowed.append((resolve(_compat_pickle.IMPORT_MAPPING.get(module, module), name), qualified))
        except RefusedObject as e:
            raise UserError(f"{path}: refusing to load: unexpected object {e.qualified_name}") from None
    # numpy dtypes are built by np.dtype(...) and then given their state: torch checks the built type.
    allowed += [
        (cls, f"numpy.dtypes.{cls.__name__}")
        for cls in vars(np.dtypes).values()
        if isinstance(cls, type) and issubclass(cls, np.dtype)
    ]
    return allowed


def read(path: str) -> Dict[str, Any]:
    """A fairseq checkpoint as plain dicts and tensors (CPU), or a one-line refusal."""
    with torch.serialization.safe_globals(_allowlist(path)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # corrupt or truncated file, or an object built in a way the stand-ins refuse
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{path}: cannot read checkpoint ({text[:300]})") from None
    if not isinstance(state, dict):
        raise UserError(f"{path}: not a checkpoint (holds a {type(state).__name__}, not a dict)")
    return to_plain(state)
