"""``toolkit.plan``: per-rank memory and step time of a training run, before renting the machines.

    from toolkit.plan import make_plan, table, summary, PRESETS
    plan = make_plan(train_config, PRESETS["h100"])
    print(table(plan)); print(summary(plan))

Takes the resolved :class:`~toolkit.config.TrainConfig` of the same flags ``toolkit-train`` takes,
so a plan and the run it predicts cannot disagree about what was asked. The model's own parameter
shapes, FLOPs per token and saved activations come from a meta-device build
(:mod:`toolkit.plan.model_stats`); bytes per item from :mod:`toolkit.plan.memory`; the step time
from :mod:`toolkit.plan.step_time`. ``benchmarks/plan_check.py`` compares the predictions with
measured runs.
"""

from __future__ import annotations

import importlib
from typing import Any

from toolkit.plan.hardware import PRESETS, Hardware, detect_hardware

# The planner builds the model on the meta device (torch); the hardware flags above are torch-free, so
# toolkit-plan --help and its argument errors exit before torch is imported. The rest comes in at first use.
_LAZY_NAMES = {
    "Plan": "planner",
    "make_plan": "planner",
    "summary": "report",
    "summary_for_train": "report",
    "table": "report",
    "verdict": "report",
}

__all__ = [
    "Plan",
    "make_plan",
    "PRESETS",
    "Hardware",
    "detect_hardware",
    "summary_for_train",
    "summary",
    "table",
    "verdict",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(f"toolkit.plan.{_LAZY_NAMES[name]}"), name)
    raise AttributeError(f"module 'toolkit.plan' has no attribute '{name}'")
