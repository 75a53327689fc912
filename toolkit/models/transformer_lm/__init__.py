"""The ``transformer_lm`` family (fairseq's): ``config.py`` its options, ``model.py`` the decoder and its FLOPs,
``archs.py`` the named sizes, ``parallel.py`` its tensor-parallel plan, ``hf.py`` its state dict in
Hugging Face's names (fairseq's are ``toolkit.compat.fairseq.weights``). Importing the package registers
the sizes (``--arch transformer_lm``'s class registers with ``model.py``, imported at its first use: it needs
torch, ``--help`` does not); the names fairseq users and plugins import stay here."""

from typing import Any

from toolkit.models.transformer_lm import archs  # noqa: F401  (registration)
from toolkit.models.transformer_lm.archs import *  # noqa: F401,F403  (transformer_lm, base_lm_architecture, ...)
from toolkit.models.transformer_lm.config import TransformerLMConfig  # noqa: F401

_MODEL_NAMES = (
    "ACTIVATIONS",
    "CausalSelfAttention",
    "KVCache",
    "TransformerBlock",
    "TransformerLanguageModel",
    "flops_per_token",
    "sinusoidal_table",
)


def __getattr__(name: str) -> Any:
    if name in _MODEL_NAMES:
        from toolkit.models.transformer_lm import model

        return getattr(model, name)
    raise AttributeError(f"module 'toolkit.models.transformer_lm' has no attribute '{name}'")
