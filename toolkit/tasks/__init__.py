"""Tasks (``--task``); fairseq's names for plugins and scripts: ``setup_task``, ``register_task``,
``FairseqTask``, ``LegacyFairseqTask`` (toolkit.tasks.fairseq_task)."""

from toolkit.core import registry
from toolkit.tasks.fairseq_task import FAIRSEQ_NAMES

__getattr__ = registry.fairseq_plugin_getattr(__name__, FAIRSEQ_NAMES)
