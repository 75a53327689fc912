"""--data-mixture: weights met, deterministic by seed, exact resume after kill -9, validation per source."""

import numpy as np
import pytest

from tests.helpers.mixture import make_sources
from toolkit.data.iterators import EpochBatchIterator
from toolkit.data.mixture import MixtureDataset, Source, mixture_order, parse_mixture, source_counts
from toolkit.core.errors import UserError


class Sized:
    """A stand-in source: ``n`` samples of the given sizes."""

    def __init__(self, sizes):
        self.sizes = np.asarray(sizes, dtype=np.int64)

    def __len__(self):
        return len(self.sizes)

    def seq_lengths(self):
        return self.sizes


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_sources(tmp_path_factory.mktemp("mixture"))


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2), (0.9, 0.05, 0.05)])
def test_weights_met_within_one_percent_over_10k(weights):
    """Counted over the first 10k samples *as trained*: batches cut and shuffled by the epoch iterator."""
    sources = [Source(f"s{i}", "-", w) for i, w in enumerate(weights)]
    parts = [Sized(np.full(n, 16)) for n in (5000, 800, 20000)[: len(weights)]]
    mixed = MixtureDataset(sources, parts, num_samples=30000)
    batches = [mixed.ordered_indices(5)[i : i + 8] for i in range(0, 30000, 8)]
    itr = EpochBatchIterator(mixed, list, batches, seed=5)
    order = np.concatenate(itr.epoch_batches(1))
    drawn = np.bincount(mixed.source_of(order[:10000]), minlength=len(weights)) / 10000
    assert np.all(np.abs(drawn - np.asarray(weights)) < 0.01), drawn
    whole = np.bincount(mixed.source_of(order), minlength=len(weights))
    assert whole.tolist() == source_counts(weights, 30000).tolist()


def test_every_prefix_holds_the_shares():
    order = mixture_order([100, 50], [0.7, 0.3], 2000, seed=1)
    share = np.cumsum(order[:, 0] == 0) / np.arange(1, 2001)
    assert np.all(np.abs(share[20:] - 0.7) < 0.05)
    # a small source is repeated, each pass a new permutation of all its samples
    code = order[order[:, 0] == 1, 1]
    assert sorted(code[:50].tolist()) == list(range(50)) and code[:50].tolist() != code[50:100].tolist()


def test_deterministic_by_seed():
    a = mixture_order([300, 70, 900], [0.2, 0.5, 0.3], 5000, seed=3)
    assert np.array_equal(a, mixture_order([300, 70, 900], [0.2, 0.5, 0.3], 5000, seed=3))
    assert not np.array_equal(a, mixture_order([300, 70, 900], [0.2, 0.5, 0.3], 5000, seed=4))


def test_source_counts_add_up():
    for total in (1, 7, 1000, 12345):
        counts = source_counts([0.333, 0.333, 0.334], total)
        assert counts.sum() == total and counts.max() - counts.min() <= 1 + total * 0.001


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("web=/nope:1", "no such data-bin folder"),
        ("web:0.7", "is not NAME=PATH:WEIGHT"),
        ("web=DIR:-1", "must be a positive number"),
        ("web=DIR:x", "must be a positive number"),
        ("web=DIR:1,web=DIR:2", "named twice"),
        ("w b=DIR:1", "may hold only letters"),
    ],
)
def test_bad_specs(tmp_path, spec, fragment):
    with pytest.raises(UserError, match=fragment):
        parse_mixture(spec.replace("DIR", str(tmp_path)))
