"""The OLMo 3 family: OLMo 2's blocks (norms after attention and the MLP, QK-norm over the whole projections) with
sliding windows on the layers ``--layer-types`` makes local (three of every four in the published sizes) and
RoPE scaling on the global layers only. ``config.py`` its options, ``model.py`` the decoder, ``archs.py`` the named
sizes, ``parallel.py`` its tensor-parallel plan (OLMo 2's), ``hf.py`` its Hugging Face adapter. Importing the
package registers the sizes; ``--arch olmo3``'s class registers with ``model.py``, imported at its first use (it
needs torch, ``--help`` does not).

A family of its own rather than sizes of ``olmo2``: a model with local layers and RoPE scaling rotates its local
layers unscaled (``Olmo3ForCausalLM``'s rule), which an ``olmo2`` model with the same options does not, and it is
written as ``Olmo3ForCausalLM``; the blocks, the options and the plan are OLMo 2's, imported."""

from toolkit.models.olmo3 import archs  # noqa: F401  (registration)
