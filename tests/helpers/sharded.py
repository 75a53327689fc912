"""Data-bins split into shards (data1:data2:...), for the sharded-data tests of both tiers."""

from __future__ import annotations

import os

from tests.helpers.lm_fixtures import make_data_bin

SYMBOLS = list("abcdefgh")
# Disjoint words per shard: a batch's tokens tell which shard it came from.
SHARD_LINES = [["a b a b", "b a"] * 6, ["c d c", "d c d d"] * 6, ["e f", "f e e f"] * 6]


def make_shards(root, n=3, valid_in_all=False):
    paths = []
    for i in range(n):
        splits = {"train": SHARD_LINES[i]}
        if i == 0 or valid_in_all:
            splits["valid"] = ["a c e", "b d f"]
        make_data_bin(os.path.join(root, f"shard{i}"), splits, symbols=SYMBOLS)
        paths.append(os.path.join(root, f"shard{i}"))
    return paths
