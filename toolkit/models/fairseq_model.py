"""fairseq's model base classes under their toolkit import path; they live in :mod:`toolkit.compat_plugins.model`
(the plugin API, a layer below the families)."""

from toolkit.compat_plugins.model import (  # noqa: F401
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
