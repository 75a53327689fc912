"""What every checkpoint format shares: names, the training state, compatibility, optimizer switching, pruning.

The formats (``consolidated``: one ``.pt`` file; ``sharded``: a DCP folder; ``toolkit.compat.fairseq.shards``:
fairseq's ``-shard{N}.pt`` sets, read-only) save and load the run's Statefuls
(:mod:`toolkit.checkpoint.stateful`); they differ only in how they store the tensor entries (model,
optimizer). :class:`TrainingState` is the training loop's progress (data iterator, validation loss,
best metric) that some of those Statefuls read and restore.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from toolkit.checkpoint import best_checkpoints, finetune
from toolkit.config import CheckpointConfig
from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)

ADAM_FAMILY = ("adam", "cpu_adam")  # same state layout (torch AdamW's): their states load into each other
SHAPE_OPTIONS = ("decoder_layers", "decoder_embed_dim", "decoder_attention_heads", "decoder_ffn_embed_dim")


class BestTracker:
    """The best validation metric so far (restored from checkpoints), and fairseq's --patience count."""

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

    def out_of_patience(self, patience: int, val_loss: Optional[float]) -> bool:
        """fairseq's --patience: validations in a row without a new best."""
        if patience <= 0 or val_loss is None:
            return False
        if self.is_better(val_loss):
            self.runs_without_improvement = 0
            return False
        self.runs_without_improvement += 1
        return self.runs_without_improvement >= patience


@dataclass
class TrainingState:
    """The loop's progress: the data iterator, the last validation loss, the best metric.

    Not itself saved: ``statefuls()`` is the run's one mapping of Statefuls (the trainer's, which include
    adapters over these fields) that the checkpoint formats save and load. ``epoch_itr`` may be None while
    loading (the iterator is built after the data position is known, from ``saved_position``).
    """

    trainer: Any
    best: BestTracker
    epoch_itr: Any = None
    val_loss: Optional[float] = None
    saved_update: Optional[int] = None  # the update checkpoint_last holds (None: none yet); not saved itself
    saved_position: Optional[Dict[str, Any]] = None  # the data position the last load found; not saved itself

    def statefuls(self) -> Dict[str, Any]:
        """Everything a checkpoint holds, by key (``Trainer.statefuls``, which says why it is one mapping)."""
        return self.trainer.statefuls(self)

    def loaded_summary(self) -> str:
        """``epoch E @ N updates`` of the load just done, as the ``loaded checkpoint`` line says it."""
        return f"epoch {(self.saved_position or {}).get('epoch')} @ {self.trainer.num_updates} updates"


def checkpoint_names(
    cfg: CheckpointConfig,
    epoch: int,
    end_of_epoch: bool,
    num_updates: int,
    val_loss: Optional[float],
    best: BestTracker,
) -> List[str]:
    """Which files this save writes, by fairseq's rules."""
    names = collections.OrderedDict()
    names[f"checkpoint{epoch}.pt"] = end_of_epoch and not cfg.no_epoch_checkpoints and epoch % cfg.save_interval == 0
    names[f"checkpoint_{epoch}_{num_updates}.pt"] = (
        not end_of_epoch and cfg.save_interval_updates > 0 and num_updates % cfg.save_interval_updates == 0
    )
    names["checkpoint_best.pt"] = val_loss is not None and best.is_better(val_loss)
    if val_loss is not None and cfg.keep_best_checkpoints > 0:
        names[best_checkpoints.best_name(cfg, epoch, num_updates, val_loss)] = best_checkpoints.should_write(
            cfg, val_loss, best.best
        )
    names["checkpoint_last.pt"] = not cfg.no_last_checkpoints
    return [name for name, write in names.items() if write]


def restore_path(cfg: CheckpointConfig) -> str:
    """fairseq's: the default name in --save-dir, any other path relative to the working directory."""
    return finetune.restore_path(cfg)


def check_compatible(
    path: str, saved_cfg: Dict[str, Any], model_cfg: Any, embed_rows: Optional[int], dictionary_size: int
) -> None:
    """A checkpoint of another architecture or dictionary is refused before anything is loaded."""
    for key in SHAPE_OPTIONS:
        ours = getattr(model_cfg, key, saved_cfg.get(key))
        if key in saved_cfg and ours != saved_cfg[key]:
            raise UserError(
                f"{path}: checkpoint has --{key.replace('_', '-')} {saved_cfg[key]} but this run has "
                f"{ours}; use the same --arch or another --save-dir"
            )
    if embed_rows is not None and embed_rows != dictionary_size:
        raise UserError(
            f"{path}: checkpoint was trained with a dictionary of {embed_rows} symbols "
            f"but the data-bin's dict.txt has {dictionary_size}; use the same data-bin"
        )


