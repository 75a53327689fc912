"""fairseq's model base classes under their toolkit import path; they live in
:mod:`toolkit.compat.fairseq.plugins.model`, reached by name (``core.registry.fairseq_plugin_name``)."""

from toolkit.core import registry

FAIRSEQ_NAMES = (
    "INIT_VALUES_KEY",
    "BaseFairseqModel",
    "FairseqDecoder",
    "FairseqIncrementalDecoder",
    "FairseqIncrementalState",
    "FairseqLanguageModel",
    "register_model",
    "register_model_architecture",
    "with_incremental_state",
)
__getattr__ = registry.fairseq_plugin_getattr(__name__, FAIRSEQ_NAMES)
