"""Building blocks of decoder-only transformers, shared by the families (``llama`` today; Qwen3, Gemma 3,
OLMo 2 and MoE models next): each a small module configured by arguments, not by a family's config (attention:
``toolkit.models.common.attention``).

``norms``         RMSNorm, with the ``(1 + w)`` variant (Gemma)
``rope``          rotary frequencies (Llama 3 scaling; a table of scalings for YaRN and others), tables, rotation
``feed_forward``  SwiGLU, GeGLU, GELU; ``FEED_FORWARDS`` is where a mixture-of-experts block registers
``moe``           mixture of experts: top-k router (softmax / sigmoid with an aux-loss-free bias), stacked
                  experts with dropless sorted dispatch, shared experts, load-balancing and z losses

A family keeps its own block (which norms where, its parameter names around these modules) and its
config; these modules take plain numbers, so their state-dict names are the ones the family gives them.
"""
