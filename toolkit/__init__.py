"""toolkit: a fairseq-style language-model training toolkit on PyTorch (FSDP2, DeepSpeed CPU Adam)."""

__version__ = "0.1.0"
