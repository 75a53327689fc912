"""What the layout-search tests check of every proposal (tests/unit/test_plan_search.py, tests/integration/
test_plan_search.py): toolkit-train's own parser and resolver take the flags and read back the layout priced."""

from __future__ import annotations

from typing import Any, Sequence

from toolkit.plan.planner import make_plan
from toolkit.plan.setup import setup_from_config
from toolkit.train.arguments import parse_train_args
from toolkit.train.resolve import resolve


def resolved(argv: Sequence[str]) -> Any:
    """toolkit-train's resolved config of ``argv`` (a UserError where it refuses them)."""
    args, explicit = parse_train_args(list(argv), "toolkit-train")
    return resolve(args, explicit)[0]


def check_proposals(argv: Sequence[str], hw: Any, found: Any, base: Any) -> None:
    """Each proposal, added to the command, is resolved by toolkit-train into the layout that was priced (which
    fits and runs the update as given), and the first is planned again from its resolved config, from scratch."""
    assert found.shown and found.refused == 0  # the search priced each layout as toolkit-train reads its flags
    for candidate in found.shown:
        cfg = resolved(list(argv) + list(candidate.flags))
        assert setup_from_config(cfg, hw.has_gpu) == candidate.plan.setup, candidate.flags
        assert candidate.plan.fits and candidate.plan.time.tokens_per_step == base.time.tokens_per_step
    replanned = make_plan(resolved(list(argv) + list(found.shown[0].flags)), hw)
    assert replanned.fits and replanned.gpu_peak == found.shown[0].plan.gpu_peak
    steps = [(c.lossy, c.step_s) for c in found.shown]
    assert steps == sorted(steps)
