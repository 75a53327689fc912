"""Compatibility with fairseq: its file formats, configs and Python surface."""
