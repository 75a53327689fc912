"""--data-mixture: weights met, deterministic by seed, exact resume after kill -9, validation per source."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.lm_fixtures import make_data_bin
from tests.train_helpers import REPO_ROOT, TINY_MODEL, train
from toolkit.data.iterators import EpochBatchIterator
from toolkit.data.mixture import MixtureDataset, Source, mixture_order, parse_mixture, source_counts
from toolkit.core.errors import UserError

WORDS = "the cat sat on a mat dogs ran in park birds sang over tall green trees".split()


class Sized:
    """A stand-in source: ``n`` samples of the given sizes."""

    def __init__(self, sizes):
        self.sizes = np.asarray(sizes, dtype=np.int64)

    def __len__(self):
        return len(self.sizes)

    def seq_lengths(self):
        return self.sizes


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.3, 0.2), (0.9, 0.05, 0.05)])
def test_weights_met_within_one_percent_over_10k(weights):
    """Counted over the first 10k samples *as trained*: batches cut and shuffled by the epoch iterator."""
    sources = [Source(f"s{i}", "-", w) for i, w in enumerate(weights)]
    parts = [Sized(np.full(n, 16)) for n in (5000, 800, 20000)[:len(weights)]]
    mixed = MixtureDataset(sources, parts, num_samples=30000)
    batches = [mixed.ordered_indices(5)[i:i + 8] for i in range(0, 30000, 8)]
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


@pytest.mark.parametrize("spec, fragment", [
    ("web=/nope:1", "no such data-bin folder"),
    ("web:0.7", "is not NAME=PATH:WEIGHT"),
    ("web=DIR:-1", "must be a positive number"),
    ("web=DIR:x", "must be a positive number"),
    ("web=DIR:1,web=DIR:2", "named twice"),
    ("w b=DIR:1", "may hold only letters"),
])
def test_bad_specs(tmp_path, spec, fragment):
    with pytest.raises(UserError, match=fragment):
        parse_mixture(spec.replace("DIR", str(tmp_path)))


# --- through toolkit-train ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    rng = np.random.RandomState(0)

    def lines(n, vocab):
        return [" ".join(rng.choice(vocab, size=rng.randint(3, 25))) for _ in range(n)]

    make_data_bin(root / "web", {"train": lines(400, WORDS[:10]), "valid": lines(40, WORDS[:10])}, symbols=WORDS)
    make_data_bin(root / "code", {"train": lines(120, WORDS[6:]), "valid": lines(30, WORDS[6:])}, symbols=WORDS)
    make_data_bin(root / "other", {"train": lines(50, WORDS)})  # its own dictionary
    return root


def mixture_args(root):
    return ["--data-mixture", f"web={root}/web:0.7,code={root}/code:0.3", "--log-format", "json"]


def train_mixture(root, save_dir, *extra, **kw):
    return train("", save_dir, *mixture_args(root), *extra, **kw)


def test_validation_per_source_and_weighted_total(tmp_path, sources):
    run = train_mixture(sources, str(tmp_path / "ck"), "--max-update", "4", "--no-save")
    web, code, total = (float(run.records(tag)[-1][f"{tag}_loss"]) for tag in ("valid_web", "valid_code", "valid"))
    assert abs(total - (0.7 * web + 0.3 * code)) < 2e-3, (web, code, total)
    assert "--valid-subset valid_web,valid_code" in run.stdout


def popen_train(root, save_dir, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT)
    args = ["", "--save-dir", save_dir, *TINY_MODEL, *mixture_args(root), *extra]
    return subprocess.Popen([sys.executable, "-m", "toolkit_cli.train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT)


def test_resumes_exactly_after_kill_9(tmp_path, sources):
    common = ["--max-update", "12", "--save-interval-updates", "5", "--dropout", "0", "--seed", "7"]
    whole = train_mixture(sources, str(tmp_path / "whole"), *common, "--disable-validation")
    proc = popen_train(sources, str(tmp_path / "killed"), *common, "--disable-validation")
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "Saved checkpoint" in line and "checkpoint_1_5" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "".join(seen[-20:])
    resumed = train_mixture(sources, str(tmp_path / "killed"), *common, "--disable-validation")
    before, after = whole.losses(), resumed.losses()
    assert sorted(after) == list(range(6, 13))
    for update in after:
        assert after[update] == pytest.approx(before[update], abs=1e-6), (update, before, after)


def test_different_dictionaries_refused(tmp_path, sources):
    run = train("", str(tmp_path / "ck"), "--data-mixture", f"web={sources}/web:1,other={sources}/other:1",
                "--max-update", "1", check=False)
    assert run.returncode == 1
    err = run.stderr.strip().splitlines()
    assert len(err) == 1 and "must share one dictionary" in err[0] and "--srcdict" in err[0], err
