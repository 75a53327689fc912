"""Language-model data -> a fairseq data-bin (``toolkit-preprocess``; fairseq-preprocess ``--only-source``).

The data-bin holds ``dict.txt``, ``{train,valid,valid1,...,test,...}.{bin,idx}``
(``--dataset-impl mmap``), ``preprocess.log`` and, with ``--bpe``, ``bpe.json``
plus the tokenizer's model files. It is built in a temporary folder beside
``--destdir`` and renamed into place only when everything succeeded.

As fairseq, ``--srcdict`` into a ``--destdir`` that already holds a data-bin adds the
given splits to it (e.g. a test set binarized later with the data-bin's own ``dict.txt``):
the dictionary must give the same ids as the data-bin's, the data-bin's tokenizer
(``bpe.json``) is used, a split that exists is replaced only under ``--overwrite`` (and
only its ``.bin/.idx``), and every other file stays. Each split is written under a
temporary name and renamed into place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from toolkit.data.binarizer import (
    DOCUMENTS,
    LINES,
    BinarizeSummary,
    Units,
    Workers,
    binarize_file,
    count_file,
    finish_provisional,
    iter_units,
    part_counts,
    provisional_file,
)
from toolkit.data.dictionary import Dictionary
from toolkit.data.indexed_dataset import best_fitting_dtype
from toolkit.data.record_inputs import RecordOptions, input_kind, write_as_documents, write_paragraphs
from toolkit.data.shards import check_shard_flags, find_parts, merge_parts, write_shard_record
from toolkit.core import folder_lock
from toolkit.core.errors import UserError
from toolkit.core.fileio import atomic_directory
from toolkit.logging.setup import make_formatter
from toolkit.config.commands import ENCODING_ERRORS, PreprocessConfig  # noqa: F401  (torch-free for --help)

logger = logging.getLogger("toolkit_cli.preprocess")

DICT_FILE = "dict.txt"
HF_FLAG = "--hf-dataset"
SPLIT_EXTENSIONS = ("bin", "idx")


@dataclass
class PreprocessResult:
    destdir: str
    num_types: int
    summaries: Dict[str, BinarizeSummary]  # output split name (train, valid, valid1, ...) -> summary
    timings: Dict[str, float]  # seconds: "bpe", "dictionary", then one entry per split


def units_of(cfg: PreprocessConfig, path: str) -> Units:
    """Whether ``path``'s items are lines (a text file, fairseq's) or documents (records, paragraphs)."""
    return DOCUMENTS if path in cfg.document_files else LINES


def plan_splits(cfg: PreprocessConfig) -> List[Tuple[str, str, str]]:
    """``(output name, flag, input file)`` for every split, in fairseq's naming (valid, valid1, ...)."""
    splits = []
    if cfg.trainpref and cfg.hf_dataset:
        raise UserError(f"--hf-dataset {cfg.hf_dataset}: also given --trainpref {cfg.trainpref}; give one of them")
    if cfg.trainpref:
        splits.append(("train", "--trainpref", cfg.trainpref))
    if cfg.hf_dataset:
        splits.append(("train", HF_FLAG, cfg.hf_dataset))
    if cfg.hf_valid_split:
        if not cfg.hf_dataset:
            raise UserError(f"--hf-valid-split {cfg.hf_valid_split}: needs --hf-dataset PATH")
        if cfg.validpref:
            raise UserError(f"--hf-valid-split {cfg.hf_valid_split}: also given --validpref; give one of them")
        for k, _ in enumerate(cfg.hf_valid_split.split(",")):
            splits.append((f"valid{k}" if k > 0 else "valid", HF_FLAG, cfg.hf_dataset))
    for kind, value in (("valid", cfg.validpref), ("test", cfg.testpref)):
        if value:
            for k, path in enumerate(p.strip() for p in value.split(",")):
                if not path:
                    raise UserError(
                        f"--{kind}pref {value}: an empty name in the comma-separated list; "
                        f"give file paths separated by single commas"
                    )
                splits.append((f"{kind}{k}" if k > 0 else kind, f"--{kind}pref", path))
    return splits


