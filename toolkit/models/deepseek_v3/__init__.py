"""The DeepSeek-V3 family (DeepSeek-V3, Moonlight, Kimi K2): ``config.py`` its options, ``model.py`` the decoder
(pre-norm blocks of multi-head latent attention, the first layers' MLP dense, the others DeepSeekMoE),
``archs.py`` the named sizes, ``parallel.py`` its parallelism plan, ``hf.py`` its Hugging Face adapter.
Importing the package registers the sizes; ``--arch deepseek_v3``'s class registers with ``model.py``, imported
at its first use (it needs torch, ``--help`` does not)."""

from toolkit.models.deepseek_v3 import archs  # noqa: F401  (registration)
