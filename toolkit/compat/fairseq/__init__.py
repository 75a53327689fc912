"""fairseq's Python names, so that fairseq scripts and plugins port by renaming the import.

The implementations live in this package; ``toolkit.checkpoint_utils``, ``toolkit.utils``,
``toolkit.options``, ``toolkit.models``, ``toolkit.tasks``, ``toolkit.criterions`` and
``toolkit.dataclass`` re-export them under fairseq's module names (docs/fairseq_python_api.md).
"""
