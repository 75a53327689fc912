"""The gpt-oss family (gpt-oss-20b, gpt-oss-120b): ``config.py`` its options, ``model.py`` the decoder (pre-norm
blocks of attention with sinks and biases, local and global layers alternating, a mixture of experts with a biased
router and biased experts of the clamped SwiGLU), ``archs.py`` the named sizes, ``parallel.py`` its parallelism
plan, ``hf.py`` its Hugging Face adapter (bf16/fp32 folders and the release's MXFP4 experts, ``mxfp4.py``).
Importing the package registers the sizes; ``--arch gpt_oss``'s class registers with ``model.py``, imported at
its first use (it needs torch, ``--help`` does not)."""

from toolkit.models.gpt_oss import archs  # noqa: F401  (registration)
