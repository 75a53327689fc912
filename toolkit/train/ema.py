"""fairseq's trainer-level EMA (``--store-ema``): a shadow copy of the weights, averaged after each update.

After update ``n`` (every ``--ema-update-freq`` updates) each tensor of the model's state
becomes ``ema = decay * ema + (1 - decay) * weight``, with ``decay`` 0 (a plain copy) while
``n < --ema-start-update`` and ``--ema-decay`` after, as ``fairseq.models.ema.EMA.step``.
The shadow lives beside the model (same device; fp32 with ``--ema-fp32``, else the
weights' dtype) and is saved in the checkpoint's ``extra_state["ema"]`` (fairseq's key),
keyed by the model's own state-dict names. It is not used for training or validation;
evaluate it by loading that state into a model (``EMA.copy_to``).

Under FSDP2 and tensor parallelism (and FSDP2's ``--cpu-offload``) the weights are DTensors and each
rank averages only its own shards: the average is elementwise, so a shard's average is the average's
shard and no update gathers anything. A consolidated checkpoint gathers the whole average (every rank
calls ``state_dict``, as it does for the model) and a load takes each rank's part of the whole tensors
saved, so the file holds the same whole tensors as one process's run. A sharded checkpoint
(``--use-sharded-state``) writes each rank's shards of the average as DCP entries (``ema.<name>``), as it
writes the model's, and reads them back resharded to the loading run's world size.

Under ``--pipeline-parallel-size`` each stage averages the layers it holds, and a checkpoint holds the whole
model's average (``EMAState``'s ``merge``); a stage loads its part of a saved average.

``--ema-seed-model PATH`` starts the average at the moving average saved in another run's
checkpoint (its ``extra_state["ema"]``, as fairseq's ``load_ema_from_checkpoint`` reads it),
not at the model's weights. PATH is a toolkit or a fairseq ``transformer_lm`` checkpoint,
read by the safe loaders (``weights_only``; fairseq's config objects through the allowlist)
and held to the model's names and shapes (fairseq's ``strict=True``). A checkpoint the run
resumes from replaces the seed with its own average, as in fairseq.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

import torch

from toolkit.checkpoint.model_fit import check_weights
from toolkit.checkpoint.stateful import ShardedExtra
from toolkit.compat.fairseq import adapter as fairseq_adapter
from toolkit.config import EMAConfig
from toolkit.core.dtensor import is_dtensor, local_tensor
from toolkit.core.errors import UserError

logger = logging.getLogger("toolkit.ema")  # the logger name log lines and filters already use
_checkpoint_logger = logging.getLogger("toolkit.checkpoint.common")  # the name of the loads' EMA line, kept

CHECKPOINT_KEY = "ema"  # fairseq's trainer.state_dict()["extra_state"]["ema"]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a DDP wrapper (its state-dict names without ``module.``)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class EMA:
    def __init__(self, model: torch.nn.Module, cfg: EMAConfig):
        self.cfg = cfg
        self.decay = cfg.ema_decay
        self.updates_since_step = 0
        self.shadow: Dict[str, torch.Tensor] = {}
        self.reset_from(model)
        if cfg.ema_seed_model:
            self.load_state_dict(seed_weights(cfg.ema_seed_model, model, self.shadow), model)
            logger.info(f"EMA seeded from the moving average in --ema-seed-model {cfg.ema_seed_model}")

    def reset_from(self, model: torch.nn.Module) -> None:
        """Start the average at the model's current weights (fairseq: on a checkpoint without an EMA)."""
        self.shadow = {k: self._stored(v) for k, v in unwrap(model).state_dict().items() if isinstance(v, torch.Tensor)}

    def _stored(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        return t.float() if self.cfg.ema_fp32 and t.is_floating_point() else t

    @torch.no_grad()
    def step(self, model: torch.nn.Module, num_updates: int) -> None:
        self.decay = 0.0 if num_updates < self.cfg.ema_start_update else self.cfg.ema_decay
        self.updates_since_step += 1
        if self.updates_since_step < max(1, self.cfg.ema_update_freq):
            return
        self.updates_since_step = 0
        for key, weight in unwrap(model).state_dict().items():
            avg = self.shadow.get(key)
            if avg is None or "version" in key:
                continue
            avg, weight = local_tensor(avg), local_tensor(weight.detach())  # this rank's shards (same layout)
            if not avg.is_floating_point():
                avg.copy_(weight)
                continue
            avg.mul_(self.decay).add_(weight.to(avg.dtype), alpha=1 - self.decay)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Whole CPU tensors, so a checkpoint holding them loads anywhere (``weights_only=True``).
        Collective under sharding: every rank calls it (the consolidated save does)."""
        return {k: whole(v).detach().to("cpu", copy=True) for k, v in self.shadow.items()}

    def load_state_dict(self, state: Optional[Dict[str, torch.Tensor]], model: torch.nn.Module) -> bool:
        """Restore a saved average; without one, restart it from the (just loaded) model. Returns whether
        a saved average was found."""
        if not state:
            self.reset_from(model)
            return False
        for key, avg in self.shadow.items():
            if key in state:
                local_tensor(avg).copy_(this_ranks_part(state[key], avg).to(avg.device, avg.dtype))
        return True

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        """Load the averaged weights into ``model`` (fairseq's ``EMA.reverse``), for evaluation."""
        unwrap(model).load_state_dict({k: v for k, v in self.shadow.items()}, strict=False)


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (gathered over its mesh); a plain tensor itself."""
    return t.full_tensor() if is_dtensor(t) else t


def this_ranks_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of the whole tensor ``full`` that this rank holds of ``like`` (a DTensor: taken by a
    Replicate -> ``like``'s placements redistribution, a local slice with no communication)."""
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import DTensor, Replicate

    mesh = like.device_mesh
    replicated = DTensor.from_local(
        full.to(local_tensor(like).device), mesh, [Replicate()] * mesh.ndim, run_check=False
    )
    return replicated.redistribute(mesh, like.placements).to_local()


class EMAState(ShardedExtra):
    """The EMA as a checkpoint's Stateful (``extra_state["ema"]``; in a sharded checkpoint, each rank's shards
    as DCP entries): a checkpoint without an average restarts it from the loaded model, which must load first
    (tensor entries do). Under ``--pipeline-parallel-size`` each stage averages its own layers: ``merge`` joins the
    stages' averages into the whole model's (on the rank that writes the file), and a load keeps each stage's names
    (``EMA.load_state_dict`` takes the names its shadow has)."""

    def __init__(
        self,
        ema: EMA,
        model: torch.nn.Module,
        merge: Optional[Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]] = None,
    ):
        self.ema, self.model, self.merge = ema, model, merge

    def state_dict(self) -> Dict[str, torch.Tensor]:
        state = self.ema.state_dict()
        return state if self.merge is None else self.merge(state)

    def load_state_dict(self, state: Optional[Dict[str, torch.Tensor]]) -> None:
        if not self.ema.load_state_dict(state, self.model):
            _checkpoint_logger.info("EMA not found in checkpoint; --store-ema starts it from the loaded weights")

    def local_state(self) -> Dict[str, torch.Tensor]:
        """The average's own tensors (this rank's shards): DCP saves them, and loads into them in place."""
        return dict(self.ema.shadow)

    @torch.no_grad()
    def load_local(self, state: Dict[str, torch.Tensor]) -> None:
        for key, avg in self.ema.shadow.items():
            loaded = state[key]
            if loaded is not avg:  # DCP loaded into a copy: take its values
                local_tensor(avg).copy_(local_tensor(loaded))


def seed_weights(path: str, model: torch.nn.Module, shadow: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The moving average saved in checkpoint ``path`` under our names, checked against ``shadow``'s names
    and shapes (a toolkit or fairseq checkpoint; loaded without unpickling arbitrary objects)."""
    state = fairseq_adapter.read_checkpoint(path)
    return saved_average(path, state, model, shadow, flag=f"--ema-seed-model {path}")


def has_saved_average(state: Dict) -> bool:
    saved = (state.get("extra_state") or {}).get(CHECKPOINT_KEY)
    return isinstance(saved, dict) and bool(saved)


def saved_average(
    path: str, state: Dict, model: torch.nn.Module, shadow: Dict[str, torch.Tensor], flag: str
) -> Dict[str, torch.Tensor]:
    """``state``'s (read from ``path``) moving average under our names, checked against ``shadow``."""
    saved = (state.get("extra_state") or {}).get(CHECKPOINT_KEY)
    if not isinstance(saved, dict) or not saved:
        raise UserError(
            f'{flag}: the checkpoint holds no moving average (extra_state["ema"]); was it '
            f"trained with --store-ema? To start from its model weights, use --finetune-from-model"
        )
    saved = fairseq_adapter.average_weights(path, state, saved, unwrap(model))
    whole = getattr(unwrap(model), "whole_model_shapes", None)  # a pipeline stage: the whole model's average
    check_weights(
        flag,
        saved,
        shadow if whole is None else whole,
        saved_as="the saved moving average",
        fix="it was trained with another architecture or other model options; use the same model options",
    )
    return saved
