"""Datasets, dictionaries and batching; ``toolkit.data.Dictionary`` is fairseq's ``fairseq.data.Dictionary``."""

from toolkit.data.dictionary import Dictionary  # noqa: F401
