"""fairseq-named checkpoints, written atomically and read with ``weights_only=True``.

A checkpoint is a dict of plain values and tensors:
``{"cfg": args dict, "model": state dict, "last_optimizer_state": ..., "extra_state": {...}}``.
The model and optimizer states are gathered into full (consolidated) form through
``torch.distributed.checkpoint.state_dict``, keyed by parameter name, so they load
into any world size and any optimizer with the same state layout.
"""
from __future__ import annotations

import collections
import logging
import os
import re
from typing import Any, Dict, List, Optional

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from toolkit.checkpoint import compat, identity, write_errors
from toolkit.checkpoint.safe_pickle import load_refusal
from toolkit.errors import UserError
from toolkit.fileio import atomic_write
from toolkit.options import args_to_dict

logger = logging.getLogger(__name__)

FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


class BestTracker:
    """The best validation metric so far (restored from checkpoints)."""

    def __init__(self, maximize: bool):
        self.maximize = maximize
        self.best: Optional[float] = None
        self.runs_without_improvement = 0

    def is_better(self, value: float) -> bool:
        if self.best is None:
            return True
        return value > self.best if self.maximize else value < self.best

    def update(self, value: Optional[float]) -> None:
        if value is not None and self.is_better(value):
            self.best = value


def checkpoint_names(args, epoch: int, end_of_epoch: bool, num_updates: int, val_loss: Optional[float],
                     best: BestTracker) -> List[str]:
    """Which files this save writes, by fairseq's rules."""
    names = collections.OrderedDict()
    names[f"checkpoint{epoch}.pt"] = (end_of_epoch and not args.no_epoch_checkpoints
                                      and epoch % args.save_interval == 0)
    names[f"checkpoint_{epoch}_{num_updates}.pt"] = (
        not end_of_epoch and args.save_interval_updates > 0 and num_updates % args.save_interval_updates == 0)
    names["checkpoint_best.pt"] = val_loss is not None and best.is_better(val_loss)
    names["checkpoint_last.pt"] = not args.no_last_checkpoints
    return [name for name, write in names.items() if write]


def model_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=FULL_STATE)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    return get_optimizer_state_dict(model, optimizer, options=FULL_STATE)


def build_checkpoint(args, trainer, epoch_itr_state: Dict[str, Any], val_loss: Optional[float],
                     best: Optional[float]) -> Dict[str, Any]:
    """Collective under sharding: every rank must call it; only rank 0 gets the full tensors."""
    state = {
        "cfg": args_to_dict(args),
        "model": model_state(trainer.model),
        "extra_state": {
            "train_iterator": epoch_itr_state,
            "val_loss": val_loss,
            "best": best,
            "trainer": trainer.extra_state(),
            "metrics": _metrics_state(),
            identity.HASH_KEY: trainer.task.dictionary.symbols_hash(),
        },
    }
    if not args.no_save_optimizer_state:
        state["last_optimizer_state"] = optimizer_state(trainer.model, trainer.optimizer)
        state["optimizer_name"] = args.optimizer
    return state


def _metrics_state() -> Dict[str, Any]:
    from toolkit.logging import metrics

    return metrics.state_dict()


def write_checkpoint(state: Dict[str, Any], save_dir: str, names: List[str]) -> None:
    """Write the first name atomically, then copy it to the others (each atomically)."""
    os.makedirs(save_dir, exist_ok=True)
    first = os.path.join(save_dir, names[0])
    with atomic_write(first, "wb") as f:
        torch.save(state, f)
    for name in names[1:]:
        with atomic_write(os.path.join(save_dir, name), "wb") as dst, open(first, "rb") as src:
            while chunk := src.read(16 << 20):
                dst.write(chunk)
    logger.info(f"saved checkpoint {first} (also as {', '.join(names[1:]) or 'nothing else'})")


