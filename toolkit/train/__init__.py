"""Training: the trainer, the loop, EMA, AMP retries, the run's checkpoint manager and flag resolution.

It sits above evaluation because a run evaluates while it trains (see docs/design.md).
"""
