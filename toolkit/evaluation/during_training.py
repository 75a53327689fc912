"""lm-evaluation-harness tasks during training (``--eval-harness-tasks T --eval-harness-interval-updates N``).

Every N updates the master rank evaluates the current model on the tasks and logs fairseq-style

    | eval_harness | epoch 003 | toolkit_wiki_cloze_acc 0.251 | toolkit_wiki_cloze_acc_norm 0.27 | num_updates 300

(TensorBoard/W&B scalars under ``eval_harness``); the other ranks wait at a barrier and receive the
numbers, so a harness metric (``--best-checkpoint-metric toolkit_wiki_cloze_acc
--maximize-best-checkpoint-metric``) decides ``checkpoint_best.pt`` on every rank alike.

The model is gathered first (a collective: the full state dict, as a consolidated checkpoint is
written), so sharded (FSDP2) and tensor-parallel models are evaluated whole, in a fresh copy on
the master's device; the training model and every random generator are left as they were, so a
resumed run trains exactly as an uninterrupted one.
"""

from __future__ import annotations

import logging
import random
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)

SKIPPED_KEYS = ("alias", "name", "sample_len", "samples")


def check_options(dataset_cfg) -> None:
    """At resolve time, before any worker starts: the flags agree and lm-eval is installed."""
    tasks, interval = dataset_cfg.eval_harness_tasks, dataset_cfg.eval_harness_interval_updates
    if not tasks:
        if interval > 0 or dataset_cfg.eval_harness_limit is not None:
            raise UserError("--eval-harness-interval-updates/--eval-harness-limit need --eval-harness-tasks")
        return
    if interval <= 0:
        raise UserError(
            f"--eval-harness-tasks {tasks}: also give --eval-harness-interval-updates N (evaluate every N updates)"
        )
    if dataset_cfg.eval_harness_limit is not None and dataset_cfg.eval_harness_limit <= 0:
        raise UserError(f"--eval-harness-limit {dataset_cfg.eval_harness_limit}: must be positive")
    from toolkit.evaluation.harness_main import require_lm_eval

    require_lm_eval()


def due(dataset_cfg, num_updates: int) -> bool:
    interval = dataset_cfg.eval_harness_interval_updates
    return bool(dataset_cfg.eval_harness_tasks) and interval > 0 and num_updates > 0 and num_updates % interval == 0


def flatten(results: Dict) -> Dict[str, float]:
    """``{task}_{metric}`` (``_{filter}`` unless the filter is ``none``) -> value, stderrs left out."""
    out: Dict[str, float] = {}
    for task, values in sorted(results.get("results", {}).items()):
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if metric in SKIPPED_KEYS or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            out[f"{task}_{metric}" + (f"_{filt}" if filt and filt != "none" else "")] = float(value)
    return out


@contextmanager
def rng_kept() -> Iterator[None]:
    """The harness seeds Python's, numpy's and torch's generators; training must not notice."""
    states = (
        random.getstate(),
        np.random.get_state(),
        torch.get_rng_state(),
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    )
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


def _eval_copy(cfg, trainer, state_dict) -> torch.nn.Module:
    from toolkit.models import build_for_loading

    model = build_for_loading(cfg.components.arch, cfg.model, trainer.task, trainer.device)
    model.load_state_dict(state_dict)
    return model.eval()


_EVALUATORS: Dict[int, HarnessEvaluator] = {}


def evaluator(cfg) -> HarnessEvaluator:
    """The run's evaluator (one per TrainConfig: the task index is built once per run)."""
    if id(cfg) not in _EVALUATORS:
        _EVALUATORS[id(cfg)] = HarnessEvaluator(cfg)
    return _EVALUATORS[id(cfg)]


class HarnessEvaluator:
    """Holds the task list (indexed once) across a run's evaluations."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.names: List[str] = [t.strip() for t in cfg.dataset.eval_harness_tasks.split(",") if t.strip()]
        self.manager = None

    def evaluate(self, trainer, env) -> Dict[str, float]:
        """Collective: every rank calls it; every rank returns the master's numbers."""
        from toolkit.checkpoint.consolidated import model_state

        full_state = model_state(trainer.model)  # every rank takes part; rank 0 gets the tensors
        stats: List[Optional[Dict[str, float]]] = [None]
        if env.is_master:
            stats[0] = self._run(trainer, full_state)
        del full_state
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(stats, src=0)
        return stats[0] or {}

    def _run(self, trainer, full_state) -> Dict[str, float]:
        from toolkit.evaluation.harness import ToolkitLM
        from toolkit.evaluation.harness_main import evaluate, task_manager

        data = self.cfg.dataset
        if self.manager is None:
            self.manager = task_manager(self.names, data.eval_harness_include_path)
        model = _eval_copy(self.cfg, trainer, full_state)
        lm = ToolkitLM(
            models=[model], task=trainer.task, batch_size=data.eval_harness_batch_size, device=str(trainer.device)
        )
        with rng_kept(), torch.no_grad():
            results = evaluate(lm, self.names, self.manager, limit=data.eval_harness_limit, seed=self.cfg.common.seed)
        return flatten(results)
