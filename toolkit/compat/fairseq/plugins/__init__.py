"""fairseq's plugin API (``--user-dir``): the base classes and decorators a fairseq plugin imports, on the
toolkit's registry, and what turns their options into the toolkit's.

A plugin imports these names under fairseq's paths (``from toolkit.models import FairseqLanguageModel``,
``toolkit.tasks``, ``toolkit.criterions``, ``toolkit.dataclass``; docs/plugins.md), so ``from fairseq.models
import ...`` ports by renaming the import. The families sit below this package, so their fairseq paths reach
it by name (``toolkit.core.registry.fairseq_plugin_name``), never by an import; the toolkit's own families,
criterions and tasks register through ``toolkit.core.registry`` and use none of it.

- ``dataclass``: ``FairseqDataclass``, ``ChoiceEnum``;
- ``legacy_args``: a plugin's ``add_args(parser)`` options as an options dataclass;
- ``model``: ``BaseFairseqModel``, ``FairseqDecoder``, ``FairseqIncrementalDecoder``,
  ``FairseqLanguageModel``, ``register_model``, ``register_model_architecture``;
- ``task``: ``FairseqTask``, ``LegacyFairseqTask``, ``register_task``, ``setup_task``;
- ``criterion``: ``FairseqCriterion``, ``register_criterion``, and ``calls_the_model`` (the trainer's test of
  fairseq's criterion contract).
"""

from toolkit.compat.fairseq.plugins.dataclass import ChoiceEnum, FairseqDataclass, StrEnum, with_enum_choices
from toolkit.compat.fairseq.plugins.model import (
    INIT_VALUES_KEY,
    BaseFairseqModel,
    FairseqDecoder,
    FairseqIncrementalDecoder,
    FairseqIncrementalState,
    FairseqLanguageModel,
    register_model,
    register_model_architecture,
    with_incremental_state,
)
from toolkit.compat.fairseq.plugins.task import FairseqTask, LegacyFairseqTask, register_task, setup_task
from toolkit.compat.fairseq.plugins.criterion import FairseqCriterion, calls_the_model, register_criterion

__all__ = [
    "BaseFairseqModel",
    "ChoiceEnum",
    "FairseqCriterion",
    "FairseqDataclass",
    "FairseqDecoder",
    "FairseqIncrementalDecoder",
    "FairseqIncrementalState",
    "FairseqLanguageModel",
    "FairseqTask",
    "INIT_VALUES_KEY",
    "LegacyFairseqTask",
    "StrEnum",
    "calls_the_model",
    "register_criterion",
    "register_model",
    "register_model_architecture",
    "register_task",
    "setup_task",
    "with_enum_choices",
    "with_incremental_state",
]
