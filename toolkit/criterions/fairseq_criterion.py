"""fairseq's criterion base class under its toolkit import path; it lives in
:mod:`toolkit.compat_plugins.criterion` (the plugin API, a layer below the families)."""

from toolkit.compat_plugins.criterion import FairseqCriterion, calls_the_model, register_criterion  # noqa: F401