def _check_readable(flag: str, path: str, what: str = "file") -> None:
    if not os.path.exists(path):
        raise UserError(f"{flag} {path}: no such {what}; check the path")
    if os.path.isdir(path):
        hint = "; for a Hugging Face datasets folder use --hf-dataset PATH" if flag != "--srcdict" else ""
        raise UserError(f"{flag} {path}: is a folder; give the {what} itself{hint}")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot be read ({e.strerror}); check its permissions") from None


def _check_no_nul(flag: str, path: str, chunk: int = 1 << 22) -> None:
    """Text has no NUL byte: one is a UTF-16 file or binary data, which trained without a word (one pass, memchr)."""
    offset, lines = 0, 0
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            if not data:
                return
            at = data.find(b"\0")
            if at >= 0:
                lines += data.count(b"\n", 0, at)
                nuls = data.count(b"\0") + sum(part.count(b"\0") for part in iter(lambda: f.read(chunk), b""))
                raise UserError(
                    f"{flag} {path}: holds {nuls} NUL byte(s), the first at byte {offset + at:,} "
                    f"(line {lines + 1}): not UTF-8 text (UTF-16? binary?); convert it to UTF-8 text"
                )
            lines += data.count(b"\n")
            offset += len(data)


def _check_has_tokens(flag: str, path: str, summary: BinarizeSummary) -> None:
    """A split of blank lines only has no token to train or evaluate on (it trained without a word)."""
    if summary.num_tok - summary.num_seq <= 0:
        raise UserError(
            f"{flag} {path}: {summary.num_seq} line(s) and no token (blank lines only); give a file with text in it"
        )


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def check_inputs(
    cfg: PreprocessConfig, splits: List[Tuple[str, str, str]], bpe: Optional[str] = None, bpe_cfg: Any = None
) -> List[str]:
    """Every problem that can be seen before any work starts, as one UserError; returns the input files."""
    if cfg.dataset_impl != "mmap":
        raise UserError(f"--dataset-impl {cfg.dataset_impl}: only mmap is supported")
    if cfg.joined_dictionary:
        logger.info(
            "--joined-dictionary: accepted, no effect (language-model data has one side: its one "
            "dictionary is already the joined one)"
        )
    if cfg.encoding_errors not in ENCODING_ERRORS:
        raise UserError(f"--encoding-errors {cfg.encoding_errors}: choose one of {', '.join(ENCODING_ERRORS)}")
    if cfg.workers < 1:
        raise UserError(f"--workers {cfg.workers}: must be at least 1")
    if not splits and not cfg.srcdict:
        raise UserError("--trainpref: nothing to do; give --trainpref (and --validpref/--testpref) files")
    if not cfg.srcdict and not (cfg.trainpref or cfg.hf_dataset):
        raise UserError("--trainpref: needed to build the dictionary; give it, or give --srcdict DICT")
    inputs = []
    for _, flag, path in splits:
        kind = input_kind(path, flag == HF_FLAG)
        if kind == "hf":
            if not os.path.exists(path):
                raise UserError(f"{flag} {path}: no such folder or dataset script; check the path")
            inputs.append(path)
            continue
        _check_readable(flag, path)
        if os.path.getsize(path) == 0:
            raise UserError(f"{flag} {path}: the file is empty; give a file with at least one line or leave out {flag}")
        if kind == "text":  # compressed or Parquet bytes hold NULs; their records are checked as they are read
            _check_no_nul(flag, path)
        inputs.append(path)
    if cfg.srcdict:
        _check_readable("--srcdict", cfg.srcdict, "dictionary file")
        inputs.append(cfg.srcdict)
    if bpe is not None and adds_to_data_bin(cfg):
        raise UserError(
            f"--bpe {bpe}: --destdir {cfg.destdir} already holds a data-bin, and splits added to it "
            f"are tokenized as it was (its bpe.json, if any); leave out --bpe"
        )
    if bpe is not None:
        from toolkit.tokenizers import tokenizer_class

        cls = tokenizer_class(bpe)
        cls.check_config(bpe_cfg, f"--bpe {bpe}")
        if cls.needs_training(bpe_cfg):
            if not (cfg.trainpref or cfg.hf_dataset):
                raise UserError(f"--bpe {bpe}: training a tokenizer needs --trainpref (or give a model file)")
        else:
            cls(bpe_cfg)  # load the given model files now, so a bad one is reported under its own path
        inputs += [getattr(bpe_cfg, f) for f in cls.model_files if getattr(bpe_cfg, f)]
    check_destdir(cfg, splits, inputs)
    return inputs


