"""fairseq's task base classes under their toolkit import path; they live in :mod:`toolkit.compat_plugins.task`
(the plugin API, a layer below the families)."""

from toolkit.compat_plugins.task import FairseqTask, LegacyFairseqTask, register_task, setup_task  # noqa: F401
