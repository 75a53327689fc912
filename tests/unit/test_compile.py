"""``--compile``'s refusals, checked in one process (unknown backend, with tensor parallelism).

The eager-vs-compiled training comparisons and checkpoints are in tests/integration/test_compile.py.
"""

from __future__ import annotations

import pytest
import torch

from toolkit.distributed.compile import BACKEND_ENV

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")

AOT = "aot_eager"


def tiny_meta_model() -> torch.nn.Module:
    from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

    with torch.device("meta"):
        return TransformerLanguageModel(
            TransformerLMConfig(
                decoder_layers=2, decoder_embed_dim=16, decoder_attention_heads=2, max_target_positions=8
            ),
            20,
            1,
        )


def test_unknown_backend_is_a_user_error(monkeypatch):
    from toolkit.config import CommonConfig, DistributedConfig
    from toolkit.distributed.parallelize import parallelize
    from toolkit.distributed.utils import DistributedEnv
    from toolkit.core.errors import UserError

    monkeypatch.setenv(BACKEND_ENV, "no_such_backend")
    with pytest.raises(UserError, match=f"{BACKEND_ENV}=no_such_backend: not a torch.compile backend"):
        parallelize(tiny_meta_model(), DistributedConfig(compile=True), CommonConfig(), DistributedEnv())
    # --compile with --model-parallel-size: tests/integration/test_composition.py
