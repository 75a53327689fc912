"""The real fairseq 0.12.2 beside the toolkit (``python -m benchmarks.fairseq_parity.parity``; ``setup.sh`` builds it)."""
