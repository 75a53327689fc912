"""fairseq's ``options`` (``from toolkit import options``: ``get_training_parser``, ``parse_args_and_arch``, ...)
and the toolkit's parser functions; the code is :mod:`toolkit.compat.fairseq.options` (docs/fairseq_python_api.md)."""

from toolkit.compat.fairseq.options import *  # noqa: F401,F403
