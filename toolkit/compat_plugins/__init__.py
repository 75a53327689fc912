"""fairseq's plugin API (``--user-dir``): the base classes and decorators a fairseq plugin imports, on the
toolkit's registry, and what turns their options into the toolkit's.

The lower part of the compat layer (``toolkit.compat`` sits above the checkpoints), a package of its own: it sits below the model families (``toolkit.models``, ``toolkit.criterions`` and
``toolkit.tasks`` re-export its names under fairseq's import paths, so ``from fairseq.models import ...``
ports by renaming the import), and nothing else in the library imports it; the toolkit's own families,
criterions and tasks register through ``toolkit.core.registry``. ``tests/unit/test_structure.py`` holds it
to that.

- ``dataclass``: ``FairseqDataclass``, ``ChoiceEnum`` (re-exported as ``toolkit.dataclass``);
- ``legacy_args``: a plugin's ``add_args(parser)`` options as an options dataclass;
- ``model``: ``BaseFairseqModel``, ``FairseqDecoder``, ``FairseqIncrementalDecoder``,
  ``FairseqLanguageModel``, ``register_model``, ``register_model_architecture``;
- ``task``: ``FairseqTask``, ``LegacyFairseqTask``, ``register_task``, ``setup_task``;
- ``criterion``: ``FairseqCriterion``, ``register_criterion``.
"""
