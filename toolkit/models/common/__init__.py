"""What the model families are built from, once:

``attention``       one attention, its variants over one core call, its back ends chosen in one place
``options``         the options every rotary decoder family shares (``DecoderOptions``; torch-free, read by --help)
``norms``           RMSNorm, with Gemma's ``(1 + w)`` scale (LayerNorm is torch's)
``blocks``          the placements of the norms as block classes: pre-norm, norm-after (OLMo 2), sandwich (Gemma)
``rope``            rotary frequencies (Llama 3, YaRN, linear scaling), partial rotary, tables, rotation
``mlp``             the one table of activations; gated (SwiGLU, GeGLU) and plain MLPs
``moe``             mixture of experts: top-k router, stacked experts with dropless sorted dispatch, shared experts
``rotary_decoder``  the decoder model of the rotary families: embedding, blocks, final norm, output, rotary tables
``parallel``        the tensor-parallel plan of such a model, from the family's block as data
``hf_adapter``      what a family's Hugging Face adapter is (``HFAdapter``), key maps as data (``KeyMap``)
``hf_config``       the config.json settings the rotary classes share, read and written
``hf_folder``       a transformers folder (tokenizer, safetensors, checkpoint) read and written through an adapter

Adding a family: a folder ``toolkit/models/<name>/`` with ``config.py`` (its options dataclass, over
``DecoderOptions`` for a rotary decoder), ``archs.py`` (its named sizes, ``@register_model_architecture``),
``model.py`` (its class, ``@register_model(<name>)``: for a rotary decoder a ``RotaryDecoderLM`` whose
``build_block`` composes a block of ``blocks`` from an attention and an MLP), ``parallel.py`` (its block's
tensor-parallel kinds as data) and ``hf.py`` (its ``HFAdapter``), and one line in
``toolkit.core.registry.BUILTIN_FAMILIES`` (a plugin folder calls ``registry.declare_family``).
Nothing imports torch at this package's import (``options`` is read before torch is).
"""
