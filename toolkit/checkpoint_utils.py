"""fairseq's ``checkpoint_utils`` (``load_model_ensemble_and_task``, ``load_model_ensemble``,
``load_checkpoint_to_cpu``); the code is :mod:`toolkit.compat.fairseq.checkpoint_utils`."""

from toolkit.compat.fairseq.checkpoint_utils import *  # noqa: F401,F403
