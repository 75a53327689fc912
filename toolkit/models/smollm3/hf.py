"""The SmolLM3 family's Hugging Face adapter: ``SmolLM3ForCausalLM`` folders, whose tensors are the Llama family's
under ``model.`` (``DECODER_KEYS``; tied by default). Its own settings: ``no_rope_layers`` (1 for a layer that
rotates, 0 for a NoPE one; absent, every ``no_rope_layer_interval``-th layer is NoPE) and Qwen2's windows
(``use_sliding_window`` with ``layer_types``)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from toolkit.core.errors import UserError
from toolkit.models.common import hf_config
from toolkit.models.common.hf_adapter import DecoderHFAdapter
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.smollm3.config import SmolLM3Config, nope_layers

KINDS = {"smollm3": DecoderClass("SmolLM3ForCausalLM", layer_types=True, tied_by_default=True, no_attention_bias=True)}


class SmolLM3Adapter(DecoderHFAdapter):
    FAMILY, FAMILY_NAME, MLP, KINDS = (
        "smollm3",
        "the SmolLM3 family",
        "the SmolLM3 family's feed-forward is SwiGLU (silu)",
        KINDS,
    )

    def options(self, config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
        """The shared options and the NoPE layers: the interval where ``no_rope_layers`` follows it, else the list."""
        out = super().options(config, kind, where)
        L, interval = config["num_hidden_layers"], config.get("no_rope_layer_interval", 4)
        if type(interval) is not int or interval < 0:
            raise UserError(f"{where}: no_rope_layer_interval {interval!r}: a count of layers (0 or more)")
        rotates = config.get("no_rope_layers")
        if rotates is None:
            return dict(out, nope_layer_interval=interval, nope_layers=None)
        if not isinstance(rotates, list) or len(rotates) < L or any(r not in (0, 1) for r in rotates[:L]):
            raise UserError(
                f"{where}: no_rope_layers {rotates!r}: give 1 (RoPE) or 0 (NoPE) for each of the {L} layers "
                "(num_hidden_layers)"
            )
        nope = [i for i in range(L) if not rotates[i]]
        if nope == [i for i in range(L) if interval and (i + 1) % interval == 0]:
            return dict(out, nope_layer_interval=interval, nope_layers=None)
        return dict(out, nope_layer_interval=0 if not nope else interval, nope_layers=",".join(map(str, nope)) or None)

    def hf_config(self, cfg: SmolLM3Config, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict]:
        if cfg.qk_norm or cfg.attention_qkv_bias or cfg.mlp_activation != "silu":
            raise UserError(
                "SmolLM3ForCausalLM has SwiGLU, no QK-norm and no q/k/v biases; this model differs, no transformers "
                "class of the SmolLM3 family computes it, nothing written"
            )
        config = hf_config.decoder_hf_config(cfg, vocab_size, base, "smollm3")
        config.setdefault("pad_token_id", None)  # SmolLM3Config's default (128004) is past a smaller vocabulary
        nope = set(nope_layers(cfg))
        windows = hf_config.qwen_windows(cfg)
        windows.pop("max_window_layers")
        config.update(
            attention_bias=False,
            mlp_bias=False,
            no_rope_layers=[int(i not in nope) for i in range(cfg.decoder_layers)],
            no_rope_layer_interval=cfg.nope_layer_interval,
            **windows,
        )
        return self.CLASSES["smollm3"], config
