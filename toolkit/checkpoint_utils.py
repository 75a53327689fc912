"""fairseq's ``fairseq.checkpoint_utils`` names (``from toolkit import checkpoint_utils``); see
toolkit.compat.fairseq.python_api."""
from toolkit.compat.fairseq.python_api import (  # noqa: F401
    GroupedConfig,
    load_checkpoint_to_cpu,
    load_model_ensemble,
    load_model_ensemble_and_task,
)
