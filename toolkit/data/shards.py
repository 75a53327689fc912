"""Binarizing on many machines: ``--num-shards N --shard-id I`` parts and ``--merge`` into one data-bin.

Part I of a split is the I-th of the N line-aligned byte ranges the input is cut into (the cut
``--workers`` uses), binarized with a shared ``--srcdict``; the part's data-bin records which part
it is (``shard.json``). ``--merge`` checks that the parts are all N of one run (same dictionary,
splits and tokenizer files) and appends their ``.bin/.idx`` in order: the bytes equal those of a
one-machine run with the same dictionary, since a split's items are its lines in file order.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from typing import Dict, List

from toolkit.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder, data_file_path, index_file_path
from toolkit.core.errors import UserError
from toolkit.core.fileio import atomic_directory

logger = logging.getLogger("toolkit_cli.preprocess")

SHARD_FILE = "shard.json"
NOT_COPIED = (SHARD_FILE, "preprocess.log")


def check_shard_flags(num_shards: int, shard_id: int, srcdict, merge) -> None:
    if num_shards < 1 or not 0 <= shard_id < num_shards:
        raise UserError(f"--shard-id {shard_id}: must be in [0, --num-shards {num_shards})")
    if num_shards > 1 and merge:
        raise UserError("--merge: joins parts already binarized; leave out --num-shards/--shard-id")
    if num_shards > 1 and not srcdict:
        raise UserError(
            f"--num-shards {num_shards}: every part must use the same dictionary; build it once "
            f"(toolkit-preprocess --trainpref FILE --dict-only --destdir DICT) and give --srcdict "
            f"DICT/dict.txt"
        )


def write_shard_record(folder: str, shard_id: int, num_shards: int, splits: List[str]) -> None:
    with open(os.path.join(folder, SHARD_FILE), "w", encoding="utf-8") as f:
        json.dump({"shard_id": shard_id, "num_shards": num_shards, "splits": splits}, f)
        f.write("\n")


def find_parts(spec: str) -> List[str]:
    """The part folders of ``--merge`` (comma-separated folders or glob patterns), in shard order."""
    folders: List[str] = []
    for pattern in (p.strip() for p in spec.split(",") if p.strip()):
        matched = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        folders += [m for m in matched if os.path.isdir(m)]
        if not matched or not all(os.path.isdir(m) for m in matched):
            raise UserError(
                f"--merge {spec}: {pattern} names no part folder; give the --destdir of each "
                f"--shard-id run (comma separated, or a pattern such as 'parts/*')"
            )
    records = {}
    for folder in folders:
        path = os.path.join(folder, SHARD_FILE)
        if not os.path.isfile(path):
            raise UserError(f"--merge: {folder} has no {SHARD_FILE}; it was not made with --num-shards/--shard-id")
        with open(path, encoding="utf-8") as f:
            records[folder] = json.load(f)
    return _in_shard_order(spec, records)


def _in_shard_order(spec: str, records: Dict[str, dict]) -> List[str]:
    counts = {r["num_shards"] for r in records.values()}
    if len(counts) != 1:
        raise UserError(f"--merge {spec}: the parts come from runs with different --num-shards ({sorted(counts)})")
    n = counts.pop()
    by_id: Dict[int, str] = {}
    for folder, record in records.items():
        if record["shard_id"] in by_id:
            raise UserError(
                f"--merge {spec}: {by_id[record['shard_id']]} and {folder} are both part "
                f"{record['shard_id']}; give each part once"
            )
        by_id[record["shard_id"]] = folder
    missing = [i for i in range(n) if i not in by_id]
    if missing:
        raise UserError(
            f"--merge {spec}: parts {', '.join(map(str, missing))} of {n} are missing; binarize them "
            f"with --shard-id (or wait for those jobs) and merge again"
        )
    return [by_id[i] for i in range(n)]


def _same_files(parts: List[str]) -> List[str]:
    """The non-split files (dict.txt, tokenizer) of part 0, checked identical in every part; the splits."""
    first = parts[0]
    with open(os.path.join(first, SHARD_FILE), encoding="utf-8") as f:
        splits = json.load(f)["splits"]
    split_files = {f"{s}.{ext}" for s in splits for ext in ("bin", "idx")}
    shared = sorted(n for n in os.listdir(first) if n not in split_files and n not in NOT_COPIED)
    for part in parts[1:]:
        with open(os.path.join(part, SHARD_FILE), encoding="utf-8") as f:
            if json.load(f)["splits"] != splits:
                raise UserError(
                    f"--merge: {part} holds other splits than {first}; binarize every part with the "
                    f"same --trainpref/--validpref/--testpref"
                )
        for name in shared:
            other = os.path.join(part, name)
            if not os.path.isfile(other) or not _equal_files(os.path.join(first, name), other):
                raise UserError(
                    f"--merge: {other} differs from {os.path.join(first, name)}; every part must be "
                    f"binarized with the same --srcdict (and tokenizer)"
                )
    return splits


def _equal_files(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def merge_parts(spec: str, destdir: str) -> Dict[str, int]:
    """Join the parts into ``destdir`` (written beside it, renamed at the end); items per split."""
    parts = find_parts(spec)
    splits = _same_files(parts)
    items: Dict[str, int] = {}
    with atomic_directory(destdir) as tmp:
        for name in os.listdir(parts[0]):
            path = os.path.join(parts[0], name)
            if name not in NOT_COPIED and os.path.isfile(path) and not name.endswith((".bin", ".idx")):
                shutil.copyfile(path, os.path.join(tmp, name))
        for split in splits:
            dtype = MMapIndexedDataset(os.path.join(parts[0], split)).dtype
            builder = MMapIndexedDatasetBuilder(data_file_path(os.path.join(tmp, split)), dtype=dtype)
            for part in parts:
                builder.merge_file_(os.path.join(part, split))
            builder.finalize(index_file_path(os.path.join(tmp, split)))
            items[split] = len(MMapIndexedDataset(os.path.join(tmp, split)))
        with open(os.path.join(tmp, "preprocess.log"), "w", encoding="utf-8") as f:
            f.write(f"merged {len(parts)} parts: {', '.join(parts)}\n")
    logger.info(f"merged {len(parts)} parts into {destdir}: " + ", ".join(f"{s} {n} items" for s, n in items.items()))
    return items
