"""Criterions (``--criterion``); fairseq's names for plugins: ``register_criterion``, ``FairseqCriterion``
(toolkit.criterions.fairseq_criterion)."""

from toolkit.criterions.fairseq_criterion import FairseqCriterion, register_criterion  # noqa: F401