def check_destdir(cfg: PreprocessConfig, splits: List[Tuple[str, str, str]], inputs: List[str]) -> None:
    """--destdir new or empty (or --overwrite, or splits added to a data-bin); checked again under its lock."""
    dest = cfg.destdir
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise UserError(f"--destdir {dest}: exists and is not a folder; choose another --destdir")
    if adds_to_data_bin(cfg):
        if cfg.num_shards > 1:
            raise UserError(
                f"--destdir {dest}: already holds a data-bin; write each --shard-id part to a folder "
                f"of its own (e.g. parts/{cfg.shard_id}) and --merge them"
            )
        _check_additions(cfg, splits)
        return
    if os.path.isdir(dest) and os.listdir(dest):
        if not cfg.overwrite:
            hint = (
                f"; to add splits to this data-bin, give --srcdict {os.path.join(dest, DICT_FILE)}"
                if os.path.isfile(os.path.join(dest, DICT_FILE))
                else ""
            )
            raise UserError(
                f"--destdir {dest}: folder exists and is not empty; pass --overwrite to replace "
                f"it, or choose another --destdir (e.g. {os.path.join(dest, 'NAME')}){hint}"
            )
        for path in inputs:
            if _inside(path, dest):
                raise UserError(
                    f"--destdir {dest}: holds the input {path}, which --overwrite would delete; "
                    f"move the input out or choose another --destdir"
                )


def adds_to_data_bin(cfg: PreprocessConfig) -> bool:
    """--srcdict into a folder that already holds a data-bin (its dict.txt): add splits to it, as fairseq."""
    return bool(cfg.srcdict) and os.path.isfile(os.path.join(cfg.destdir, DICT_FILE))


def _check_additions(cfg: PreprocessConfig, splits: List[Tuple[str, str, str]]) -> None:
    """The same ids as the data-bin's dict.txt, and no split replaced unasked."""
    existing = os.path.join(cfg.destdir, DICT_FILE)
    if Dictionary.load(cfg.srcdict) != Dictionary.load(existing):
        raise UserError(
            f"--srcdict {cfg.srcdict}: differs from {existing}, the dictionary of the data-bin the "
            f"splits are added to; give --srcdict {existing}, or choose another --destdir"
        )
    for name, flag, path in splits:
        present = [
            f"{name}.{ext}" for ext in SPLIT_EXTENSIONS if os.path.exists(os.path.join(cfg.destdir, f"{name}.{ext}"))
        ]
        if present and not cfg.overwrite:
            raise UserError(
                f"{flag} {path}: the data-bin {cfg.destdir} already has the {name} split "
                f"({', '.join(present)}); pass --overwrite to replace that split (only its files), "
                f"or leave out {flag}"
            )


def _data_bin_tokenizer_spec(data_dir: str) -> Optional[Tuple[str, Dict[str, Any]]]:
    """The workers' spec of the tokenizer a data-bin was made with (None: whitespace)."""
    from toolkit.tokenizers import BPE_JSON, load_tokenizer_for_data_bin

    tokenizer = load_tokenizer_for_data_bin(data_dir)  # checks the record and its model files
    if tokenizer is None:
        return None
    with open(os.path.join(data_dir, BPE_JSON), encoding="utf-8") as f:
        name = json.load(f)["bpe"]
    return (name, dataclasses.asdict(tokenizer.cfg))


