"""The Qwen3-Next family (the gated DeltaNet hybrids): ``config.py`` its options, ``model.py`` the decoder (pre-norm
blocks whose token mixer is gated DeltaNet linear attention in three of every four layers and gated full attention
with partial rotary in the fourth, every MLP a mixture of experts with a sigmoid-gated shared expert), ``archs.py``
the named sizes, ``parallel.py`` its parallelism plan, ``hf.py`` its Hugging Face adapter (``hf_vision_language.py``:
the released Qwen3.5 folders, vision-language models, read as their text model). Importing the package
registers the sizes; ``--arch qwen3_next``'s class registers with ``model.py``, imported at its first use (it
needs torch, ``--help`` does not)."""

from toolkit.models.qwen3_next import archs  # noqa: F401  (registration)
