"""The OLMo 2 family: ``config.py`` its options, ``model.py`` the decoder (blocks that normalize the outputs of
attention and the MLP, QK-norm over the whole projections), ``archs.py`` the named sizes, ``parallel.py`` its
tensor-parallel plan, ``hf.py`` its Hugging Face adapter. Importing the package registers the sizes;
``--arch olmo2``'s class registers with ``model.py``, imported at its first use (it needs torch, ``--help`` does
not)."""

from toolkit.models.olmo2 import archs  # noqa: F401  (registration)
