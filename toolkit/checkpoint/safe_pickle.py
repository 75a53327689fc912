"""Unpickling with an allowlist, and DCP (``torch.distributed.checkpoint``) reads that use it.

``torch.load(weights_only=True)`` covers our ``.pt`` files, but DCP itself reads a
folder's ``.metadata`` with plain ``pickle.load`` and its non-tensor items with
``torch.load`` with ``weights_only`` off: a forged sharded checkpoint would run code on
load. :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner` close both holes;
every DCP load in the toolkit goes through them. They are built at the first DCP read
(:func:`safe_reader`, :func:`load_dcp`), so importing this module does not import DCP (a second of
every command's start-up, see ``toolkit.checkpoint.dcp_state``).

:func:`restricted_load` is generic: the caller names every ``(module, name)`` a pickle may
reference and what each resolves to, so other formats (fairseq's checkpoints) can reuse it.
"""

from __future__ import annotations

import functools
import io
import pathlib
import pickle
import re
from typing import Any, BinaryIO, Dict, Mapping, Tuple

import torch

from toolkit.core.errors import UserError

Allowlist = Mapping[Tuple[str, str], Any]


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals in ``allowed``; anything else is refused before it is called."""

    def __init__(self, file: BinaryIO, allowed: Allowlist, what: str):
        super().__init__(file)
        self.allowed = allowed
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise UserError(f"{self.what}: refusing to load: unexpected object {module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise UserError(f"{self.what}: refusing to load: unexpected persistent id in the pickle")


def restricted_load(file: BinaryIO, allowed: Allowlist, what: str) -> Any:
    """Unpickle ``file`` allowing only ``allowed`` globals; ``what`` (a path) names it in errors."""
    try:
        return RestrictedUnpickler(file, allowed, what).load()
    except UserError:
        raise
    except Exception as e:  # truncated or corrupt bytes
        raise UserError(
            f"{what}: cannot read it ({type(e).__name__}: {str(e)[:200]}); "
            f"the file is damaged or not what its name says"
        ) from None


def _dtype_names() -> Dict[Tuple[str, str], Any]:
    return {("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


@functools.lru_cache(maxsize=1)
def dcp_metadata_allowlist() -> Dict[Tuple[str, str], Any]:
    """DCP's own metadata classes, torch.Size, dtypes, layouts, memory formats and a path: all inert."""
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    allowed: Dict[Tuple[str, str], Any] = _dtype_names()
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        if hasattr(dcp_metadata, name):
            allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(dcp_metadata, name)
    allowed.update(
        {
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
            ("torch", "Size"): torch.Size,
            ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # name -> torch.layout
            ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id
            ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
            ("collections", "OrderedDict"): dict,
        }
    )
    for fmt in ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format"):
        allowed[("torch", fmt)] = getattr(torch, fmt)
    return allowed


def read_dcp_metadata(file: BinaryIO, path: str) -> Any:
    """A DCP ``.metadata`` file, through the allowlist."""
    from torch.distributed.checkpoint import metadata as dcp_metadata

    md = restricted_load(file, dcp_metadata_allowlist(), path)
    if not isinstance(md, dcp_metadata.Metadata):
        raise UserError(f"{path}: not a DCP metadata file (holds a {type(md).__name__})")
    return md


def _load_bytes_safely(value: io.BytesIO, fqn: str) -> Any:
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except Exception as e:
        raise load_refusal(f"item {fqn}", e, "a non-tensor item") from None


