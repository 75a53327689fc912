"""fairseq's memory-mapped indexed dataset (``--dataset-impl mmap``): ``.bin`` + ``.idx``.

``.idx`` layout, little-endian, and nothing after it:
  magic ``b"MMIDIDX\\x00\\x00"`` | version uint64 = 1 | dtype code uint8 |
  item count uint64 | item sizes int32[count] | byte pointers int64[count]
``.bin`` is the items' tokens back to back in that dtype. Reading maps both
files, so a corpus of any size costs no RAM beyond the pages touched.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from array import array
from typing import Optional, Union

import numpy as np
import torch

from toolkit.core.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.double,
    8: np.uint16,
    9: np.uint32,
    10: np.uint64,
}


def dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"no indexed-dataset code for dtype {dtype}")


def best_fitting_dtype(vocab_size: int) -> type:
    """The smallest integer type that holds every token id."""
    if vocab_size <= 256:
        return np.uint8
    if vocab_size <= 65536:
        return np.uint16
    return np.int32


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def write_index(path: str, dtype, sizes: np.ndarray) -> None:
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(sizes.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))


HEADER_BYTES = len(MAGIC) + 8 + 1 + 8


def read_index_header(idx_path: str):
    """(dtype, item count, offset of the sizes) of an ``.idx``, checking that the file holds all it announces."""
    with open(idx_path, "rb") as f:
        header = f.read(HEADER_BYTES)
    size = os.path.getsize(idx_path)
    if header[: len(MAGIC)] != MAGIC:
        raise UserError(
            f"{idx_path}: not a memory-mapped indexed dataset (bad magic); "
            f"re-run toolkit-preprocess with --dataset-impl mmap"
        )
    if len(header) < HEADER_BYTES:
        raise UserError(
            f"{idx_path}: truncated ({size} bytes, shorter than the {HEADER_BYTES}-byte header); "
            f"re-run toolkit-preprocess"
        )
    version, code, count = struct.unpack("<QBQ", header[len(MAGIC) :])
    if version != VERSION:
        raise UserError(f"{idx_path}: index version {version} is not supported (expected {VERSION})")
    if code not in DTYPE_CODES:
        raise UserError(f"{idx_path}: unknown dtype code {code}")
    expected = HEADER_BYTES + 12 * count  # int32 size + int64 pointer per item
    if size < expected:
        raise UserError(
            f"{idx_path}: truncated: {size} bytes but its {count} items need {expected}; "
            f"the data-bin is incomplete, re-run toolkit-preprocess"
        )
    return np.dtype(DTYPE_CODES[code]), count, HEADER_BYTES


class MMapIndexedDataset(torch.utils.data.Dataset):
    """Random access to items (sentences/lines) of a binarized split."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path = index_file_path(prefix)
        self.dtype, count, offset = read_index_header(idx_path)
        self._index = np.memmap(idx_path, mode="r", order="C")
        self.sizes = np.frombuffer(self._index, dtype=np.int32, count=count, offset=offset)
        self.pointers = np.frombuffer(self._index, dtype=np.int64, count=count, offset=offset + self.sizes.nbytes)
        bin_path = data_file_path(prefix)
        if not os.path.isfile(bin_path):
            raise UserError(f"{bin_path}: missing data file beside {idx_path}")
        if os.path.getsize(bin_path) == 0:
            self._data = np.zeros(0, dtype=self.dtype)
        else:
            self._data = np.memmap(bin_path, mode="r", dtype=self.dtype, order="C")
        expected = int(self.sizes.sum(dtype=np.int64))
        if expected != len(self._data):
            raise UserError(
                f"{bin_path}: holds {len(self._data)} tokens but its index lists {expected}; "
                f"the data-bin is incomplete, re-run toolkit-preprocess"
            )

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = self.pointers[i] // self.dtype.itemsize
        item = self._data[start : start + self.sizes[i]]
        return torch.from_numpy(item.astype(np.int64))

    @property
    def tokens(self) -> np.ndarray:
        """Every token of the split as one flat read-only array (items are stored back to back)."""
        return self._data

    def num_tokens(self, i: int) -> int:
        return int(self.sizes[i])

    @staticmethod
    def exists(prefix: str) -> bool:
        return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


