"""The Gemma family (Gemma 2/3 text models): ``config.py`` its options, ``model.py`` the decoder (sandwich blocks of
(1 + w) RMSNorms, GeGLU, a score scale, soft-caps, local layers with their own rotary base, embeddings times
sqrt(width)), ``archs.py`` the named sizes, ``parallel.py`` its tensor-parallel plan, ``hf.py`` its Hugging Face
adapter. Importing the package registers the sizes; ``--arch gemma3``'s class registers with ``model.py``,
imported at its first use (it needs torch, ``--help`` does not)."""

from toolkit.models.gemma3 import archs  # noqa: F401  (registration)
