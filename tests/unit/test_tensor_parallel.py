"""Tensor parallelism (toolkit.distributed.tensor_parallel) on CPU with gloo, against one plain process.

Two spawned groups (tests/helpers/tp_helpers.py): 2 ranks with M=2, and 4 ranks as (dp 2 x mp 2)
under FSDP2. Each trains a tiny model (2 layers, C=32, 4 heads, V=64) for 10 updates on the
same global batches as a single process, with the trainer's normalization (summed loss,
gradients times dp / ntokens), the global gradient norm and clipping, and AdamW.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tp_helpers as H

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")


def test_divisibility_errors():
    from toolkit.core.errors import UserError
    from toolkit.distributed.tensor_parallel import _check_divisible

    with pytest.raises(UserError, match="--decoder-attention-heads 4: must be divisible by --model-parallel-size 3"):
        _check_divisible(H.build(H.model_cfg(), meta=True), 3)


@pytest.mark.parametrize(
    "arch,ffn,published",
    [("transformer_lm_megatron", 4 * 3072, 8.3e9), ("transformer_lm_megatron_11b", 6 * 3072, 11e9)],
)
def test_fairseq_megatron_architectures(arch, ffn, published):
    from toolkit.models import count_parameters, model_config

    c = model_config(arch)
    assert (c.decoder_layers, c.decoder_embed_dim, c.decoder_ffn_embed_dim, c.decoder_attention_heads) == (
        72,
        3072,
        ffn,
        32,
    )
    assert (c.dropout, c.attention_dropout, c.activation_fn, c.decoder_normalize_before) == (0.1, 0.1, "gelu", True)
    assert not c.share_decoder_input_output_embed and not c.decoder_learned_pos
    # Megatron-LM's 8.3B and fairseq's Megatron-11b (GPT-2 vocabulary padded to 51200)
    n = count_parameters(arch, vocab_size=51200, tokens_per_sample=1024)
    assert abs(n - published) / published < 0.05, n


def test_vocab_parallel_cross_entropy_is_the_cross_entropy_criterion():
    from toolkit.core.registry import CRITERION_REGISTRY, import_all_components

    import_all_components()
    assert CRITERION_REGISTRY.get("vocab_parallel_cross_entropy").cls is CRITERION_REGISTRY.get("cross_entropy").cls
