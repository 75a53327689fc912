"""Subword tokenizers, chosen with ``--bpe`` (``sentencepiece``, ``hf_byte_bpe``, ``gpt2``).

Each is registered with ``@register_bpe(name, dataclass=...)`` and turns a raw
line into space-separated pieces (``encode``) and back (``decode``); the pieces
are then looked up in ``dict.txt`` like whitespace tokens. ``gpt2`` follows
fairseq's convention: its pieces are GPT-2 BPE ids written as strings.

A data-bin records its tokenizer in ``bpe.json`` beside ``dict.txt`` with copies
of the model files, so ``load_tokenizer_for_data_bin`` can rebuild it later.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, ClassVar, Dict, Iterable, List, Mapping, Optional, Union

from toolkit.core import registry
from toolkit.core.errors import UserError
from toolkit.core.fileio import atomic_write

BPE_JSON = "bpe.json"


class Tokenizer:
    """Base class: ``encode(line) -> "piece piece ..."`` and ``decode(pieces) -> line``."""

    #: options-dataclass field holding a model file -> that file's name inside a data-bin
    model_files: ClassVar[Dict[str, str]] = {}
    #: whether ``train`` can build a model from the train split (``--bpe-vocab-size``)
    trainable: ClassVar[bool] = False

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def encode(self, line: str) -> str:
        raise NotImplementedError

    def decode(self, text: str) -> str:
        raise NotImplementedError

    def encode_lines(self, lines: List[str]) -> List[str]:
        """Encode many lines at once (subclasses batch this into their library)."""
        return [self.encode(line) for line in lines]

    def id_pieces(self) -> Optional[List[Optional[str]]]:
        """The piece ``encode`` writes for each of the library's ids, where a line's pieces are always exactly
        ``[id_pieces()[i] for i in encode_lines_to_ids([line])[0]]``; None where they are not. An id whose
        text varies from line to line (sentencepiece's unk id) has None in the list: the binarizer encodes a
        line holding it as text.

        With it the binarizer maps the library's ids to ``dict.txt`` ids through one array, instead of
        joining pieces into text and splitting and looking them up again (most of its cost beyond the
        tokenizer's own).
        """
        return None

    def encode_lines_to_ids(self, lines: List[str]) -> List[List[int]]:
        """The library's ids of each line (only where ``id_pieces`` is not None)."""
        raise NotImplementedError

    def encode_documents(self, texts: List[str]) -> List[str]:
        """Encode documents (records, paragraphs), each one item, its newlines kept: as ``encode_lines`` by
        default (fairseq's tokenizers normalize a document as a line: outer whitespace stripped, the rest as
        their library encodes it); a tokenizer with conventions of its own (``hf_byte_bpe``) applies them."""
        return self.encode_lines(texts)

    def encode_documents_to_ids(self, texts: List[str]) -> List[List[int]]:
        """The library's ids of each document, as ``encode_documents`` (only where ``id_pieces`` is not None)."""
        return self.encode_lines_to_ids(texts)

    # --- building a data-bin ---------------------------------------------------------
    @classmethod
    def needs_training(cls, cfg: Any) -> bool:
        """True when no model file was given and one must be trained on the train split."""
        return False

    @classmethod
    def check_config(cls, cfg: Any, flag: str) -> None:
        """Raise UserError (naming the flag) when the options cannot work."""
        for field in cls.model_files:
            path = getattr(cfg, field)
            if path is not None and not os.path.isfile(path):
                flag_name = "--" + field.replace("_", "-")
                raise UserError(f"{flag_name} {path}: no such file; give the path of an existing model file")

    @classmethod
    def train(cls, cfg: Any, lines: Iterable[str], out_dir: str) -> Any:
        """Train on ``lines``; save the model under ``out_dir``; return ``cfg`` pointing at it."""
        raise NotImplementedError(f"{cls.__name__} cannot be trained here")


def _import_tokenizers() -> None:
    registry.import_submodules("toolkit.tokenizers")


def tokenizer_names() -> List[str]:
    _import_tokenizers()
    return registry.TOKENIZER_REGISTRY.names()


def tokenizer_class(name: str) -> type:
    _import_tokenizers()
    try:
        return registry.TOKENIZER_REGISTRY.get(name).cls
    except registry.UnknownComponentError as e:
        raise UserError(str(e)) from None


def make_config(name: str, values: Union[None, Mapping[str, Any], Any] = None) -> Any:
    """The options dataclass of tokenizer ``name``, from a dict (unknown keys ignored) or as is."""
    _import_tokenizers()
    entry = registry.TOKENIZER_REGISTRY.get(name)
    if values is not None and dataclasses.is_dataclass(values) and not isinstance(values, type):
        return values
    values = dict(values or {})
    names = {f.name for f in dataclasses.fields(entry.config)}
    return entry.config(**{k: v for k, v in values.items() if k in names})


def build_tokenizer(name: str, cfg: Union[None, Mapping[str, Any], Any] = None) -> Tokenizer:
    """An instance of the tokenizer registered as ``name``."""
    cls = tokenizer_class(name)
    return cls(make_config(name, cfg))


def save_tokenizer_to_data_bin(
    name: str, cfg: Any, data_dir: str, origin: Optional[str] = None, final_dir: Optional[str] = None
) -> Any:
    """Copy the model files into ``data_dir`` (if not there yet) and write ``bpe.json``.

    ``final_dir`` is where ``data_dir`` (a temporary folder) is renamed to once complete: a source inside it is
    recorded under its final name, the one later commands can open. Returns the config with its file fields
    pointing at the copies.
    """
    cls = tokenizer_class(name)
    cfg = make_config(name, cfg)
    values = dataclasses.asdict(cfg)
    files: Dict[str, str] = {}
    sources: Dict[str, Optional[str]] = {}
    for field, file_name in cls.model_files.items():
        src = values[field]
        if src is None:
            raise UserError(f"--{field.replace('_', '-')}: required by --bpe {name}")
        dst = os.path.join(data_dir, file_name)
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)
            sources[field] = _recorded_source(src, data_dir, final_dir)
        else:
            sources[field] = origin
        files[field] = file_name
        values[field] = dst
    record = {
        "bpe": name,
        "files": files,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in files},
        "source": sources,
    }
    with atomic_write(os.path.join(data_dir, BPE_JSON), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    return make_config(name, values)


def _recorded_source(src: str, data_dir: str, final_dir: Optional[str]) -> str:
    """``src``'s absolute path, renamed into ``final_dir`` when it lies in the temporary ``data_dir``."""
    src = os.path.abspath(src)
    inside = os.path.relpath(src, os.path.abspath(data_dir))
    if final_dir is None or inside.startswith(os.pardir):
        return src
    return os.path.join(os.path.abspath(final_dir), inside)


def load_tokenizer_for_data_bin(data_dir: str) -> Optional[Tokenizer]:
    """The tokenizer a data-bin was made with, or None when it was whitespace-tokenized."""
    path = os.path.join(data_dir, BPE_JSON)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        name = record["bpe"]
        values = dict(record.get("config", {}))
        for field, file_name in record.get("files", {}).items():
            values[field] = os.path.join(data_dir, file_name)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(
            f"{path}: not a tokenizer record written by toolkit-preprocess ({e}); re-run toolkit-preprocess"
        ) from None
    if name is None:
        return None
    return build_tokenizer(name, values)