def prune_checkpoints(args) -> None:
    """--keep-interval-updates and --keep-last-epochs, as fairseq."""
    if args.keep_interval_updates > 0:
        for path in _sorted_checkpoints(args.save_dir, r"checkpoint_\d+_(\d+)\.pt")[args.keep_interval_updates:]:
            os.remove(path)
    if args.keep_last_epochs > 0:
        for path in _sorted_checkpoints(args.save_dir, r"checkpoint(\d+)\.pt")[args.keep_last_epochs:]:
            os.remove(path)


def _sorted_checkpoints(folder: str, pattern: str) -> List[str]:
    """Newest first."""
    regex = re.compile(pattern)
    found = []
    for name in os.listdir(folder):
        m = regex.fullmatch(name)
        if m:
            found.append((int(m.group(1)), os.path.join(folder, name)))
    return [path for _, path in sorted(found, reverse=True)]


def load_checkpoint_file(path: str) -> Dict[str, Any]:
    """Read a consolidated checkpoint; refuses anything that needs unpickling arbitrary objects."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: checkpoint not found")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt file, or a pickle with arbitrary objects
        raise load_refusal(path, e) from None
    compat.refuse_fairseq(path, state)
    return state


def check_compatible(path: str, state: Dict[str, Any], args, dictionary_size: int) -> None:
    """A checkpoint of another architecture or dictionary is refused before anything is loaded."""
    cfg = state.get("cfg", {})
    for key in ("decoder_layers", "decoder_embed_dim", "decoder_attention_heads", "decoder_ffn_embed_dim"):
        if key in cfg and getattr(args, key, cfg[key]) != cfg[key]:
            raise UserError(f"{path}: checkpoint has --{key.replace('_', '-')} {cfg[key]} but this run has "
                            f"{getattr(args, key)}; use the same --arch or another --save-dir")
    embed = next((v for k, v in state["model"].items() if k.endswith("embed_tokens.weight")), None)
    if embed is not None and embed.shape[0] != dictionary_size:
        raise UserError(f"{path}: checkpoint was trained with a dictionary of {embed.shape[0]} symbols "
                        f"but the data-bin's dict.txt has {dictionary_size}; use the same data-bin")


ADAM_FAMILY = ("adam", "cpu_adam")  # same state layout (torch AdamW's): their states load into each other


def adapt_optimizer_state(path: str, state: Dict[str, Any], optimizer: torch.optim.Optimizer, args) -> Dict[str, Any]:
    """The saved optimizer state, ready for this run's optimizer.

    Same ``--optimizer``: as saved. adam <-> cpu_adam: the per-parameter state (step and moments;
    cpu_adam's fp16 moments with scales are expanded to fp32) with this run's hyperparameters,
    since the two keep different param_group keys. Any other change: a UserError.
    """
    saved = state["last_optimizer_state"]
    saved_name, name = state.get("optimizer_name"), getattr(args, "optimizer", None)
    if saved_name is None or saved_name == name:
        return saved
    if saved_name not in ADAM_FAMILY or name not in ADAM_FAMILY:
        raise UserError(f"{path}: optimizer state was saved by --optimizer {saved_name} but this run uses "
                        f"--optimizer {name}; add --reset-optimizer to start a fresh optimizer state")
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise UserError(f"{path}: optimizer state has {len(saved['param_groups'])} parameter groups, this run "
                        f"{len(optimizer.param_groups)}; add --reset-optimizer")
    groups = []
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": saved_group["params"]})
    per_param = {}
    for key, st in saved["state"].items():
        st = dict(st)
        for moment in ("exp_avg", "exp_avg_sq"):
            scale = st.pop(f"{moment}_scale", None)
            if scale is not None:  # cpu_adam --fp16-adam-stats: fp16 values times one fp32 scale
                st[moment] = st[moment].float() * scale.float()
        per_param[key] = st
    logger.info(f"optimizer state of --optimizer {saved_name} loaded into --optimizer {name} "
                f"(steps and moments kept; hyperparameters from this run's flags)")
    return {"state": per_param, "param_groups": groups}


def load_into_trainer(path: str, state: Dict[str, Any], trainer, args) -> Dict[str, Any]:
    """Restore model (and optimizer unless --reset-optimizer); return the extra state."""
    set_model_state_dict(trainer.model, state["model"], options=FULL_STATE)
    if not args.reset_optimizer and "last_optimizer_state" in state:
        optim_state = adapt_optimizer_state(path, state, trainer.optimizer, args)
        set_optimizer_state_dict(trainer.model, trainer.optimizer, optim_state, options=FULL_STATE)
    extra = state["extra_state"]
    trainer.load_extra_state(extra["trainer"], reset_lr_scheduler=args.reset_lr_scheduler)
    if not args.reset_meters and extra.get("metrics"):
        from toolkit.logging import metrics

        metrics.load_state_dict(extra["metrics"])
    logger.info(f"loaded checkpoint {path} (epoch {extra['train_iterator'].get('epoch')} "
                f"@ {trainer.num_updates} updates)")
    return extra


def out_of_patience(args, best: BestTracker, val_loss: Optional[float]) -> bool:
    """fairseq's --patience: validations in a row without a new best."""
    if args.patience <= 0 or val_loss is None:
        return False
    if best.is_better(val_loss):
        best.runs_without_improvement = 0
        return False
    best.runs_without_improvement += 1
    return best.runs_without_improvement >= args.patience


def save_checkpoint(args, trainer, epoch_itr, val_loss: Optional[float], best: BestTracker,
                    end_of_epoch: bool, env) -> None:
    """Every rank calls this (gathering a sharded state is collective); rank 0 writes."""
    names = checkpoint_names(args, epoch_itr.epoch, end_of_epoch, trainer.num_updates, val_loss, best)
    if not names:
        return
    new_best = best.best if val_loss is None or not best.is_better(val_loss) else val_loss
    if args.use_sharded_state:  # every rank writes its shard (DCP), see toolkit.checkpoint.sharded
        from toolkit.checkpoint import sharded

        folder = os.path.join(args.save_dir, sharded.folder_name(names[0]))
        with write_errors.reported(folder, args.save_dir, remove=sharded._tmp_path(folder)):
            sharded.save_checkpoint(args, trainer, epoch_itr, names, val_loss, new_best, env)
        return
    state = build_checkpoint(args, trainer, epoch_itr.state_dict(), val_loss, new_best)
    if env.is_master:
        with write_errors.reported(os.path.join(args.save_dir, names[0]), args.save_dir):
            write_checkpoint(state, args.save_dir, names)
        prune_checkpoints(args)


def restore_path(args) -> str:
    if os.path.isabs(args.restore_file) or os.path.exists(args.restore_file):
        return args.restore_file
    return os.path.join(args.save_dir, args.restore_file)


def load_latest(args, trainer, best: BestTracker) -> Optional[Dict[str, Any]]:
    """Resume from --restore-file (default checkpoint_last.pt in --save-dir) when it exists.

    Returns the data iterator's saved position, or None for a fresh start.
    """
    path = restore_path(args)
    from toolkit.checkpoint import sharded  # sharded (DCP) folders and fairseq -shard{N}.pt sets

    extra = sharded.load_latest(path, args, trainer)
    if extra is not None:
        best.best = extra.get("best")
        return extra.get("train_iterator")
    if not os.path.exists(path):
        if args.restore_file != "checkpoint_last.pt":
            raise UserError(f"--restore-file {args.restore_file}: not found (looked for {path})")
        return None
    state = load_checkpoint_file(path)
    check_compatible(path, state, args, len(trainer.task.dictionary))
    identity.check_dictionary(path, identity.saved_hash(state.get("extra_state")), trainer.task.dictionary,
                              identity.dict_path_of(trainer.task))
    compat.check_resume(path, {k: tuple(v.shape) for k, v in state["model"].items()}, state.get("cfg", {}), args,
                        trainer.model)
    extra = load_into_trainer(path, state, trainer, args)
    best.best = extra.get("best")
    return sharded.rescale_iterator_state(extra.get("train_iterator"), state.get("cfg", {}).get(
        "distributed_world_size"), args.distributed_world_size)  # saved on another world size
