"""``toolkit-preprocess --chat-template T``: conversations -> a chat data-bin for ``--task sft``.

Records come from JSON lines, Parquet or a ``datasets`` folder (``--trainpref``/``--validpref``/``--testpref``,
``--hf-dataset``), each holding a list of messages under ``--messages-key`` (and the tools a template may read
under ``tools``). Each conversation is rendered and encoded by :class:`toolkit.data.chat_template.ChatTemplate`
and written with its loss mask (:mod:`toolkit.data.sft_dataset`). A record not to train on (not a list of
messages, not renderable, an empty or missing assistant turn, no trained token, turns prefixes cannot find) is
skipped, and each kind is one warning line with its count and the first record of that kind.

The ids are the tokenizer's own: the dictionary is ``--srcdict`` (else the ``dict.txt`` in the tokenizer's
folder, as ``toolkit-export --from hf`` writes it), checked against the tokenizer's vocabulary. The data-bin
also keeps the template (``chat_template.jinja``) and how it was used (``chat.json``). It is built in a
temporary folder beside ``--destdir`` and renamed into place when everything succeeded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

from toolkit.config.commands import PreprocessConfig
from toolkit.core import folder_lock
from toolkit.core.errors import UserError
from toolkit.core.fileio import atomic_directory
from toolkit.data import preprocess as text_preprocess
from toolkit.data.chat_template import TRAIN_ON, ChatTemplate, SkippedRecord
from toolkit.data.dictionary import Dictionary
from toolkit.data.indexed_dataset import best_fitting_dtype
from toolkit.data.record_inputs import (
    BATCH_ROWS,
    MISSING_KEY,
    NOT_JSON,
    RecordOptions,
    RecordReport,
    input_kind,
    load_hf_split,
    open_binary,
    require,
)
from toolkit.data.sft_dataset import ChatSplitWriter
from toolkit.logging.setup import make_formatter

logger = logging.getLogger("toolkit_cli.preprocess")

CHAT_RECORD = "chat.json"
TOOLS_KEY = "tools"
Record = Tuple[str, Any, Any]  # (where, messages, tools)


def check_chat_flags(cfg: PreprocessConfig, bpe: Optional[str]) -> None:
    """What --chat-template does not combine with, before any work."""
    flag = f"--chat-template {cfg.chat_template}"
    if bpe is not None:
        raise UserError(f"--bpe {bpe}: {flag} encodes with the template's own tokenizer; leave out --bpe")
    if cfg.num_shards > 1 or cfg.merge:
        raise UserError(f"--num-shards/--merge: not supported with {flag}; binarize the conversations in one run")
    if cfg.dict_only:
        raise UserError(f"--dict-only: {flag} uses the tokenizer's vocabulary (--srcdict); leave out --dict-only")
    if cfg.train_on not in TRAIN_ON:
        raise UserError(f"--train-on {cfg.train_on}: choose one of {', '.join(TRAIN_ON)}")


def _dictionary(cfg: PreprocessConfig, template: ChatTemplate, tokenizer_folder: str) -> Tuple[Dictionary, str]:
    path = cfg.srcdict or os.path.join(tokenizer_folder, "dict.txt")
    if not os.path.isfile(path):
        raise UserError(
            f"--chat-template {cfg.chat_template}: needs the model's dictionary; give --srcdict DICT (the dict.txt "
            f"toolkit-export --from hf wrote for the model)"
        )
    dictionary = Dictionary.load(path)
    if not dictionary.fixed_ids:
        raise UserError(
            f"--srcdict {path}: a fairseq dictionary; chat data keeps the tokenizer's own ids, give the dict.txt "
            f"toolkit-export --from hf wrote for the model"
        )
    for token, i in sorted(template.tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if i >= len(dictionary) or dictionary[i] != token:
            held = dictionary[i] if i < len(dictionary) else "nothing"
            raise UserError(
                f"--srcdict {path}: id {i} is {held!r} there but {token!r} in the tokenizer of --chat-template "
                f"{cfg.chat_template}; give the dict.txt of the model imported with this tokenizer"
            )
    return dictionary, path


# --- records ---------------------------------------------------------------------------------------------
def _jsonl_records(path: str, key: str, report: RecordReport) -> Iterator[Record]:
    with open_binary(path) as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except ValueError:  # UnicodeDecodeError included
                record = None
            if not isinstance(record, dict):
                report.skip(NOT_JSON, f"line {number}")
            elif key not in record:
                report.skip(MISSING_KEY, f"line {number}")
            else:
                yield f"line {number}", record[key], record.get(TOOLS_KEY)


def _column_records(batches: Iterator[Dict[str, List[Any]]], key: str) -> Iterator[Record]:
    row = 1
    for batch in batches:
        tools = batch.get(TOOLS_KEY) or [None] * len(batch[key])
        for messages, tool_list in zip(batch[key], tools):
            yield f"row {row}", messages, tool_list
            row += 1


def _columns(names: List[str], key: str, where: str) -> List[str]:
    if key not in names:
        raise UserError(f"--messages-key {key}: {where} has no such column (it has {', '.join(names)})")
    return [key] + ([TOOLS_KEY] if TOOLS_KEY in names else [])


def chat_records(kind: str, path: str, key: str, opts: RecordOptions, report: RecordReport) -> Iterator[Record]:
    """``(where, messages, tools)`` of every record of a JSON-lines, Parquet or ``datasets`` input."""
    if kind == "jsonl":
        yield from _jsonl_records(path, key, report)
    elif kind == "parquet":
        pq = require("pyarrow.parquet", "pyarrow", f"{path}: reading Parquet")
        parquet = pq.ParquetFile(path)
        columns = _columns(parquet.schema_arrow.names, key, path)
        batches = (batch.to_pydict() for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns))
        yield from _column_records(batches, key)
    elif kind == "hf":
        dataset = load_hf_split(path, opts)
        _columns(list(dataset.column_names or [key]), key, f"the dataset {path}")
        yield from _column_records(dataset.iter(batch_size=BATCH_ROWS), key)
    else:
        raise UserError(
            f"{path}: --chat-template reads records holding a list of messages (.jsonl, .parquet or --hf-dataset), "
            f"not plain text"
        )


def _binarize_split(
    template: ChatTemplate, cfg: PreprocessConfig, split: Tuple[str, str, str], prefix: str, dtype
) -> ChatSplitWriter:
    name, flag, path = split
    kind = input_kind(path, flag == text_preprocess.HF_FLAG)
    opts = text_preprocess._record_options(cfg, name, flag)
    report = RecordReport(f"{flag} {path}" + (f" (split {opts.hf_split})" if kind == "hf" else ""))
    writer = ChatSplitWriter(prefix, dtype)
    for where, messages, tools in chat_records(kind, path, cfg.messages_key, opts, report):
        try:
            encoded = template.encode(messages, tools, cfg.train_on)
        except SkippedRecord as skipped:
            report.skip(skipped.kind, f"{where}: {skipped.detail}")
            continue
        writer.add(encoded.ids, encoded.mask)
        report.written += 1
    writer.finalize()
    named = {kind: f"{kind} {cfg.messages_key!r}" if kind == MISSING_KEY else kind for kind in report.bad}
    for kind, n in sorted(report.bad.items()):
        logger.warning(f"{report.source}: {n} record(s) skipped: {named[kind]} (first: {report.first_bad[kind]})")
    if report.written == 0:
        raise UserError(
            f"{report.source}: no conversation to train on (every record was skipped: "
            f"{', '.join(f'{n} {named[k]}' for k, n in sorted(report.bad.items())) or 'none found'}); check "
            f"--messages-key, --train-on and the template"
        )
    logger.info(
        f"[None] {name}: {writer.conversations} conversations, {writer.num_tokens} tokens, {writer.num_trained} "
        f"trained ({report.source})"
    )
    return writer


def _record_tokenizer(template: ChatTemplate, tmp: str) -> None:
    """The data-bin's tokenizer record (``bpe.json``, a copy of tokenizer.json), as a data-bin binarized with the
    import's tokenizer has: ``toolkit-export`` then finds the model's own tokenizer files from the data-bin."""
    from toolkit.tokenizers import save_tokenizer_to_data_bin

    tokenizer_json = os.path.join(template.tokenizer_folder or "", "tokenizer.json")
    if template.tokenizer_folder and os.path.isfile(tokenizer_json):
        save_tokenizer_to_data_bin("hf_byte_bpe", {"bpe_model": tokenizer_json}, tmp)


def _write_data_bin(template: ChatTemplate, cfg: PreprocessConfig, splits, dictionary_path: str, tmp: str, args):
    handler = logging.FileHandler(os.path.join(tmp, "preprocess.log"), encoding="utf-8")
    handler.setFormatter(make_formatter())
    logger.addHandler(handler)
    try:
        logger.info(args if args is not None else cfg)
        how = "its {% generation %} spans" if template.marks_generation else "each turn found by prefix rendering"
        logger.info(f"chat template {template.source}: --train-on {cfg.train_on}, assistant tokens from {how}")
        dictionary = Dictionary.load(dictionary_path)
        dictionary.save(os.path.join(tmp, text_preprocess.DICT_FILE))
        dtype = best_fitting_dtype(len(dictionary))
        written = {
            split[0]: _binarize_split(template, cfg, split, os.path.join(tmp, split[0]), dtype) for split in splits
        }
        with open(os.path.join(tmp, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(template.text)
        _record_tokenizer(template, tmp)
        record = {
            "chat_template": os.path.abspath(template.source),
            "train_on": cfg.train_on,
            "masks": "generation" if template.marks_generation else "prefixes",
            "messages_key": cfg.messages_key,
            "splits": {
                name: {"conversations": w.conversations, "tokens": w.num_tokens, "trained": w.num_trained}
                for name, w in written.items()
            },
        }
        with open(os.path.join(tmp, CHAT_RECORD), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
    finally:
        logger.removeHandler(handler)
        handler.close()
    return written


def preprocess_chat(cfg: PreprocessConfig, bpe: Optional[str] = None, args: Any = None) -> Dict[str, ChatSplitWriter]:
    """Build the chat data-bin ``cfg.destdir``; raises UserError on bad input (and leaves no data-bin)."""
    check_chat_flags(cfg, bpe)
    fallback = os.path.dirname(os.path.abspath(cfg.srcdict)) if cfg.srcdict else None
    template = ChatTemplate.load(cfg.chat_template, fallback)
    splits = text_preprocess.plan_splits(cfg)
    if not splits:
        raise UserError("--trainpref: nothing to do; give --trainpref (and --validpref/--testpref) or --hf-dataset")
    _, dictionary_path = _dictionary(cfg, template, template.tokenizer_folder)
    inputs = [path for _, _, path in splits] + [dictionary_path]
    new_bin = dataclasses.replace(cfg, srcdict=None)  # a chat data-bin is always written whole
    text_preprocess.check_destdir(new_bin, splits, inputs)
    os.makedirs(os.path.dirname(os.path.abspath(cfg.destdir)), exist_ok=True)
    with folder_lock.hold(folder_lock.beside(cfg.destdir), f"--destdir {cfg.destdir}", "toolkit-preprocess"):
        text_preprocess.check_destdir(new_bin, splits, inputs)
        text_preprocess.remove_dead_temp_folders(cfg.destdir)
        with atomic_directory(cfg.destdir) as tmp, text_preprocess._owned(tmp):
            written = _write_data_bin(template, cfg, splits, dictionary_path, tmp, args)
            text_preprocess._set_default_permissions(tmp)
    text_preprocess._log_written(cfg.destdir)
    return written
