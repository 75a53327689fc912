"""Criterions (``--criterion``); fairseq's names for plugins: ``register_criterion``, ``FairseqCriterion``
(toolkit.criterions.fairseq_criterion)."""

from toolkit.core import registry
from toolkit.criterions.fairseq_criterion import FAIRSEQ_NAMES

__getattr__ = registry.fairseq_plugin_getattr(__name__, FAIRSEQ_NAMES)
