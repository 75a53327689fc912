"""A run's state as named Statefuls: what a checkpoint holds, each piece under its key in the file.

The formats (``consolidated``: one ``.pt``; ``sharded``: a DCP folder) are given one mapping
``{key: Stateful}`` (torchtitan's ``CheckpointManager(states=...)``) and save or load every entry
without knowing what it is; the trainer builds the mapping (``Trainer.statefuls``). So a new piece
of run state (a second EMA) is one more entry, and one more key in the file. The formats store two
kinds of state, so there are two kinds of entry:

- :class:`TensorState` (the model, the optimizer): tensors that may be sharded across ranks.
  ``state_dict(full=True)`` gathers them whole for the ``.pt`` file; ``full=False`` is what this
  rank holds, which DCP writes and reads back in place (resharding to this run's world size).
- any other Stateful (``state_dict()`` / ``load_state_dict(state)``): plain values and small CPU
  tensors (counters, LR schedule, loss scale, meters, data position, EMA), stored under its key in
  the checkpoint's ``extra_state`` in every format. A key the file lacks loads as ``None``.
- a :class:`ShardedExtra` (the EMA): a plain Stateful whose whole tensors go in a ``.pt``'s
  ``extra_state`` (fairseq's place for the average), while the sharded format writes what each rank
  holds of them as DCP entries under its key, as it does the model's: gathering them whole there
  would be a collective that the one rank writing ``meta.pt`` cannot run alone.

Loading goes in the mapping's order, tensors first: the EMA restarts from the loaded weights, and
the LR schedule steps to the loaded update count after the optimizer's learning rate is restored.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

import torch
from toolkit.checkpoint.dcp_state import (  # DCP imported at the first call
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from toolkit.checkpoint.common import check_optimizer_switch, log_optimizer_switch, switch_optimizer_state
from toolkit.core.dtensor import is_dtensor
from toolkit.core.errors import UserError
from toolkit.optim.param_groups import DecayChoice, check_resumed_decay_groups

logger = logging.getLogger(__name__)

FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)

Statefuls = Mapping[str, Any]  # key in the file -> TensorState or Stateful
Shapes = Dict[str, Tuple[int, ...]]
# check(file, saved cfg, saved extra_state, {tensor entry: its saved shapes}): refuses another model before any load
Check = Callable[[str, Dict[str, Any], Optional[Dict[str, Any]], Dict[str, Shapes]], None]


class TensorState:
    """Tensors a format stores its own way (whole in a ``.pt``, as each rank's shards in DCP).

    ``saved``: whether a save writes this entry (``--no-save-optimizer-state`` leaves the optimizer out);
    ``side_values``: plain values stored beside the tensors (the optimizer's name), whether saved or not;
    ``prepare_load``: whether this run loads the entry from a file whose side values and (for DCP)
    tensor shapes are given, checked before anything loads; ``load_template``: what DCP reads into.
    """

    saved = True
    optional = False  # a file without this entry still loads (the optimizer: --no-save-optimizer-state)

    def state_dict(self, full: bool = False) -> Dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: Dict[str, Any], full: bool = False) -> None:
        raise NotImplementedError

    def side_values(self) -> Dict[str, Any]:
        return {}

    def prepare_load(self, where: str, side: Mapping[str, Any], shapes: Optional[Shapes]) -> bool:
        return True

    def load_template(self) -> Dict[str, Any]:
        return self.state_dict(full=False)


class ModelState(TensorState):
    """A model (FSDP2, DDP or plain) by parameter name (``torch.distributed.checkpoint.state_dict``)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self, full: bool = False) -> Dict[str, Any]:
        return get_model_state_dict(self.model, options=FULL_STATE if full else None)

    def load_state_dict(self, state: Dict[str, Any], full: bool = False) -> None:
        if full:
            template = get_model_state_dict(self.model)
            if any(is_dtensor(t) for t in template.values()):
                set_model_state_dict(self.model, cut_locally(state, template))
                return
        set_model_state_dict(self.model, state, options=FULL_STATE if full else None)


def cut_locally(full: Any, template: Any) -> Any:
    """A whole (consolidated) state as this rank's shards of ``template``'s DTensors, cut on every rank without
    communication, as ``init_weights`` cuts fresh values (every rank has read the whole file).

    Why not DCP's full-state load: it scatters each tensor from rank 0 (``distribute_tensor``'s default source),
    and that path refuses FSDP2-over-TP's ``_StridedShard`` of a dimension the mesh does not divide evenly (an odd
    vocabulary under ``--model-parallel-size 2``: a fresh run splits it unevenly, and so does this). A tensor whose
    shape differs from the template's (whole expert stacks: their own load hook cuts them), and one already a DTensor
    (what DCP loaded in place), stays as it is."""
    if isinstance(full, Mapping) and isinstance(template, Mapping):
        return {k: cut_locally(v, template.get(k)) for k, v in full.items()}
    if (
        is_dtensor(template)
        and torch.is_tensor(full)
        and not is_dtensor(full)
        and tuple(full.shape) == tuple(template.shape)
    ):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(
            full.detach().to(template.device, template.dtype),
            template.device_mesh,
            template.placements,
            src_data_rank=None,
        )
    return full


class OptimizerState(TensorState):
    """An optimizer's state keyed by parameter name; saved with its ``--optimizer`` name.

    A state saved by the other Adam (adam <-> cpu_adam: the same per-parameter layout) loads with this
    run's hyperparameters (:func:`toolkit.checkpoint.common.check_optimizer_switch`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        name: str,
        save: bool = True,
        reset: bool = False,
        decay: Optional[DecayChoice] = None,
    ):
        self.model, self.optimizer, self.name = model, optimizer, name
        self.decay = decay  # this run's weight-decay grouping flags, checked against the checkpoint's cfg
        self.saved, self.reset, self.optional = save, reset, True
        self._where = ""  # the file being loaded, for the messages of a switch
        self._switch_from: Optional[str] = None  # the saved optimizer's name while loading another's state
        self._groups: Optional[list] = None  # this run's param_groups, kept aside for a sharded switch

    def state_dict(self, full: bool = False) -> Dict[str, Any]:
        from toolkit.distributed import expert_parallel

        state = get_optimizer_state_dict(self.model, self.optimizer, options=FULL_STATE if full else None)
        # whole expert stacks in both formats: each ep rank holds other experts under the same names, so the sharded
        # format too names the [E, ...] stack (the model's state_dict hook gathers its weights the same way)
        return expert_parallel.gather_optimizer_state(self.model, self.optimizer, state)

    def side_values(self) -> Dict[str, Any]:
        return {"optimizer_name": self.name if self.saved else None}

    def prepare_load(self, where: str, side: Mapping[str, Any], shapes: Optional[Shapes]) -> bool:
        if self.reset:
            return False
        saved_name, self._where = side.get("optimizer_name"), where
        if self.decay is not None:
            check_resumed_decay_groups(where, DecayChoice.from_saved(side.get("cfg")), self.decay, self.model)
        self._switch_from = saved_name if check_optimizer_switch(where, saved_name, self.name) else None
        if shapes is not None:
            self._check_sharded(where, shapes)
        return True

    def _check_sharded(self, folder: str, shapes: Shapes) -> None:
        """fp16 moments (``--fp16-adam-stats``) are stored with scales that a sharded switch would not apply,
        and 8-bit moments do not convert value by value: those go through a consolidated file. ``shapes`` are
        DCP's flat keys, where the optimizer is saved under ``optim`` (the key ``Trainer.statefuls`` gives it)."""
        from toolkit.optim.quantized_states import check_sharded_load

        saved_fp16 = any(k.endswith("_scale") and k.startswith("optim.state.") for k in shapes)
        if self._switch_from is not None and (saved_fp16 or getattr(self.optimizer, "fp16_adam_stats", False)):
            raise UserError(
                f"{folder}: switching between --optimizer {self._switch_from} and {self.name} with "
                f"--fp16-adam-stats goes through a consolidated checkpoint: run toolkit-consolidate "
                f"{folder} and pass the .pt to --restore-file, or add --reset-optimizer"
            )
        check_sharded_load(folder, shapes, self.optimizer)

    def load_template(self) -> Dict[str, Any]:
        template = self.state_dict(full=False)
        if self._switch_from is None:
            return template
        self._groups = template["param_groups"]  # hyperparameters from this run's flags
        return {"state": template["state"]}

    def load_state_dict(self, state: Dict[str, Any], full: bool = False) -> None:
        if self._switch_from is not None and full:
            state = switch_optimizer_state(self._where, state, self._switch_from, self.name, self.optimizer)
        elif self._switch_from is not None:
            state = {"state": state["state"], "param_groups": self._groups}
        if full or self._has_placed_experts():  # whole expert stacks in the file, this rank's experts kept
            state, full = self._own_part(state, full)
        set_optimizer_state_dict(self.model, self.optimizer, state, options=FULL_STATE if full else None)
        if self._switch_from is not None and not full:
            log_optimizer_switch(self._switch_from, self.name)
        self._switch_from, self._groups = None, None

    def _has_placed_experts(self) -> bool:
        from toolkit.distributed import expert_parallel

        return bool(expert_parallel.placed_parameters(self.model))

    def _own_part(self, state: Dict[str, Any], full: bool) -> Tuple[Dict[str, Any], bool]:
        """A state holding whole expert stacks (a ``.pt``'s full state, or a sharded load under
        ``--expert-parallel-size``) with this rank's experts kept, and where the model is sharded, every
        tensor cut to this rank's shards (then it loads as a sharded state: ``full`` False)."""
        from toolkit.distributed import expert_parallel

        state = expert_parallel.own_optimizer_state(self.model, state)
        template = get_optimizer_state_dict(self.model, self.optimizer)  # initializes the state to cut into
        if any(is_dtensor(t) for entry in template["state"].values() for t in entry.values()):
            state, full = {**state, "state": cut_locally(state["state"], template["state"])}, False
        return state, full


class StagedState(TensorState):
    """A model's or an optimizer's tensors that pipeline stages hold apart (``--pipeline-parallel-size``): saved
    whole as one process names them (each stage's full state merged on rank 0 by ``merge``) and loaded by each stage
    keeping its own names (``own``); the sharded format is the inner entry's (DCP's keys are already one-process
    names, each stage writing and reading its own; ``local`` gives the optimizer's groups every stage's names, so
    the one copy DCP keeps of them is the whole model's)."""

    def __init__(
        self,
        inner: TensorState,
        full_state: Callable[[], Dict[str, Any]],
        merge: Callable[[Dict[str, Any]], Dict[str, Any]],
        own: Callable[[Dict[str, Any]], Dict[str, Any]],
        local: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
    ):
        self.inner, self.full_state, self.merge, self.own = inner, full_state, merge, own
        self.local = local  # what every rank writes of its sharded state (the optimizer's groups: every stage's)
        self.saved, self.optional = inner.saved, inner.optional

    def state_dict(self, full: bool = False) -> Dict[str, Any]:
        if full:
            return self.merge(self.full_state())
        state = self.inner.state_dict(full=False)
        return self.local(state) if self.local is not None else state

    def load_state_dict(self, state: Dict[str, Any], full: bool = False) -> None:
        self.inner.load_state_dict(self.own(state), full=full)

    def side_values(self) -> Dict[str, Any]:
        return self.inner.side_values()

    def prepare_load(self, where: str, side: Mapping[str, Any], shapes: Optional[Shapes]) -> bool:
        return self.inner.prepare_load(where, side, shapes)

    def load_template(self) -> Dict[str, Any]:
        """The inner entry's, its optimizer groups every stage's as saved (DCP reads a group's keys by position)."""
        template = self.inner.load_template()
        return self.local(template) if self.local is not None and "param_groups" in template else template


STAGE_FULL_STATE = StateDictOptions(full_state_dict=True)  # every rank of a stage gets it (not rank 0 only)


def stage_model_state(model: torch.nn.Module) -> Dict[str, Any]:
    """This stage's parameters whole (gathered over its FSDP2 shards), on the CPU, on every rank of the stage."""
    return {k: v.cpu() for k, v in get_model_state_dict(model, options=STAGE_FULL_STATE).items()}


def stage_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """This stage's optimizer state whole, keyed by parameter name, on the CPU."""
    state = get_optimizer_state_dict(model, optimizer, options=STAGE_FULL_STATE)
    moved = {
        name: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for name, s in state["state"].items()
    }
    return {"state": moved, "param_groups": state["param_groups"]}


class ShardedExtra:
    """A plain Stateful (its whole tensors in ``extra_state``) with a by-rank view for DCP.

    ``local_state``: this rank's tensors by name (DTensor shards where the model is sharded), which DCP
    writes and reads back in place, resharded to this run's world size; ``load_local`` takes the loaded
    ones after the tensor entries (the model) have loaded."""

    def local_state(self) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_local(self, state: Dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


class Value:
    """A Stateful over a getter and a setter: a plain value another object keeps (the best metric).

    Without a setter the value is saved and not restored (the validation loss; the dictionary's
    hash, which is checked against the run's before anything loads).
    """

    def __init__(self, get: Callable[[], Any], restore: Optional[Callable[[Any], None]] = None):
        self._get, self._restore = get, restore

    def state_dict(self) -> Any:
        return self._get()

    def load_state_dict(self, state: Any) -> None:
        if self._restore is not None:
            self._restore(state)


class Meters:
    """The metrics aggregators (``toolkit.logging.metrics``), so averages and the wall clock continue
    across a resume; ``reset`` (``--reset-meters``) keeps this run's fresh meters."""

    def __init__(self, reset: bool = False):
        self.reset = reset

    def state_dict(self) -> Dict[str, Any]:
        from toolkit.logging import metrics

        return metrics.state_dict()

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        from toolkit.logging import metrics

        if not self.reset and state:
            metrics.load_state_dict(state)


class DataPosition:
    """Where in the data the run is: the epoch iterator's position (and the ``--update-freq`` it was
    counted with, for the resume's log line). Loading only records the position (``saved``): the
    iterator is built after the load, from the saved epoch."""

    def __init__(self, progress: Any, update_freq: int):
        self.progress, self.update_freq = progress, update_freq
        self.saved: Optional[Dict[str, Any]] = None

    def state_dict(self) -> Optional[Dict[str, Any]]:
        itr = self.progress.epoch_itr
        position = itr.state_dict() if itr is not None else None
        if position is not None:
            position["update_freq"] = self.update_freq
        return position

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        self.saved = state
        self.progress.saved_position = state


# --- what the formats call ------------------------------------------------------------------------


def tensor_entries(statefuls: Statefuls) -> Dict[str, TensorState]:
    return {k: s for k, s in statefuls.items() if isinstance(s, TensorState)}


def plain_entries(statefuls: Statefuls) -> Dict[str, Any]:
    return {k: s for k, s in statefuls.items() if not isinstance(s, TensorState)}


def sharded_extras(statefuls: Statefuls) -> Dict[str, ShardedExtra]:
    return {k: s for k, s in statefuls.items() if isinstance(s, ShardedExtra)}


def extra_state(statefuls: Statefuls, leave_out: Iterable[str] = ()) -> Dict[str, Any]:
    """The checkpoint's ``extra_state``: every plain entry's state under its key, in the mapping's order
    (but the keys in ``leave_out``: the sharded format's DCP entries)."""
    return {key: s.state_dict() for key, s in plain_entries(statefuls).items() if key not in leave_out}


def side_values(statefuls: Statefuls, saved_only: bool) -> Dict[str, Any]:
    """The tensor entries' plain values stored beside them (``saved_only``: only of entries a save writes)."""
    out: Dict[str, Any] = {}
    for s in tensor_entries(statefuls).values():
        if s.saved or not saved_only:
            out.update(s.side_values())
    return out


def load_extra_state(statefuls: Statefuls, extra: Mapping[str, Any], loaded: Iterable[str] = ()) -> None:
    """Every plain entry's state from ``extra`` (but the keys in ``loaded``: already read from DCP)."""
    for key, s in plain_entries(statefuls).items():
        if key not in loaded:
            s.load_state_dict(extra.get(key))


def shapes_by_entry(keys: Iterable[str], flat: Shapes) -> Dict[str, Shapes]:
    """DCP's flat tensor shapes (``model.embed_tokens.weight``) grouped by the entry they belong to."""
    out: Dict[str, Shapes] = {key: {} for key in keys}
    for name, shape in flat.items():
        key, _, rest = name.partition(".")
        if key in out:
            out[key][rest] = shape
    return out