def add_splits(cfg: PreprocessConfig, splits: List[Tuple[str, str, str]], args: Any = None) -> PreprocessResult:
    """Binarize ``splits`` into the existing data-bin ``cfg.destdir`` with its dict.txt and tokenizer.

    The files are written in a temporary folder beside it, then each renamed into place:
    the other splits, dict.txt and the tokenizer files are never touched (fairseq appends to
    preprocess.log, so does this).
    """
    dest = cfg.destdir
    vocab = Dictionary.load(os.path.join(dest, DICT_FILE))
    spec = _data_bin_tokenizer_spec(dest)
    timings: Dict[str, float] = {}
    parent = os.path.dirname(os.path.abspath(dest))
    remove_dead_temp_folders(dest)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(os.path.abspath(dest)) + ".", suffix=".add.tmp", dir=parent)
    _write_owner(tmp)
    handler = logging.FileHandler(os.path.join(dest, "preprocess.log"), mode="a", encoding="utf-8")
    handler.setFormatter(make_formatter())
    logger.addHandler(handler)
    try:
        with Workers(cfg.workers) as workers:
            logger.info(args if args is not None else cfg)
            logger.info(
                f"[None] Dictionary: {os.path.join(dest, DICT_FILE)} (the data-bin's; same ids as "
                f"--srcdict {cfg.srcdict}); adding {', '.join(name for name, _, _ in splits) or 'nothing'}"
            )
            summaries = _binarize_step(cfg, splits, vocab, None, workers, spec, tmp, timings)
        _set_default_permissions(tmp)
        for name in summaries:
            for ext in SPLIT_EXTENSIONS:
                os.replace(os.path.join(tmp, f"{name}.{ext}"), os.path.join(dest, f"{name}.{ext}"))
        logger.info(f"Wrote preprocessed data to {dest}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        logger.removeHandler(handler)
        handler.close()
    return PreprocessResult(dest, len(vocab), summaries, timings)


OWNER_FILE = ".preprocess.owner"  # "host pid" of the run writing a temporary folder


def _write_owner(tmp: str) -> None:
    with open(os.path.join(tmp, OWNER_FILE), "w", encoding="utf-8") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")


@contextlib.contextmanager
def _owned(tmp: str) -> Iterator[None]:
    """The temporary data-bin names its writer while it is built; the mark is gone before the rename."""
    _write_owner(tmp)
    yield
    os.unlink(os.path.join(tmp, OWNER_FILE))


def _is_dead_run(tmp: str) -> bool:
    """A temporary folder whose writer, on this host, no longer runs (killed: nothing else removes it)."""
    try:
        with open(os.path.join(tmp, OWNER_FILE), encoding="utf-8") as f:
            host, pid = f.read().split()
        if host != socket.gethostname():
            return False
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):
        return False
    return False


def remove_dead_temp_folders(destdir: str) -> List[str]:
    """Remove the temporary folders that killed runs into ``destdir`` left beside it (one INFO line)."""
    parent = os.path.dirname(os.path.abspath(destdir))
    prefix = "." + os.path.basename(os.path.abspath(destdir)) + "."
    if not os.path.isdir(parent):
        return []
    dead = [
        os.path.join(parent, n)
        for n in sorted(os.listdir(parent))
        if n.startswith(prefix) and n.endswith(".tmp") and _is_dead_run(os.path.join(parent, n))
    ]
    for path in dead:
        shutil.rmtree(path, ignore_errors=True)
    if dead:
        logger.info(
            f"removed {len(dead)} temporary folder(s) left by killed runs: "
            f"{', '.join(os.path.basename(p) for p in dead)}"
        )
    return dead


