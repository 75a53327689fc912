"""The SmolLM3 family: the Llama family's pre-norm blocks of grouped-query attention and SwiGLU, with NoPE layers
(every ``--nope-layer-interval``-th layer, or those ``--nope-layers`` names, attends without rotary embeddings).
``config.py`` its options, ``model.py`` the decoder, ``archs.py`` the named sizes, ``parallel.py`` its
tensor-parallel plan (Llama's), ``hf.py`` its Hugging Face adapter. Importing the package registers the sizes;
``--arch smollm3``'s class registers with ``model.py``, imported at its first use (it needs torch, ``--help`` does
not).

A family of its own rather than sizes of ``llama``: which layers rotate is an option no Llama-family class has,
and the model is written as ``SmolLM3ForCausalLM``; the blocks and the plan are Llama's, imported."""

from toolkit.models.smollm3 import archs  # noqa: F401  (registration)
