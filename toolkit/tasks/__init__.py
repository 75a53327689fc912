"""Tasks (``--task``); fairseq's names for plugins and scripts: ``setup_task``, ``register_task``,
``FairseqTask``, ``LegacyFairseqTask`` (toolkit.tasks.fairseq_task)."""

from toolkit.tasks.fairseq_task import FairseqTask, LegacyFairseqTask, register_task, setup_task  # noqa: F401
