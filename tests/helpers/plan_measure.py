"""``python -m tests.helpers.plan_measure ARGV_JSON OUT [--peak]``: toolkit-plan's prediction beside the trainer's
own counts (toolkit.plan.measure) for one toolkit-train command line, printed as one JSON line.

A process of its own per run (tests/integration/test_plan.py starts it with ``run_cli``): FSDP2 needs a
process group, which must not outlive the test. ``--peak``: every rank's live-tensor peak of an update and the
plan's update peak instead of the per-item counts.
"""

from __future__ import annotations

import json
import sys


def main(argv, out: str, peak: bool) -> None:
    from toolkit.plan import PRESETS, make_plan
    from toolkit.plan.measure import measure_run
    from toolkit.train.resolve import parse_train_config

    cfg = parse_train_config(argv)
    ranks = measure_run(cfg, out, peak=peak)
    plan = make_plan(cfg, PRESETS["cpu"], world_size=cfg.distributed.distributed_world_size)
    if peak:
        result = {"measured": [r["live_peak"] for r in ranks], "predicted": plan.update_peak.host}
    else:
        result = {"ranks": ranks, "items": {i.name: i.gpu + i.host for i in plan.items}}
    print(json.dumps(result))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2], "--peak" in sys.argv[3:])