def _set_default_permissions(folder: str) -> None:
    """Temporary files and folders are private (0600/0700); the data-bin gets the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            os.chmod(path, 0o666 & ~umask)


def _progress_bar(cfg: PreprocessConfig, total: int, desc: str):
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: worker processes are forked
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
        dynamic_ncols=True,
        disable=True if cfg.no_progress_bar else None,
    )


def _rate(n: int, seconds: float) -> str:
    return f"{n / seconds / 1e6:.2f}M tokens/s" if seconds > 0 else "-"


def preprocess(
    cfg: PreprocessConfig, bpe: Optional[str] = None, bpe_cfg: Any = None, args: Any = None
) -> PreprocessResult:
    """Build the data-bin ``cfg.destdir``; raises UserError on bad input (and leaves no data-bin).

    Three steps, in a temporary folder renamed into place at the end: the tokenizer (trained
    or copied), the dictionary (counted, with the train split binarized in the same pass),
    then every split binarized against it.
    """
    check_shard_flags(cfg.num_shards, cfg.shard_id, cfg.srcdict, cfg.merge)
    if cfg.merge:
        return _merge(cfg)
    tokenizer_cls = None
    if bpe is not None:
        from toolkit.tokenizers import make_config, tokenizer_class

        try:
            bpe_cfg = make_config(bpe, bpe_cfg if bpe_cfg is not None else {})
        except Exception as e:  # unknown --bpe name
            raise UserError(str(e)) from None
        tokenizer_cls = tokenizer_class(bpe)
    splits = plan_splits(cfg)
    inputs = check_inputs(cfg, splits, bpe, bpe_cfg)
    if logger.level == logging.NOTSET:
        logger.setLevel(os.environ.get("LOGLEVEL", "INFO").upper())
    os.makedirs(os.path.dirname(os.path.abspath(cfg.destdir)), exist_ok=True)
    with folder_lock.hold(folder_lock.beside(cfg.destdir), f"--destdir {cfg.destdir}", "toolkit-preprocess"):
        check_destdir(cfg, splits, inputs)  # again: another run may have written it meanwhile
        with inputs_as_documents(cfg, splits) as (cfg, splits):
            if adds_to_data_bin(cfg):
                return add_splits(cfg, [] if cfg.dict_only else splits, args)
            return _build_data_bin(cfg, splits, bpe, bpe_cfg, tokenizer_cls, args)


def _merge(cfg: PreprocessConfig) -> PreprocessResult:
    """--merge: the parts joined into a new --destdir (under its lock); a part inside --destdir is an input
    --overwrite would delete, so it is refused as any other input there."""
    parts = find_parts(cfg.merge)
    check_destdir(cfg, [], parts)
    os.makedirs(os.path.dirname(os.path.abspath(cfg.destdir)), exist_ok=True)
    with folder_lock.hold(folder_lock.beside(cfg.destdir), f"--destdir {cfg.destdir}", "toolkit-preprocess"):
        check_destdir(cfg, [], parts)
        merge_parts(cfg.merge, cfg.destdir)
    return PreprocessResult(cfg.destdir, len(Dictionary.load(os.path.join(cfg.destdir, DICT_FILE))), {}, {})


def _record_options(cfg: PreprocessConfig, name: str, flag: str) -> RecordOptions:
    split = cfg.hf_split
    if flag == HF_FLAG and name.startswith("valid"):
        split = cfg.hf_valid_split.split(",")[int(name[5:] or 0)].strip()
    return RecordOptions(
        json_key=cfg.json_key,
        column=cfg.parquet_column,
        hf_split=split,
        streaming=cfg.streaming,
        encoding_errors=cfg.encoding_errors,
        progress_bars=not cfg.no_progress_bar,
    )


@contextlib.contextmanager
def inputs_as_documents(cfg: PreprocessConfig, splits: List[Tuple[str, str, str]]):
    """JSON lines / Parquet / datasets inputs (and, with ``--document-separator blank_line``, text files)
    streamed into files of documents (a private folder beside --destdir; ``record_inputs``).

    Yields the config (its ``document_files`` naming those files) and the splits naming them, so the one
    pipeline binarizes each document as one item; the folder is deleted afterwards.
    """
    kinds = [input_kind(path, flag == HF_FLAG) for _, flag, path in splits]
    paragraphs = cfg.document_separator == "blank_line"
    if all(kind == "text" for kind in kinds) and not paragraphs:
        yield cfg, splits
        return
    parent = os.path.dirname(os.path.abspath(cfg.destdir))
    remove_dead_temp_folders(cfg.destdir)  # e.g. the text of a killed run's records (as big as its inputs)
    tmp = tempfile.mkdtemp(
        prefix="." + os.path.basename(os.path.abspath(cfg.destdir)) + ".", suffix=".inputs.tmp", dir=parent
    )
    try:
        _write_owner(tmp)  # so the next run removes it if this one is killed before the finally below
        converted, documents = [], []
        for (name, flag, path), kind in zip(splits, kinds):
            if kind != "text" or paragraphs:
                doc_path = os.path.join(tmp, f"{name}.{os.path.basename(os.path.normpath(path))}.documents")
                if kind != "text":
                    opts = _record_options(cfg, name, flag)
                    source = f"{flag} {path}" + (f" (split {opts.hf_split})" if kind == "hf" else "")
                    write_as_documents(kind, path, doc_path, opts, source)
                else:
                    found = write_paragraphs(path, doc_path, cfg.encoding_errors)
                    logger.info(f"{flag} {path}: {found} documents (paragraphs between blank lines)")
                path = doc_path
                documents.append(doc_path)
            converted.append((name, flag, path))
        train = [path for name, _, path in converted if name == "train"]
        cfg = dataclasses.replace(cfg, document_files=tuple(documents))
        yield (dataclasses.replace(cfg, trainpref=train[0]) if train else cfg), converted
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build_data_bin(
    cfg: PreprocessConfig,
    splits: List[Tuple[str, str, str]],
    bpe: Optional[str],
    bpe_cfg: Any,
    tokenizer_cls: Any,
    args: Any,
) -> PreprocessResult:
    """A new data-bin in a temporary folder beside --destdir, renamed into place at the end."""
    timings: Dict[str, float] = {}
    remove_dead_temp_folders(cfg.destdir)
    with atomic_directory(cfg.destdir) as tmp, _owned(tmp):
        handler = logging.FileHandler(os.path.join(tmp, "preprocess.log"), encoding="utf-8")
        handler.setFormatter(make_formatter())
        logger.addHandler(handler)
        try:
            # fork the workers first, before a tokenizer library starts threads in this process
            with Workers(cfg.workers) as workers:
                logger.info(args if args is not None else cfg)
                spec = _tokenizer_step(cfg, bpe, bpe_cfg, tokenizer_cls, tmp, timings)
                vocab, first_pass = _dictionary_step(cfg, workers, spec, tmp, timings)
                summaries = (
                    {} if cfg.dict_only else _binarize_step(cfg, splits, vocab, first_pass, workers, spec, tmp, timings)
                )
                if cfg.num_shards > 1:
                    write_shard_record(tmp, cfg.shard_id, cfg.num_shards, list(summaries))
            _set_default_permissions(tmp)
        finally:
            logger.removeHandler(handler)
            handler.close()
    _log_written(cfg.destdir)  # only once the data-bin is in place: never before a failure
    return PreprocessResult(cfg.destdir, len(vocab), summaries, timings)


def _log_written(destdir: str) -> None:
    handler = logging.FileHandler(os.path.join(destdir, "preprocess.log"), mode="a", encoding="utf-8")
    handler.setFormatter(make_formatter())
    logger.addHandler(handler)
    try:
        logger.info(f"Wrote preprocessed data to {destdir}")
    finally:
        logger.removeHandler(handler)
        handler.close()


def _tokenizer_step(
    cfg: PreprocessConfig, bpe: Optional[str], bpe_cfg: Any, tokenizer_cls: Any, tmp: str, timings: Dict[str, float]
) -> Optional[Tuple[str, Dict[str, Any]]]:
    """Train (or copy) the tokenizer into the data-bin; the spec the workers tokenize with (None: whitespace)."""
    if bpe is None:
        return None
    from toolkit.tokenizers import save_tokenizer_to_data_bin

    t0 = time.perf_counter()
    origin = None
    if tokenizer_cls.needs_training(bpe_cfg):
        logger.info(f"training the {bpe} tokenizer on {cfg.trainpref}")
        texts = iter_units(cfg.trainpref, cfg.encoding_errors, units_of(cfg, cfg.trainpref))
        bpe_cfg = tokenizer_cls.train(bpe_cfg, texts, tmp)
        origin = f"trained on {os.path.abspath(cfg.trainpref)}"
    bpe_cfg = save_tokenizer_to_data_bin(bpe, bpe_cfg, tmp, origin)
    timings["bpe"] = time.perf_counter() - t0
    logger.info(f"tokenizer: --bpe {bpe} ({os.path.join(cfg.destdir, 'bpe.json')})")
    return (bpe, dataclasses.asdict(bpe_cfg))


def _dictionary_step(
    cfg: PreprocessConfig, workers: Workers, spec: Any, tmp: str, timings: Dict[str, float]
) -> Tuple[Dictionary, Any]:
    """dict.txt: loaded (--srcdict) or counted; counting also binarizes train with provisional ids."""
    t0 = time.perf_counter()
    first_pass = None  # the train split's provisional parts (counted and binarized in one pass)
    if cfg.srcdict:
        vocab = Dictionary.load(cfg.srcdict)
        logger.info(f"[None] Dictionary: loaded {cfg.srcdict}")
    else:
        path = cfg.trainpref
        desc = "dictionary" if cfg.dict_only else "train+dictionary"
        with _progress_bar(cfg, os.path.getsize(path), desc) as bar:
            units = units_of(cfg, path)
            if cfg.dict_only:
                counts = count_file(path, workers, spec, cfg.encoding_errors, bar.update, units)
            else:
                first_pass = provisional_file(
                    path, os.path.join(tmp, "train"), workers, spec, cfg.encoding_errors, bar.update, units
                )
                counts = part_counts(first_pass)
        vocab = Dictionary()
        vocab.add_counts(counts)
        n_counted = sum(counts.values())
        if first_pass:  # the line ends were counted as "</s>"
            n_counted -= sum(part.summary.num_seq for part in first_pass)
        vocab.finalize(threshold=cfg.thresholdsrc, nwords=cfg.nwordssrc, padding_factor=cfg.padding_factor)
        seconds = time.perf_counter() - t0
        how = "counted and binarized with provisional ids" if first_pass else "counted"
        logger.info(
            f"[None] Dictionary: {path}: {n_counted} tokens {how} in {seconds:.2f}s "
            f"({_rate(n_counted, seconds)}, {cfg.workers} workers)"
        )
    vocab.save(os.path.join(tmp, "dict.txt"))
    timings["dictionary"] = time.perf_counter() - t0
    return vocab, first_pass


def _binarize_step(
    cfg: PreprocessConfig,
    splits: List[Tuple[str, str, str]],
    vocab: Dictionary,
    first_pass: Any,
    workers: Workers,
    spec: Any,
    tmp: str,
    timings: Dict[str, float],
) -> Dict[str, BinarizeSummary]:
    """Every split's ``.bin/.idx`` (train: its provisional ids renumbered with dict.txt)."""
    summaries: Dict[str, BinarizeSummary] = {}
    dtype = best_fitting_dtype(len(vocab))
    for name, flag, path in splits:
        logger.info(f"[None] Dictionary: {len(vocab)} types")
        t0 = time.perf_counter()
        if name == "train" and first_pass is not None:
            summary = finish_provisional(first_pass, os.path.join(tmp, name), vocab, dtype)
        else:
            with _progress_bar(cfg, os.path.getsize(path), name) as bar:
                summary = binarize_file(
                    path,
                    os.path.join(tmp, name),
                    vocab,
                    dtype,
                    workers,
                    spec,
                    cfg.encoding_errors,
                    bar.update,
                    shard=(cfg.shard_id, cfg.num_shards),
                    units=units_of(cfg, path),
                )
        timings[name] = seconds = time.perf_counter() - t0
        _check_has_tokens(flag, path, summary)
        summaries[name] = summary
        logger.info(f"[None] {path}: {summary} (by {vocab.unk_word})")
        if name == "train" and first_pass is not None:
            total = seconds + timings["dictionary"]
            logger.info(
                f"[None] {name}: ids renumbered in {seconds:.2f}s; dictionary + binarize "
                f"took {total:.2f}s ({_rate(summary.num_tok, total)}, {cfg.workers} workers)"
            )
        else:
            logger.info(
                f"[None] {name}: binarized in {seconds:.2f}s ({_rate(summary.num_tok, seconds)}, {cfg.workers} workers)"
            )
    return summaries
