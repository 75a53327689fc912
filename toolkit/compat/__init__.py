"""Compatibility with other toolkits' files and flags; today only fairseq (:mod:`toolkit.compat.fairseq`)."""