class MMapIndexedDatasetBuilder:
    """Streams items to ``.bin``; ``finalize`` writes the ``.idx``.

    Item sizes go to an anonymous temporary file beside the ``.bin`` as they
    arrive, so memory stays bounded whatever the number of items.
    """

    _SIZES_BUFFER = 1 << 16  # item sizes kept in memory before they are spilled
    _INDEX_CHUNK = 1 << 20  # item sizes per pass when the index is written

    def __init__(self, bin_path: str, dtype=np.int64):
        self.dtype = np.dtype(dtype)
        self._file = open(bin_path, "wb")
        self._sizes_file = tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(bin_path)))
        self._sizes_buffer = array("i")
        self._num_items = 0

    def _spill_sizes(self) -> None:
        if self._sizes_buffer:
            self._sizes_file.write(np.asarray(self._sizes_buffer, dtype=np.int32).tobytes())
            self._sizes_buffer = array("i")

    def _add_sizes(self, sizes: np.ndarray) -> None:
        sizes = np.asarray(sizes, dtype=np.int32).reshape(-1)
        self._num_items += len(sizes)
        if len(sizes) >= self._SIZES_BUFFER:
            self._spill_sizes()
            self._sizes_file.write(sizes.tobytes())
        else:
            self._sizes_buffer.frombytes(sizes.tobytes())
            if len(self._sizes_buffer) >= self._SIZES_BUFFER:
                self._spill_sizes()

    def add_item(self, tensor: Union[torch.Tensor, np.ndarray, list]) -> None:
        array_ = tensor.numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)
        self._file.write(array_.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes_buffer.append(array_.size)
        self._num_items += 1
        if len(self._sizes_buffer) >= self._SIZES_BUFFER:
            self._spill_sizes()

    def add_items(self, flat_tokens: np.ndarray, sizes: np.ndarray) -> None:
        """Append many items at once: their tokens back to back and each item's length."""
        self._file.write(np.asarray(flat_tokens).astype(self.dtype, copy=False).tobytes(order="C"))
        self._add_sizes(sizes)

    def merge_file_(self, other_prefix: str, remap: Optional[np.ndarray] = None) -> None:
        """Append another builder's finished output, in chunks.

        Without ``remap`` the dtypes must match and the bytes are copied; with it,
        each token ``t`` of the other dataset is written as ``remap[t]`` (any dtype).
        """
        other = MMapIndexedDataset(other_prefix)
        if remap is None and other.dtype != self.dtype:
            raise ValueError(f"cannot merge {other_prefix}: dtype {other.dtype} != {self.dtype}")
        for start in range(0, len(other.sizes), self._INDEX_CHUNK):
            self._add_sizes(other.sizes[start : start + self._INDEX_CHUNK])
        other_dtype = other.dtype
        del other
        with open(data_file_path(other_prefix), "rb") as f:
            if remap is None:
                shutil.copyfileobj(f, self._file, length=16 << 20)
            else:  # plain reads, not the memory map: the pages read do not stay resident
                remap = np.asarray(remap).astype(self.dtype, copy=False)
                while True:
                    tokens = np.fromfile(f, dtype=other_dtype, count=4 * self._INDEX_CHUNK)
                    if not len(tokens):
                        break
                    self._file.write(remap[tokens].tobytes(order="C"))

    def finalize(self, index_path: str) -> None:
        self._file.close()
        self._spill_sizes()
        self._sizes_file.flush()
        self._sizes_file.seek(0)
        count = self._num_items
        with open(index_path, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", dtype_code(self.dtype)))
            f.write(struct.pack("<Q", count))
            shutil.copyfileobj(self._sizes_file, f, length=4 * self._INDEX_CHUNK)
            # byte pointers: exclusive running sum of size * itemsize, a chunk at a time
            self._sizes_file.seek(0)
            offset = 0
            while True:
                chunk = self._sizes_file.read(4 * self._INDEX_CHUNK)
                if not chunk:
                    break
                nbytes = np.frombuffer(chunk, dtype=np.int32).astype(np.int64) * self.dtype.itemsize
                ends = np.cumsum(nbytes)
                pointers = ends - nbytes + offset
                offset += int(ends[-1])
                f.write(pointers.tobytes(order="C"))
        self._sizes_file.close()