def check_resumable(
    path: str,
    saved_cfg: Dict[str, Any],
    extra_state: Optional[Dict[str, Any]],
    saved_shapes: Dict[str, Any],
    model_cfg: Any,
    model: torch.nn.Module,
    task,
) -> None:
    """Same dictionary (symbols in order) and the same parameter names and shapes, else one line naming the
    flags that differ (before anything is loaded)."""
    from toolkit.checkpoint import identity, model_fit

    identity.check_dictionary(path, identity.saved_hash(extra_state), task.dictionary, identity.dict_path_of(task))
    model_fit.check_resume(path, saved_shapes, saved_cfg, model_cfg, model)


def check_optimizer_switch(path: str, saved_name: Optional[str], name: str) -> bool:
    """Whether the saved optimizer state is another optimizer's that loads into this one (adam <-> cpu_adam).

    Both keep torch AdamW's per-parameter layout (step, exp_avg, exp_avg_sq), so the state
    loads as is; their param_group keys differ, so those come from this run's flags.
    """
    if saved_name in (None, name):
        return False
    if saved_name not in ADAM_FAMILY or name not in ADAM_FAMILY:
        raise UserError(
            f"{path}: optimizer state was saved by --optimizer {saved_name} but this run uses "
            f"--optimizer {name}; add --reset-optimizer to start a fresh optimizer state"
        )
    return True


def switch_optimizer_state(
    path: str, saved: Dict[str, Any], saved_name: str, name: str, optimizer: torch.optim.Optimizer
) -> Dict[str, Any]:
    """A full optimizer state of ``saved_name`` made loadable into ``optimizer`` (``name``).

    Per-parameter state (cpu_adam's fp16 moments with scales expanded to fp32) with this
    run's hyperparameters.
    """
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise UserError(
            f"{path}: optimizer state has {len(saved['param_groups'])} parameter groups, this run "
            f"{len(optimizer.param_groups)}; add --reset-optimizer"
        )
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": saved_group["params"]}
        for saved_group, group in zip(saved["param_groups"], optimizer.param_groups)
    ]
    per_param = {}
    for key, st in saved["state"].items():
        st = dict(st)
        for moment in ("exp_avg", "exp_avg_sq"):
            scale = st.pop(f"{moment}_scale", None)
            if scale is not None:  # cpu_adam --fp16-adam-stats: fp16 values times one fp32 scale
                st[moment] = st[moment].float() * scale.float()
        per_param[key] = st
    log_optimizer_switch(saved_name, name)
    return {"state": per_param, "param_groups": groups}


def log_optimizer_switch(saved_name: str, name: str) -> None:
    logger.info(
        f"optimizer state of --optimizer {saved_name} loaded into --optimizer {name} "
        f"(steps and moments kept; hyperparameters from this run's flags)"
    )


def prune(cfg: CheckpointConfig, folders: bool = False) -> None:
    """--keep-interval-updates and --keep-last-epochs, as fairseq (newest kept), and --keep-best-checkpoints;
    files or DCP folders."""
    best_checkpoints.prune_best(cfg, folders)
    suffix = "" if folders else r"\.pt"
    for keep, pattern in (
        (cfg.keep_interval_updates, r"checkpoint_\d+_(\d+)" + suffix),
        (cfg.keep_last_epochs, r"checkpoint(\d+)" + suffix),
    ):
        if keep <= 0:
            continue
        for path in _sorted_checkpoints(cfg.save_dir, pattern, folders)[keep:]:
            if folders:
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)


def _sorted_checkpoints(folder: str, pattern: str, folders: bool) -> List[str]:
    """Newest first."""
    regex = re.compile(pattern)
    found = []
    for name in os.listdir(folder):
        m = regex.fullmatch(name)
        path = os.path.join(folder, name)
        if m and os.path.isdir(path) == folders:
            found.append((int(m.group(1)), path))
    return [path for _, path in sorted(found, reverse=True)]


def vocabulary_rows(shapes: Dict[str, Any]) -> Optional[int]:
    """Dictionary size from tensor shapes by name: ``embed_tokens.weight``'s rows, or the sum of an
    adaptive input's bands (``embed_tokens.embeddings.{i}.0.weight``)."""
    plain = [s for k, s in shapes.items() if k.endswith("embed_tokens.weight")]
    if plain:
        return int(plain[0][0])
    bands = [s for k, s in shapes.items() if re.search(r"embed_tokens\.embeddings\.\d+\.0\.weight$", k)]
    return sum(int(s[0]) for s in bands) if bands else None


def saved_data_parallel_size(saved_cfg: Dict[str, Any]) -> Optional[int]:
    """Replicas the saved data position was counted on (older checkpoints: every rank was one)."""
    return saved_cfg.get("data_parallel_size") or saved_cfg.get("distributed_world_size")


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def saved_line(path: str, state: TrainingState, seconds: float) -> str:
    """fairseq's checkpoint_utils.save_checkpoint line, word for word (score: the validation loss, or None)."""
    epoch = state.epoch_itr.epoch if state.epoch_itr is not None else None
    return (
        f"Saved checkpoint {path} (epoch {epoch} @ {state.trainer.num_updates} updates, score {state.val_loss}) "
        f"(writing took {seconds} seconds)"
    )
