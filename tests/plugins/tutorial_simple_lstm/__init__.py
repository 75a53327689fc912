"""fairseq's tutorial_simple_lstm plugin as a language model, imports renamed ``fairseq`` -> ``toolkit``.

Used through ``--user-dir tests/plugins/tutorial_simple_lstm`` (tests/test_plugins.py, docs/plugins.md).
"""

from . import legacy_components, simple_lstm_lm  # noqa: F401
