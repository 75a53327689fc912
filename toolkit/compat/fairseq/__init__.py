"""All that exists only for fairseq, in one place so the rest of the toolkit does not carry it.

- its plugin API (``plugins``: ``FairseqLanguageModel``, ``FairseqTask``, ``FairseqCriterion``, ``FairseqDataclass``,
  the ``register_*`` decorators, a plugin's ``add_args`` options as flags);
- its checkpoint files (``checkpoint``, ``weights``, ``pickle_reader``: a restricted unpickler, ``shards``,
  ``export``), reached by the library above through ``adapter``;
- its flags (``flags``, ``recipe_flags``) and Hydra/YAML training configs (``yaml_config``, ``train_config``,
  ``hydra_compose``);
- its Python API for scripts: ``options``, ``checkpoint_utils``, ``utils``, the hub (``hub``, ``model_outputs``).

fairseq's import paths stay as re-exports of a few lines: ``toolkit.options``, ``toolkit.checkpoint_utils``,
``toolkit.utils``, ``toolkit.dataclass`` (docs/fairseq_python_api.md), and the families' ``toolkit.models``,
``toolkit.tasks``, ``toolkit.criterions`` (docs/plugins.md), which sit below this package and reach ``plugins`` by
name (``toolkit.core.registry.fairseq_plugin_name``)."""
