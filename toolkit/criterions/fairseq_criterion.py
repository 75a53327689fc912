"""fairseq's criterion base class under its toolkit import path; it lives in
:mod:`toolkit.compat.fairseq.plugins.criterion`, reached by name (``core.registry.fairseq_plugin_name``)."""

from toolkit.core import registry

FAIRSEQ_NAMES = ("FairseqCriterion", "register_criterion")
__getattr__ = registry.fairseq_plugin_getattr(__name__, FAIRSEQ_NAMES)
