"""Evaluation beyond perplexity: lm-evaluation-harness on toolkit checkpoints and ``toolkit-validate``.

``harness`` (the ``lm_eval`` adapter) needs the optional ``lm-eval`` package; ``text``,
``scoring`` and ``loading`` do not, so the arithmetic is tested and reused without it.
"""
