"""The mmap indexed dataset, byte for byte against fairseq's published layout."""

import struct

import numpy as np
import pytest
import torch

from toolkit.data import indexed_dataset as ids_mod
from toolkit.data.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    dtype_code,
    write_index,
)
from toolkit.core.errors import UserError

ITEMS = [[1, 2, 3], [4], [], [5, 6], [300, 7, 65535]]


def expected_idx(code, sizes, itemsize):
    """fairseq's MMapIndexedDataset.Index: magic, <Q version 1, <B dtype code, <Q count, int32 sizes, int64 pointers."""
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", len(sizes))
    out += struct.pack(f"<{len(sizes)}i", *sizes)
    pointers, pos = [], 0
    for s in sizes:
        pointers.append(pos)
        pos += s * itemsize
    out += struct.pack(f"<{len(sizes)}q", *pointers)
    return out


def build(prefix, items, dtype, many=False):
    b = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    if many:
        b.add_items(np.concatenate([np.asarray(i, dtype=np.int64) for i in items]), [len(i) for i in items])
    else:
        for item in items:
            b.add_item(torch.tensor(item, dtype=torch.int64))
    b.finalize(prefix + ".idx")


@pytest.mark.parametrize("many", [False, True])
def test_bytes_match_published_layout(tmp_path, many):
    prefix = str(tmp_path / "train")
    build(prefix, ITEMS, np.uint16, many=many)
    sizes = [len(i) for i in ITEMS]
    with open(prefix + ".idx", "rb") as f:
        assert f.read() == expected_idx(8, sizes, 2)
    flat = [t for item in ITEMS for t in item]
    with open(prefix + ".bin", "rb") as f:
        assert f.read() == struct.pack(f"<{len(flat)}H", *flat)


def test_dtype_codes_and_best_fit():
    assert [dtype_code(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16)] == [1, 2, 3, 4, 5, 8]
    assert best_fitting_dtype(256) == np.uint8
    assert best_fitting_dtype(257) == np.uint16
    assert best_fitting_dtype(65536) == np.uint16
    assert best_fitting_dtype(65537) == np.int32


def test_int32_layout(tmp_path):
    prefix = str(tmp_path / "x")
    build(prefix, [[70000, 1], [2]], np.int32)
    assert open(prefix + ".idx", "rb").read() == expected_idx(4, [2, 1], 4)
    assert open(prefix + ".bin", "rb").read() == struct.pack("<3i", 70000, 1, 2)


def test_read_back(tmp_path):
    prefix = str(tmp_path / "train")
    build(prefix, ITEMS, np.uint16)
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == len(ITEMS)
    assert [ds[i].tolist() for i in range(len(ds))] == ITEMS
    assert ds[0].dtype == torch.int64
    assert ds.sizes.tolist() == [len(i) for i in ITEMS]
    assert ds.tokens.tolist() == [t for i in ITEMS for t in i]
    assert MMapIndexedDataset.exists(prefix)


def test_merge_equals_single_build(tmp_path):
    build(str(tmp_path / "all"), ITEMS, np.uint16)
    build(str(tmp_path / "a"), ITEMS[:2], np.uint16)
    build(str(tmp_path / "b"), ITEMS[2:], np.uint16)
    merged = MMapIndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    merged.merge_file_(str(tmp_path / "a"))
    merged.merge_file_(str(tmp_path / "b"))
    merged.finalize(str(tmp_path / "m.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"m.{ext}").read_bytes() == (tmp_path / f"all.{ext}").read_bytes()
    bad = MMapIndexedDatasetBuilder(str(tmp_path / "bad.bin"), dtype=np.int32)
    with pytest.raises(ValueError):
        bad.merge_file_(str(tmp_path / "a"))


def test_sizes_spill_to_disk(tmp_path, monkeypatch):
    """Item sizes are streamed through a temporary file; the index is the same as written in one go."""
    monkeypatch.setattr(MMapIndexedDatasetBuilder, "_SIZES_BUFFER", 3)
    monkeypatch.setattr(MMapIndexedDatasetBuilder, "_INDEX_CHUNK", 2)
    rng = np.random.default_rng(0)
    items = [rng.integers(0, 1000, size=rng.integers(0, 9)).tolist() for _ in range(50)]
    prefix = str(tmp_path / "s")
    b = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for item in items[:7]:
        b.add_item(item)
    b.add_items(np.array([t for i in items[7:] for t in i], dtype=np.int64), [len(i) for i in items[7:]])
    b.finalize(prefix + ".idx")
    write_index(str(tmp_path / "ref.idx"), np.uint16, np.array([len(i) for i in items]))
    assert open(prefix + ".idx", "rb").read() == open(tmp_path / "ref.idx", "rb").read()
    assert [x.tolist() for x in MMapIndexedDataset(prefix)] == items
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.idx", "s.bin", "s.idx"]


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "e")
    build(prefix, [], np.uint16)
    assert open(prefix + ".idx", "rb").read() == expected_idx(8, [], 2)
    assert len(MMapIndexedDataset(prefix)) == 0


def test_bad_files(tmp_path):
    prefix = str(tmp_path / "t")
    build(prefix, ITEMS, np.uint16)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(UserError, match="incomplete"):
        MMapIndexedDataset(prefix)
    (tmp_path / "t.idx").write_bytes(b"NOTANIDX" + b"\x00" * 40)
    with pytest.raises(UserError, match="bad magic"):
        MMapIndexedDataset(prefix)
    assert ids_mod.index_file_path("a/b") == "a/b.idx" and ids_mod.data_file_path("a/b") == "a/b.bin"


def test_merge_with_remap(tmp_path, monkeypatch):
    """merge_file_(prefix, remap): tokens renumbered on the way (how provisional train ids become final)."""
    monkeypatch.setattr(MMapIndexedDatasetBuilder, "_INDEX_CHUNK", 1)  # 4 tokens per read
    build(str(tmp_path / "p"), [[0, 1, 2], [2], [], [1, 0, 0, 2, 1]], np.int32)
    b = MMapIndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    b.merge_file_(str(tmp_path / "p"), remap=np.array([7, 300, 2]))
    b.merge_file_(str(tmp_path / "p"), remap=np.array([1, 1, 1]))
    b.finalize(str(tmp_path / "m.idx"))
    assert [x.tolist() for x in MMapIndexedDataset(str(tmp_path / "m"))] == [
        [7, 300, 2],
        [2],
        [],
        [300, 7, 7, 2, 300],
        [1, 1, 1],
        [1],
        [],
        [1, 1, 1, 1, 1],
    ]
