"""The ``transformer_lm`` family (fairseq's): ``config.py`` its options, ``model.py`` the decoder and its FLOPs,
``archs.py`` the named sizes, ``parallel.py`` its tensor-parallel plan, ``hf.py`` its state dict in
Hugging Face's names (fairseq's are ``toolkit.compat.fairseq.weights``). Importing the package registers
``--arch transformer_lm`` and the sizes; the names fairseq users and plugins import stay here."""
from toolkit.models.transformer_lm import archs  # noqa: F401  (registration)
from toolkit.models.transformer_lm.archs import *  # noqa: F401,F403  (transformer_lm, base_lm_architecture, ...)
from toolkit.models.transformer_lm.config import ACTIVATIONS, TransformerLMConfig  # noqa: F401
from toolkit.models.transformer_lm.model import (  # noqa: F401
    CausalSelfAttention,
    KVCache,
    TransformerBlock,
    TransformerLanguageModel,
    flops_per_token,
    sinusoidal_table,
)
