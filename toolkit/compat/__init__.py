"""Compatibility layers for code written against other toolkits (see ``toolkit.compat.fairseq``)."""
