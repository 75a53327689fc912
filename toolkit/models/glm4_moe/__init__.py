"""The GLM-4.5 family (GLM-4.5, GLM-4.5-Air: transformers' ``Glm4MoeForCausalLM``): ``config.py`` its options,
``model.py`` the decoder (pre-norm blocks of grouped-query attention with partial rotary, the first layers' MLP
dense, DeepSeekMoE in the others), ``archs.py`` the named sizes, ``parallel.py`` its parallelism plan, ``hf.py``
its Hugging Face adapter. Importing the package registers the sizes; ``--arch glm4_moe``'s class registers with
``model.py``, imported at its first use (it needs torch, ``--help`` does not)."""

from toolkit.models.glm4_moe import archs  # noqa: F401  (registration)
