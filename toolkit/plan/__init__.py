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

from toolkit.plan.hardware import PRESETS, Hardware, detect_hardware
from toolkit.plan.planner import Plan, make_plan, plan_for
from toolkit.plan.report import summary, summary_for_train, table, verdict

__all__ = ["Plan", "make_plan", "plan_for", "PRESETS", "Hardware", "detect_hardware", "summary_for_train",
           "summary", "table", "verdict"]
