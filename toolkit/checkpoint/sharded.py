"""Sharded checkpoints (``--use-sharded-state``) through ``torch.distributed.checkpoint`` (DCP).

Layout: one folder per checkpoint name, ``checkpoint_last.pt`` -> ``SAVE_DIR/checkpoint_last/``::

    checkpoint_last/
        .metadata          DCP's index of every tensor's shards (written last, by rank 0)
        __0_0.distcp ...   each rank's shard of the model and optimizer state
        meta.pt            cfg, extra state (data position, LR schedule, meters), optimizer name

Model and optimizer states are keyed by parameter name (``get_state_dict``), so a
checkpoint saved on W ranks loads on any other world size, sharded or not (DCP
reshards on load), and into DDP or plain models as well as FSDP2.

Atomicity: every rank writes into ``SAVE_DIR/.checkpoint_last.tmp/``; only after DCP's
``.metadata`` (which rank 0 writes once all ranks' shards are on disk) and ``meta.pt``
exist, and a barrier, does rank 0 rename the folder into place (the previous one is
moved aside first and removed after). A rank killed mid-save leaves an incomplete
temporary folder that nothing ever loads, and ``checkpoint_last/`` stays the last
complete checkpoint. A crash between the two renames is recovered on load.

Also here: fairseq's ``checkpoint_last-shard{N}.pt`` sets given to ``--restore-file``
(loaded when they hold a full model state under our parameter names, refused with a
one-line reason otherwise), and :func:`consolidate` (``toolkit-consolidate``).
"""
from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import signal
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from toolkit.checkpoint import compat, identity
from toolkit.checkpoint.safe_pickle import SafeFileSystemReader, dcp_to_state_dict, load_dcp, load_refusal
from toolkit.distributed.utils import barrier, rescale_iterator_state
from toolkit.errors import UserError
from toolkit.fileio import atomic_write
from toolkit.models.init import canonical_name
from toolkit.options import args_to_dict

logger = logging.getLogger(__name__)

META_FILE = "meta.pt"
DCP_INDEX = ".metadata"
FORMAT = "toolkit-sharded-v1"
# Test hook: "RANK:N" kills rank RANK (SIGKILL) in its N-th sharded save, after it wrote its shard
# and before the checkpoint is complete (see tests/test_distributed.py).
FAULT_ENV = "TOOLKIT_FAULT_KILL_IN_SAVE"
_saves = 0


# --- names -------------------------------------------------------------------------------

def folder_name(name: str) -> str:
    """``checkpoint_last.pt`` -> ``checkpoint_last``."""
    return name[:-3] if name.endswith(".pt") else name


def _tmp_path(folder: str) -> str:
    return os.path.join(os.path.dirname(folder), "." + os.path.basename(folder) + ".tmp")


def _old_path(folder: str) -> str:
    return os.path.join(os.path.dirname(folder), "." + os.path.basename(folder) + ".old")


def is_complete(folder: str) -> bool:
    return (os.path.isdir(folder) and os.path.isfile(os.path.join(folder, DCP_INDEX))
            and os.path.isfile(os.path.join(folder, META_FILE)))


def find_sharded(path: str) -> Optional[str]:
    """The complete sharded folder for ``path`` (``X.pt`` or ``X``), recovering an interrupted rename."""
    folder = folder_name(path) if not os.path.isdir(path) else path
    if os.path.isdir(folder):
        return folder if is_complete(folder) else None
    # Crash between "move the old one aside" and "move the new one in": take the newest complete one.
    for candidate in (_tmp_path(folder), _old_path(folder)):
        if is_complete(candidate):
            logger.warning(f"{folder}: missing after an interrupted save; using {candidate}")
            return candidate
    return None


# --- save ---------------------------------------------------------------------------------

