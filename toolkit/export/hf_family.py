"""``toolkit-export --from hf``: the model family that reads the folder's ``config.json`` ``model_type`` builds
our checkpoint (:class:`toolkit.core.protocols.HFImportable`); this writes it, atomically.

The exporter never names a family: each registered model class that is ``HFImportable`` lists the
``model_type`` values it reads (``transformer_lm``: GPT-2; ``llama``: Llama, Mistral, Qwen2), so a new family
is a new folder under ``toolkit/models/`` (or a ``--user-dir`` plugin), nothing here.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Dict, Optional

import torch

from toolkit.core.errors import UserError, read_json_object
from toolkit.core.protocols import HFCheckpoint, HFImportable
from toolkit.export.common import StepProgress
from toolkit.export.target import export_directory
from toolkit.models.hf_checkpoint import CHECKPOINT

logger = logging.getLogger("toolkit.export.hf_import")
RESAVE = "give the folder as transformers' save_pretrained wrote it (download it again)"


def importing_family(config: Dict[str, Any], where: str) -> Any:
    """The registered model class whose ``HF_CLASSES`` has this ``model_type``; one line naming those read."""
    from toolkit.core import registry

    registry.import_all_components()  # the families register in their model modules, below their packages
    families = [
        entry.cls for _, entry in sorted(registry.MODEL_REGISTRY.entries.items()) if isinstance(entry.cls, HFImportable)
    ]
    kind = config.get("model_type")
    for family in families:
        if kind in family.HF_CLASSES:
            return family
    names = [name for family in families for name in family.HF_CLASSES.values()]
    listed = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)
    raise UserError(f"{where}: model_type {kind!r}; --from hf imports {listed} folders")


def write_checkpoint(imported: HFCheckpoint, tmp: str, out_dir: str, progress: StepProgress) -> None:
    """``model.pt``, ``dict.txt``, the copied files and the tokenizer record into ``tmp``, the folder renamed to
    ``out_dir`` when complete (two progress steps)."""
    from toolkit.checkpoint import identity
    from toolkit.tokenizers import save_tokenizer_to_data_bin

    if imported.dictionary_hash:
        imported.checkpoint["extra_state"][identity.HASH_KEY] = imported.dictionary.symbols_hash()
    with open(os.path.join(tmp, CHECKPOINT), "wb") as f:
        torch.save(imported.checkpoint, f)
    imported.dictionary.save(os.path.join(tmp, "dict.txt"))
    progress.advance(imported.written)
    for name, text in imported.texts.items():
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            f.write(text)
    for name, src in imported.files.items():
        shutil.copyfile(src, os.path.join(tmp, name))
    if imported.bpe is not None:
        name, model_files = imported.bpe
        written = {k: os.path.join(tmp, v) if v in imported.texts else v for k, v in model_files.items()}
        save_tokenizer_to_data_bin(name, written, tmp, final_dir=out_dir)
    progress.advance(imported.copied)


def import_hf(folder: str, out_dir: str, tokens_per_sample: Optional[int] = None) -> str:
    """Write ``out_dir`` (atomically) from the transformers folder ``folder``; returns ``out_dir``."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"--path {folder}: no config.json; give a folder written by transformers' save_pretrained")
    config = read_json_object(path, RESAVE)
    family = importing_family(config, path)
    with StepProgress(4, "import") as progress, export_directory(out_dir) as tmp:
        imported = family.from_hf(folder, config, out_dir, tokens_per_sample, progress.advance)
        write_checkpoint(imported, tmp, out_dir, progress)
    for line in imported.log:
        logger.info(line)
    return out_dir
