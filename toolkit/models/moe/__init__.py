"""The mixture-of-experts family (Qwen3-MoE, OLMoE, Mixtral; DeepSeek-V3's sigmoid router and shared experts as
options): ``config.py`` its options, ``model.py`` the decoder (pre-norm blocks, a ``common.moe.MoE`` feed-forward),
``archs.py`` the named sizes, ``parallel.py`` its parallelism plan, ``hf.py`` its Hugging Face classes.
Importing the package registers the sizes; ``--arch moe``'s class registers with ``model.py``, imported at
its first use (it needs torch, ``--help`` does not)."""

from toolkit.models.moe import archs  # noqa: F401  (registration)
