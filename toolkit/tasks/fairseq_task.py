"""fairseq's task base classes under their toolkit import path; they live in
:mod:`toolkit.compat.fairseq.plugins.task`, reached by name (``core.registry.fairseq_plugin_name``)."""

from toolkit.core import registry

FAIRSEQ_NAMES = ("FairseqTask", "LegacyFairseqTask", "register_task", "setup_task")
__getattr__ = registry.fairseq_plugin_getattr(__name__, FAIRSEQ_NAMES)
