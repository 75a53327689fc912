"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, TinyLlama): ``config.py`` its options, ``model.py`` the
decoder, ``archs.py`` the named sizes, ``parallel.py`` its tensor-parallel plan, ``hf.py`` its Hugging Face
config and state dict. Importing the package registers the sizes; ``--arch llama``'s class registers with
``model.py``, imported at its first use (it needs torch, ``--help`` does not)."""

from toolkit.models.llama import archs  # noqa: F401  (registration)