class _FaultyWriter(dcp.FileSystemWriter):
    """A FileSystemWriter that kills this process right after writing its shard (tests only)."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        future.wait()
        logger.warning(f"{FAULT_ENV}: killing rank {torch.distributed.get_rank()} in the middle of a save")
        os.kill(os.getpid(), signal.SIGKILL)
        return future


def _writer(path: str):
    global _saves
    _saves += 1
    spec = os.environ.get(FAULT_ENV, "")
    if spec and torch.distributed.is_initialized():
        rank, n = (int(x) for x in spec.split(":"))
        if rank == torch.distributed.get_rank() and n == _saves:
            return _FaultyWriter(path)
    return dcp.FileSystemWriter(path)


def _sharded_state(trainer, with_optimizer: bool) -> Dict[str, Any]:
    """The model's (and optimizer's) state as this rank holds it (DTensor shards under FSDP2)."""
    state = {"model": get_model_state_dict(trainer.model)}
    if with_optimizer:
        state["optim"] = get_optimizer_state_dict(trainer.model, trainer.optimizer)
    return state


def _meta(args, trainer, epoch_itr_state, val_loss, best, with_optimizer: bool, world_size: int) -> Dict[str, Any]:
    from toolkit.logging import metrics

    return {
        "format": FORMAT,
        "cfg": args_to_dict(args),
        "world_size": world_size,
        "has_optimizer_state": with_optimizer,
        "optimizer_name": args.optimizer if with_optimizer else None,
        "extra_state": {
            "train_iterator": epoch_itr_state,
            "val_loss": val_loss,
            "best": best,
            "trainer": trainer.extra_state(),
            "metrics": metrics.state_dict(),
            identity.HASH_KEY: trainer.task.dictionary.symbols_hash(),
        },
    }


def save_checkpoint(args, trainer, epoch_itr, names: List[str], val_loss: Optional[float], best: Optional[float],
                    env) -> None:
    """Collective: every rank writes its shard of ``names[0]``; rank 0 publishes it (and copies to the others)."""
    folders = [os.path.join(args.save_dir, folder_name(n)) for n in names]
    tmp = _tmp_path(folders[0])
    if env.is_master:
        os.makedirs(args.save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that crashed
        os.makedirs(tmp)
    barrier()
    with_optimizer = not args.no_save_optimizer_state
    dcp.save(_sharded_state(trainer, with_optimizer), storage_writer=_writer(tmp))
    if env.is_master:
        meta = _meta(args, trainer, epoch_itr.state_dict(), val_loss, best, with_optimizer, env.world_size)
        with atomic_write(os.path.join(tmp, META_FILE), "wb") as f:
            torch.save(meta, f)
    barrier()  # every shard, DCP's index and meta.pt are on disk
    if env.is_master:
        _publish(tmp, folders[0])
        for other in folders[1:]:
            other_tmp = _tmp_path(other)
            shutil.rmtree(other_tmp, ignore_errors=True)
            _link_tree(folders[0], other_tmp)
            _publish(other_tmp, other)
        logger.info(f"saved sharded checkpoint {folders[0]} ({env.world_size} shards; also as "
                    f"{', '.join(os.path.basename(f) for f in folders[1:]) or 'nothing else'})")
        prune(args)
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


def prune(args) -> None:
    """--keep-interval-updates and --keep-last-epochs for sharded folders (newest kept)."""
    for keep, pattern in ((args.keep_interval_updates, r"checkpoint_\d+_(\d+)"),
                          (args.keep_last_epochs, r"checkpoint(\d+)")):
        if keep <= 0:
            continue
        regex = re.compile(pattern)
        found = sorted(((int(m.group(1)), os.path.join(args.save_dir, name)) for name in os.listdir(args.save_dir)
                        if (m := regex.fullmatch(name)) and os.path.isdir(os.path.join(args.save_dir, name))),
                       reverse=True)
        for _, path in found[keep:]:
            shutil.rmtree(path, ignore_errors=True)


# --- load ----------------------------------------------------------------------------------

def read_meta(folder: str) -> Dict[str, Any]:
    path = os.path.join(folder, META_FILE)
    try:
        meta = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise load_refusal(path, e, "the sharded checkpoint's metadata") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f"{path}: not a toolkit sharded checkpoint (format {meta.get('format') if isinstance(meta, dict) else '?'})")
    return meta


def tensor_shapes(folder: str) -> Dict[str, Tuple[int, ...]]:
    """Global shape of every tensor in a DCP folder, by flattened key (``model.embed_tokens.weight``)."""
    md = SafeFileSystemReader(folder).read_metadata()
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}


def check_compatible(folder: str, meta: Dict[str, Any], args, trainer) -> None:
    cfg = meta.get("cfg", {})
    for key in ("decoder_layers", "decoder_embed_dim", "decoder_attention_heads", "decoder_ffn_embed_dim"):
        if key in cfg and getattr(args, key, cfg[key]) != cfg[key]:
            raise UserError(f"{folder}: checkpoint has --{key.replace('_', '-')} {cfg[key]} but this run has "
                            f"{getattr(args, key)}; use the same --arch or another --save-dir")
    identity.check_dictionary(folder, identity.saved_hash(meta.get("extra_state")), trainer.task.dictionary,
                              identity.dict_path_of(trainer.task))
    compat.check_resume(folder, {k[len("model."):]: v for k, v in tensor_shapes(folder).items()
                                 if k.startswith("model.")}, cfg, args, trainer.model)
    embed = tensor_shapes(folder).get("model.embed_tokens.weight")
    size = len(trainer.task.dictionary)
    if embed is not None and embed[0] != size:
        raise UserError(f"{folder}: checkpoint was trained with a dictionary of {embed[0]} symbols "
                        f"but the data-bin's dict.txt has {size}; use the same data-bin")


def optimizer_switch(folder: str, meta: Dict[str, Any], args, trainer) -> bool:
    """Whether the saved optimizer state is another optimizer's that loads into this one (adam <-> cpu_adam).

    Both keep torch AdamW's per-parameter layout (step, exp_avg, exp_avg_sq), so the state
    loads as is; their param_group keys differ, so those come from this run. fp16 moments
    (``--fp16-adam-stats``) are stored with scales that a plain load would not apply.
    """
    from toolkit.checkpoint.checkpoint_utils import ADAM_FAMILY

    saved, name = meta.get("optimizer_name"), args.optimizer
    if saved in (None, name):
        return False
    if saved not in ADAM_FAMILY or name not in ADAM_FAMILY:
        raise UserError(f"{folder}: optimizer state was saved by --optimizer {saved} but this run uses "
                        f"--optimizer {name}; add --reset-optimizer to start a fresh optimizer state")
    saved_fp16 = any(k.endswith("_scale") and k.startswith("optim.state.") for k in tensor_shapes(folder))
    if saved_fp16 or getattr(trainer.optimizer, "fp16_adam_stats", False):
        raise UserError(f"{folder}: switching between --optimizer {saved} and {name} with --fp16-adam-stats "
                        f"goes through a consolidated checkpoint: run toolkit-consolidate {folder} and pass "
                        f"the .pt to --restore-file, or add --reset-optimizer")
    return True


def load_sharded(folder: str, args, trainer) -> Dict[str, Any]:
    """Restore model, optimizer (unless --reset-optimizer) and trainer state from a DCP folder; any world size."""
    meta = read_meta(folder)
    check_compatible(folder, meta, args, trainer)
    load_optimizer = not args.reset_optimizer and meta.get("has_optimizer_state", False)
    switching = load_optimizer and optimizer_switch(folder, meta, args, trainer)
    state = _sharded_state(trainer, load_optimizer)
    groups = None
    if switching:  # per-parameter state from the checkpoint, hyperparameters from this run's flags
        groups = state["optim"]["param_groups"]
        state["optim"] = {"state": state["optim"]["state"]}
    load_dcp(state, folder)
    set_model_state_dict(trainer.model, state["model"])
    if load_optimizer:
        optim = state["optim"] if groups is None else {"state": state["optim"]["state"], "param_groups": groups}
        set_optimizer_state_dict(trainer.model, trainer.optimizer, optim)
        if switching:
            logger.info(f"optimizer state of --optimizer {meta['optimizer_name']} loaded into --optimizer "
                        f"{args.optimizer} (steps and moments kept; hyperparameters from this run's flags)")
    extra = meta["extra_state"]
    trainer.load_extra_state(extra["trainer"], reset_lr_scheduler=args.reset_lr_scheduler)
    if not args.reset_meters and extra.get("metrics"):
        from toolkit.logging import metrics

        metrics.load_state_dict(extra["metrics"])
    logger.info(f"loaded sharded checkpoint {folder} (saved on {meta.get('world_size')} ranks; epoch "
                f"{(extra.get('train_iterator') or {}).get('epoch')} @ {trainer.num_updates} updates)")
    extra = dict(extra)
    extra["train_iterator"] = rescale_iterator_state(extra.get("train_iterator"), meta.get("world_size"),
                                                     args.distributed_world_size)
    return extra


def load_latest(path: str, args, trainer) -> Optional[Dict[str, Any]]:
    """Load ``path`` if it is a sharded folder or a fairseq ``-shard{N}.pt`` set; None: not ours to load.

    With both ``checkpoint_last.pt`` and ``checkpoint_last/`` present, the newer one is loaded.
    """
    folder = find_sharded(path)
    if folder is not None:
        if os.path.isfile(path) and os.path.getmtime(path) > os.path.getmtime(os.path.join(folder, META_FILE)):
            logger.info(f"{path} is newer than {folder}; loading it")
            return None
        return load_sharded(folder, args, trainer)
    if os.path.exists(path):
        if os.path.isdir(path):
            raise UserError(f"{path}: folder is not a complete sharded checkpoint (no {DCP_INDEX} and {META_FILE}); "
                            f"it may be from a save that was interrupted")
        return None
    shards = fairseq_shard_files(path)
    if shards:
        return load_fairseq_shards(shards, args, trainer)
    return None


# --- fairseq -shard{N}.pt sets ---------------------------------------------------------------

def fairseq_shard_files(path: str) -> List[str]:
    stem = path[:-3] if path.endswith(".pt") else path
    found = {}
    for f in glob.glob(glob.escape(stem) + "-shard*.pt"):
        m = re.fullmatch(re.escape(stem) + r"-shard(\d+)\.pt", f)
        if m:
            found[int(m.group(1))] = f
    if not found:
        return []
    missing = [i for i in range(max(found) + 1) if i not in found]
    if missing:
        raise UserError(f"{stem}-shard*.pt: shard {missing[0]} of {max(found) + 1} is missing")
    return [found[i] for i in range(len(found))]


def _fairseq_refuse(files: List[str], why: str) -> UserError:
    return UserError(f"{files[0]}: fairseq sharded checkpoint ({len(files)} files) cannot be loaded: {why}")


def load_fairseq_shards(files: List[str], args, trainer) -> Dict[str, Any]:
    """A fairseq ``-shard{N}.pt`` set: loaded if shard 0 holds the full model under our names, else refused."""
    try:
        state = torch.load(files[0], map_location="cpu", weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _fairseq_refuse(files, f"it pickles Python objects that are unsafe to load ({first[:120]}); "
                                     f"consolidate and convert it with fairseq first") from None
    model_state = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model_state, dict):
        raise _fairseq_refuse(files, "it has no 'model' state")
    if any("flat_param" in k or "_fsdp_wrapped_module" in k for k in model_state) or "shard_metadata" in state:
        raise _fairseq_refuse(files, "it holds FSDP flat-parameter shards; merge them into one checkpoint with "
                                     "fairseq's consolidate_fsdp_shards first")
    ours = {k: tuple(v.shape) for k, v in get_model_state_dict(trainer.model).items()}
    renamed = {}
    for k, v in model_state.items():
        name = canonical_name(k[len("decoder."):] if k.startswith("decoder.") else k)
        if name in ours:
            renamed[name] = v
    missing = [k for k in ours if k not in renamed]
    if missing:
        raise _fairseq_refuse(files, f"its parameter names do not match this model's (no {missing[0]}; "
                                     f"{len(missing)} of {len(ours)} missing)")
    wrong = [k for k, v in renamed.items() if tuple(v.shape) != ours[k]]
    if wrong:
        raise _fairseq_refuse(files, f"{wrong[0]} has shape {tuple(renamed[wrong[0]].shape)}, this model has "
                                     f"{ours[wrong[0]]}")
    set_model_state_dict(trainer.model, renamed, options=StateDictOptions(full_state_dict=True))
    history = state.get("optimizer_history") or [{}]
    extra = state.get("extra_state") if isinstance(state.get("extra_state"), dict) else {}
    num_updates = int((history[-1] if isinstance(history[-1], dict) else {}).get("num_updates", 0))
    trainer.load_extra_state({"num_updates": num_updates}, reset_lr_scheduler=True)
    logger.warning(f"loaded the model from fairseq shard set {files[0]} ({len(files)} files) @ {num_updates} "
                   f"updates; its optimizer and scheduler state are not loaded")
    return {"train_iterator": extra.get("train_iterator") if not args.reset_dataloader else None,
            "best": (extra.get("best") if isinstance(extra.get("best"), (int, float)) else None)}


# --- consolidation --------------------------------------------------------------------------

def consolidate(folder: str, output: str, include_optimizer: bool = True) -> Dict[str, Any]:
    """Write a sharded checkpoint as one consolidated ``.pt`` (the format ``toolkit-train`` writes by default).

    Runs in one process without a process group. Returns a summary.
    """
    if not is_complete(folder):
        raise UserError(f"{folder}: not a complete sharded checkpoint (needs {DCP_INDEX} and {META_FILE})")
    meta = read_meta(folder)
    full = dcp_to_state_dict(folder)
    state = {"cfg": meta["cfg"], "model": full["model"], "extra_state": meta["extra_state"]}
    if include_optimizer and "optim" in full:
        state["last_optimizer_state"] = full["optim"]
        state["optimizer_name"] = meta.get("optimizer_name")
    with atomic_write(output, "wb") as f:
        torch.save(state, f)
    return {"tensors": len(state["model"]), "params": sum(v.numel() for v in state["model"].values()),
            "optimizer": "last_optimizer_state" in state, "world_size": meta.get("world_size")}