@functools.lru_cache(maxsize=1)
def _dcp_classes() -> Dict[str, type]:
    """The reader and planners, defined at the first DCP read (their bases are DCP's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    class SafeFileSystemReader(dcp.FileSystemReader):
        """FileSystemReader whose ``.metadata`` goes through :func:`read_dcp_metadata` (torch's uses pickle.load)."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                md = read_dcp_metadata(f, str(path))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = dcp_metadata.StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    class _SafeBytesMixin:
        """DCP's planners read non-tensor items with ``torch.load`` with ``weights_only`` off; this one does not."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            obj = _load_bytes_safely(value, fqn)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    class SafeLoadPlanner(_SafeBytesMixin, DefaultLoadPlanner):
        """DefaultLoadPlanner with allowlisted (weights-only) reads of non-tensor items."""

    class _SafeEmptyStateDictLoadPlanner(_SafeBytesMixin, _EmptyStateDictLoadPlanner):
        """Rebuilds the whole saved state dict (for consolidation), reading non-tensor items weights-only."""

    return {
        "SafeFileSystemReader": SafeFileSystemReader,
        "SafeLoadPlanner": SafeLoadPlanner,
        "_SafeEmptyStateDictLoadPlanner": _SafeEmptyStateDictLoadPlanner,
    }


def __getattr__(name: str) -> Any:
    """``safe_pickle.SafeFileSystemReader`` and the planners, as before they were built lazily."""
    if name not in ("SafeFileSystemReader", "SafeLoadPlanner", "_SafeEmptyStateDictLoadPlanner"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _dcp_classes()[name]


def safe_reader(folder: str):
    """DCP's ``FileSystemReader`` for ``folder`` whose ``.metadata`` goes through the allowlist."""
    return _dcp_classes()["SafeFileSystemReader"](folder)


def _one_line_error(folder: str, error: BaseException) -> UserError:
    """DCP wraps every rank's failure in a CheckpointException (a BaseException) with tracebacks: one line."""
    failures = getattr(error, "failures", None) or {}
    inner = [exc_pair[0] for exc_pair in failures.values()] or [error]
    for exc in inner:
        if isinstance(exc, UserError):
            return exc
    exc = inner[0]
    text = str(exc).strip().splitlines()
    return UserError(
        f"{folder}: cannot load the sharded checkpoint ({type(exc).__name__}: {text[0][:200] if text else ''})"
    )


def load_dcp(state: Dict[str, Any], folder: str, whole: bool = False) -> None:
    """``dcp.load`` into ``state`` (collective under a process group) through the safe reader and planner.

    ``whole``: fill the empty ``state`` with everything saved, in this process alone
    (DCP's public ``load`` copies the dict it is given, so this takes its inner loader, as
    torch's own ``dcp_to_torch_save`` does).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    classes = _dcp_classes()
    safe_reader(folder).read_metadata()  # a forged index fails here, before DCP's noisy retries
    try:
        if whole:
            _load_state_dict(
                state,
                storage_reader=safe_reader(folder),
                planner=classes["_SafeEmptyStateDictLoadPlanner"](),
                no_dist=True,
            )
        else:
            dcp.load(state, storage_reader=safe_reader(folder), planner=classes["SafeLoadPlanner"]())
    except (Exception, CheckpointException) as e:
        error = _one_line_error(folder, e)
        raise (error if str(error).startswith(folder) else UserError(f"{folder}: {error}")) from None


def dcp_to_state_dict(folder: str) -> Dict[str, Any]:
    """The full saved state dict of a DCP folder, in this process (no process group), read safely."""
    state: Dict[str, Any] = {}
    load_dcp(state, folder, whole=True)
    return state


_BLOCKED_GLOBAL = re.compile(r"Trying to load unsupported GLOBAL ([\w.]+)|Unsupported global: GLOBAL ([\w.]+)")


def load_refusal(path: str, error: BaseException, what: str = "checkpoint") -> UserError:
    """One line for a failed ``torch.load(weights_only=True)``: the object it refused, else the first line."""
    text = str(error)
    m = _BLOCKED_GLOBAL.search(text)
    if m:
        obj = m.group(1) or m.group(2)
        return UserError(f"{path}: refusing to load: unexpected object {obj}")
    lines = text.strip().splitlines()
    first = lines[0][:200] if lines else type(error).__name__
    return UserError(f"{path}: cannot load {what} safely ({first}); is it a toolkit checkpoint?")
