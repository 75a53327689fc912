"""Sentence-level training (--sample-break-mode eos|complete|complete_doc): long lines are skipped with
fairseq's warning, and fairseq's --shorten-method truncate|random_crop cut them instead."""

import numpy as np
import pytest
import torch

from toolkit.data.shorten import ShortenedDataset, applies_to, fairseq_numpy_seed


class FairseqCrop:
    """fairseq's TruncateDataset / RandomCropDataset read item by item (the reference)."""

    def __init__(self, items, length, method, seed):
        self.items, self.length, self.method, self.seed = items, length, method, seed

    def __getitem__(self, index):
        item = self.items[index]
        if self.method == "truncate":
            return item[: self.length]
        state = np.random.get_state()
        np.random.seed(int(hash((self.seed, 0, index)) % 1e6))
        excess = len(item) - self.length
        if excess > 0:
            start = np.random.randint(0, excess)
            item = item[start : start + self.length]
        np.random.set_state(state)
        return item


class ItemList:
    def __init__(self, items):
        self.items = items
        self.sizes = np.array([len(x) for x in items])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return torch.as_tensor(self.items[i])


@pytest.mark.parametrize("method", ["truncate", "random_crop"])
def test_shortened_items_equal_fairseq(method):
    rng = np.random.RandomState(0)
    items = [rng.randint(4, 100, size=n) for n in rng.randint(1, 40, size=300)]
    ours = ShortenedDataset(ItemList(items), 12, method, seed=7)
    reference = FairseqCrop(items, 12, method, seed=7)
    assert ours.sizes.tolist() == [min(len(x), 12) for x in items]
    for i in range(len(items)):
        assert ours[i].tolist() == reference[i].tolist(), i
    if method == "random_crop":  # not all windows start at 0: it did crop somewhere inside
        assert any(ours[i].tolist() != items[i][:12].tolist() for i in range(len(items)))


def test_seed_and_split_list():
    assert fairseq_numpy_seed(3) == 3
    assert fairseq_numpy_seed(3, 0, 5) == int(hash((3, 0, 5)) % 1e6)
    assert applies_to("valid", "") and applies_to("valid", "train,valid") and not applies_to("valid", "train")
