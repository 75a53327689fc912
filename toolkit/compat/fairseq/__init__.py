"""All that exists only for fairseq: its flag aliases, checkpoint read/write, the restricted unpickler
for its files and its ``-shard`` sets, kept in one place so the core does not carry them. fairseq's Python
names are the top-level modules fairseq scripts import (``toolkit.options``, ``toolkit.checkpoint_utils``,
``toolkit.utils``; docs/fairseq_python_api.md). Its Hydra/YAML training configs are read here too
(``yaml_config``, ``train_config``, ``hydra_compose``)."""
