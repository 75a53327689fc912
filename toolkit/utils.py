"""The ``fairseq.utils`` functions scripts and plugins call (``from toolkit import utils``); the code is
:mod:`toolkit.compat.fairseq.utils`."""

from toolkit.compat.fairseq.utils import *  # noqa: F401,F403
