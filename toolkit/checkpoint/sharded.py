"""Sharded checkpoints (``--use-sharded-state``) through ``torch.distributed.checkpoint`` (DCP).

Layout: one folder per checkpoint name, ``checkpoint_last.pt`` -> ``SAVE_DIR/checkpoint_last/``::

    checkpoint_last/
        .metadata          DCP's index of every tensor's shards (written last, by rank 0)
        __0_0.distcp ...   each rank's shard of the model and optimizer state (and of the EMA: ``ema.*``)
        meta.pt            cfg, extra state (every plain Stateful: data position, LR schedule, meters, ...),
                           optimizer name, the extra-state keys kept in DCP (``extra_in_dcp``)
        checksums.json     CRC-32 and size of every file above (checked before loading)

The run's Statefuls (:mod:`toolkit.checkpoint.stateful`) are written without knowing what each one
is: the tensor entries (model, optimizer) into DCP under their keys, the others into ``meta.pt``'s
``extra_state``, but for the sharded extras (the EMA's moving average, sharded as the weights are): DCP
entries under their keys, each rank writing its part, and put back into ``extra_state`` by
:func:`consolidate`, so a consolidated file has them where a ``.pt`` save puts them. Model and optimizer states are keyed by parameter name (``get_state_dict``), so a
checkpoint saved on W ranks loads on any other world size, sharded or not (DCP
reshards on load), and into DDP or plain models as well as FSDP2.

Atomicity: every rank writes into ``SAVE_DIR/.checkpoint_last.PID-RANDOM.tmp/`` (named by rank 0's PID and
a random part, so no two runs share one); only after DCP's
``.metadata`` (which rank 0 writes once all ranks' shards are on disk) and ``meta.pt``
exist, and a barrier, does rank 0 rename the folder into place (the previous one is
moved aside first and removed after). A rank killed mid-save leaves an incomplete
temporary folder that nothing ever loads, and ``checkpoint_last/`` stays the last
complete checkpoint. A crash between the two renames is recovered on load.

Also here: :func:`consolidate` (``toolkit-consolidate``).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from toolkit.checkpoint.dcp_state import dcp  # DCP imported at the first call

from toolkit.checkpoint import integrity, stateful
from toolkit.checkpoint.common import TrainingState, prune, saved_data_parallel_size, saved_line
from toolkit.checkpoint.safe_pickle import dcp_to_state_dict, load_dcp, load_refusal, safe_reader
from toolkit.config import CheckpointConfig
from toolkit.distributed.utils import barrier, broadcast_object
from toolkit.core.errors import UserError
from toolkit.core.fileio import atomic_write
from toolkit.logging.step_progress import StepProgress
from toolkit.models import saved_options

logger = logging.getLogger(__name__)

META_FILE = "meta.pt"
DCP_INDEX = ".metadata"
FORMAT = "toolkit-sharded-v1"
SAVED_FLAGS = {"optim": "has_optimizer_state"}  # meta.pt's flag saying whether a tensor entry was saved
EXTRA_IN_DCP = "extra_in_dcp"  # meta.pt's list of extra-state keys saved as DCP entries (older files: none)


# --- names -------------------------------------------------------------------------------


def folder_name(name: str) -> str:
    """``checkpoint_last.pt`` -> ``checkpoint_last``."""
    return name[:-3] if name.endswith(".pt") else name


_RUN_TOKEN: List[str] = []


def run_token() -> str:
    """``PID-RANDOM`` of rank 0, the same on every rank (collective on first use): temporary names unique
    to this run, so two runs (or a run and a leftover) never write into one temporary folder."""
    if not _RUN_TOKEN:
        _RUN_TOKEN.append(broadcast_object(f"{os.getpid()}-{secrets.token_hex(4)}"))
    return _RUN_TOKEN[0]


def tmp_path(folder: str) -> str:
    """``.checkpoint_last.PID-RANDOM.tmp``: where a save writes before publishing (every rank calls it)."""
    return os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.{run_token()}.tmp")


def _old_path(folder: str) -> str:
    return os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.{run_token()}.old")


def _aside_candidates(folder: str) -> List[str]:
    """Temporary (newer first) then moved-aside folders of ``folder``, of any run (older names included)."""
    parent, base = os.path.dirname(folder) or ".", os.path.basename(folder)
    found: Dict[str, List[str]] = {"tmp": [], "old": []}
    pattern = re.compile(re.escape(f".{base}") + r"(?:\.\d+-[0-9a-f]{8})?\.(tmp|old)")
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        m = pattern.fullmatch(name)
        if m:
            found[m.group(1)].append(os.path.join(parent, name))
    return [path for kind in ("tmp", "old") for path in sorted(found[kind], key=_mtime, reverse=True)]


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(os.path.join(path, META_FILE))
    except OSError:
        return 0.0


def is_complete(folder: str) -> bool:
    return (
        os.path.isdir(folder)
        and os.path.isfile(os.path.join(folder, DCP_INDEX))
        and os.path.isfile(os.path.join(folder, META_FILE))
    )


def find_sharded(path: str) -> Optional[str]:
    """The complete sharded folder for ``path`` (``X.pt`` or ``X``), recovering an interrupted rename."""
    folder = folder_name(path) if not os.path.isdir(path) else path
    if os.path.isdir(folder):
        return folder if is_complete(folder) else None
    # Crash between "move the old one aside" and "move the new one in": take the newest complete one.
    for candidate in _aside_candidates(folder):
        if is_complete(candidate):
            logger.warning(f"{folder}: missing after an interrupted save; using {candidate}")
            return candidate
    return None


# --- save ---------------------------------------------------------------------------------


def _writer(path: str) -> dcp.FileSystemWriter:
    """The storage writer of a save (a seam for tests that inject faults)."""
    return dcp.FileSystemWriter(path)


def _sharded_state(statefuls: stateful.Statefuls) -> Dict[str, Any]:
    """The tensor entries a save writes, and the sharded extras, as this rank holds them (DTensor shards
    under FSDP2)."""
    state = {
        key: entry.state_dict(full=False) for key, entry in stateful.tensor_entries(statefuls).items() if entry.saved
    }
    state.update({key: entry.local_state() for key, entry in stateful.sharded_extras(statefuls).items()})
    return state


def _meta(run_cfg: Dict[str, Any], statefuls: stateful.Statefuls, world_size: int) -> Dict[str, Any]:
    meta = {"format": FORMAT, "cfg": run_cfg, "world_size": world_size}
    meta.update({flag: statefuls[key].saved for key, flag in SAVED_FLAGS.items() if key in statefuls})
    meta.update(stateful.side_values(statefuls, saved_only=False))
    meta[EXTRA_IN_DCP] = list(stateful.sharded_extras(statefuls))
    meta["extra_state"] = stateful.extra_state(statefuls, leave_out=meta[EXTRA_IN_DCP])
    return meta


def save(
    cfg: CheckpointConfig,
    run_cfg: Dict[str, Any],
    statefuls: stateful.Statefuls,
    progress: TrainingState,
    names: List[str],
    env,
) -> None:
    """Collective: every rank writes its shard of ``names[0]``; rank 0 publishes it (and copies to the others).

    ``progress`` only names the save in its log line."""
    folders = [os.path.join(cfg.save_dir, folder_name(n)) for n in names]
    tmp, started = tmp_path(folders[0]), time.perf_counter()
    if env.is_master:
        os.makedirs(cfg.save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save of this run that failed
        os.makedirs(tmp)
    barrier()
    dcp.save(_sharded_state(statefuls), storage_writer=_writer(tmp))
    if env.is_master:
        with atomic_write(os.path.join(tmp, META_FILE), "wb") as f:
            torch.save(_meta(run_cfg, statefuls, env.world_size), f)
    barrier()  # every shard, DCP's index and meta.pt are on disk
    if env.is_master:
        integrity.write_folder_checksums(tmp)
        _publish(tmp, folders[0])
        for other in folders[1:]:
            other_tmp = tmp_path(other)
            shutil.rmtree(other_tmp, ignore_errors=True)
            _link_tree(folders[0], other_tmp)
            _publish(other_tmp, other)
        logger.info(f"{saved_line(folders[0], progress, time.perf_counter() - started)} ({env.world_size} shards)")
        prune(cfg, folders=True)
    barrier()


def _publish(tmp: str, folder: str) -> None:
    """Move ``tmp`` to ``folder``, replacing it; never leaves ``folder`` incomplete."""
    old = _old_path(folder)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(folder):
        os.replace(folder, old)
    os.replace(tmp, folder)
    _fsync_dir(os.path.dirname(folder))
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _link_tree(src: str, dst: str) -> None:
    """``dst`` = a copy of ``src`` (hard links when the filesystem allows; the files are never modified)."""
    os.makedirs(dst)
    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)


# --- load ----------------------------------------------------------------------------------


def read_meta(folder: str) -> Dict[str, Any]:
    path = os.path.join(folder, META_FILE)
    try:
        meta = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise load_refusal(path, e, "the sharded checkpoint's metadata") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(
            f"{path}: not a toolkit sharded checkpoint (format {meta.get('format') if isinstance(meta, dict) else '?'})"
        )
    if "cfg" in meta:
        meta["cfg"] = saved_options.as_family(meta["cfg"], path)
    return meta


def tensor_shapes(folder: str) -> Dict[str, Tuple[int, ...]]:
    """Global shape of every tensor in a DCP folder, by flattened key (``model.embed_tokens.weight``)."""
    md = safe_reader(folder).read_metadata()
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}


def load(folder: str, statefuls: stateful.Statefuls, progress: TrainingState, check: stateful.Check) -> Optional[int]:
    """Restore every entry of ``statefuls`` that this run loads from a DCP folder saved on any world size
    (``check`` first: it refuses another model or dictionary before anything is loaded).

    Returns the number of data-parallel replicas the saved data position was counted on.
    """
    integrity.check_folder(folder)
    meta = read_meta(folder)
    tensors = stateful.tensor_entries(statefuls)
    flat = tensor_shapes(folder)
    check(folder, meta.get("cfg", {}), meta.get("extra_state"), stateful.shapes_by_entry(tensors, flat))
    loading = {
        key: entry
        for key, entry in tensors.items()
        if (key not in SAVED_FLAGS or meta.get(SAVED_FLAGS[key], False)) and entry.prepare_load(folder, meta, flat)
    }
    extras = {
        key: entry for key, entry in stateful.sharded_extras(statefuls).items() if key in meta.get(EXTRA_IN_DCP, ())
    }  # else in extra_state (an older file) or not saved
    templates = {key: entry.load_template() for key, entry in loading.items()}
    templates.update({key: entry.local_state() for key, entry in extras.items()})
    load_dcp(templates, folder)
    for key, entry in loading.items():
        entry.load_state_dict(templates[key], full=False)
    for key, entry in extras.items():  # after the model: as in the mapping's order
        entry.load_local(templates[key])
    stateful.load_extra_state(statefuls, meta["extra_state"], loaded=extras)
    logger.info(
        f"loaded sharded checkpoint {folder} (saved on {meta.get('world_size')} ranks; {progress.loaded_summary()})"
    )
    return saved_data_parallel_size(meta.get("cfg", {})) or meta.get("world_size")


# --- consolidation --------------------------------------------------------------------------


def consolidate(folder: str, output: str, include_optimizer: bool = True) -> Dict[str, Any]:
    """Write a sharded checkpoint as one consolidated ``.pt`` (the format ``toolkit-train`` writes by default).

    Runs in one process without a process group. Returns a summary.
    """
    if not is_complete(folder):
        raise UserError(f"{folder}: not a complete sharded checkpoint (needs {DCP_INDEX} and {META_FILE})")
    integrity.check_folder(folder)
    with StepProgress(2, "consolidate", logger_name=__name__) as progress:
        meta = read_meta(folder)
        full = dcp_to_state_dict(folder)
        progress.advance(f"read {meta.get('world_size')} shards of {folder}")
        extra = {**meta["extra_state"], **{key: full[key] for key in meta.get(EXTRA_IN_DCP, ()) if key in full}}
        state = {"cfg": meta["cfg"], "model": full["model"], "extra_state": extra}
        if include_optimizer and "optim" in full:
            state["last_optimizer_state"] = full["optim"]
            state["optimizer_name"] = meta.get("optimizer_name")
        with atomic_write(output, "wb") as f:
            torch.save(state, f)
        progress.advance(f"wrote {output}")
    return {
        "tensors": len(state["model"]),
        "params": sum(v.numel() for v in state["model"].values()),
        "optimizer": "last_optimizer_state" in state,
        "world_size": meta.get("world_size"),
    }
