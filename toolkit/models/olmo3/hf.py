"""The OLMo 3 family's Hugging Face adapter: ``Olmo3ForCausalLM`` folders, whose tensors are OLMo 2's under
``model.`` (``DECODER_KEYS``). Its own settings: ``sliding_window`` in the layers ``layer_types`` makes local, and
the rotary frequencies per layer type (transformers 5's ``rope_parameters`` with ``full_attention`` and
``sliding_attention``; before it, ``rope_theta`` with ``rope_scaling`` for the global layers): the local layers
rotate unscaled at the global layers' base, which the toolkit's OLMo 3 model computes (a folder whose local layers
have another base or a scaling of their own is refused in one line)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from toolkit.core.errors import UserError
from toolkit.models.common import hf_config
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.olmo2.hf import Olmo2Adapter
from toolkit.models.olmo3.config import Olmo3Config

KINDS = {
    "olmo3": DecoderClass(
        "Olmo3ForCausalLM", qk_norm=True, window_always=True, layer_types=True, no_attention_bias=True
    )
}


class Olmo3Adapter(Olmo2Adapter):
    FAMILY, FAMILY_NAME, KINDS = "olmo3", "the OLMo 3 family", KINDS

    def config_keys(self, config: Dict[str, Any]) -> Dict[str, str]:
        """transformers 5's ``rope_parameters`` hold the global layers' base and scaling under ``full_attention``."""
        if "full_attention" not in (config.get("rope_parameters") or {}):
            return super().config_keys(config)
        keys = {k: v.replace("rope_scaling.", "rope_parameters.full_attention.") for k, v in self.HF_KEYS.items()}
        return dict(keys, rope_theta="rope_parameters.full_attention.rope_theta")

    def options(self, config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
        """OLMo 2's options of the shared settings, the windows per layer type and the global layers' rotation."""
        params = config.get("rope_parameters") or {}
        if "full_attention" in params:
            _check_local_rope(params, where)
            config = dict(config, rope_parameters=params["full_attention"])
        out = super().options(config, kind, where)
        local = [t for t in config.get("layer_types") or () if t == "sliding_attention"]
        if local and out["sliding_window"] is None and out["rope_scaling_factor"] is not None:
            raise UserError(
                f"{where}: sliding_window {config.get('sliding_window')!r} never binds, yet the local layers rotate "
                "unscaled; the toolkit's OLMo 3 model scales every layer without a binding window; give a window "
                "shorter than max_position_embeddings"
            )
        return out

    def hf_config(self, cfg: Olmo3Config, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict]:
        if not (cfg.qk_norm and cfg.qk_norm_over == "projection" and not cfg.attention_qkv_bias):
            raise UserError(
                "Olmo3ForCausalLM has --qk-norm --qk-norm-over projection and no q/k/v biases; this model differs, "
                "no transformers class of the OLMo 3 family computes it, nothing written"
            )
        if cfg.mlp_activation != "silu":
            raise UserError(f"--mlp-activation {cfg.mlp_activation}: Olmo3ForCausalLM computes SwiGLU; nothing written")
        config = hf_config.decoder_hf_config(cfg, vocab_size, base, "olmo3")
        for key in ("rope_theta", "rope_scaling"):  # rope_parameters says both, per layer type
            config.pop(key, None)
        full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling_factor is not None:
            full = dict(hf_config.hf_rope_scaling(cfg), rope_theta=cfg.rope_theta)
        config.update(
            attention_bias=False,
            sliding_window=cfg.sliding_window,
            layer_types=hf_config.layer_type_names(cfg),
            rope_parameters={
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            },
        )
        return self.CLASSES["olmo3"], config


def _check_local_rope(params: Dict[str, Any], where: str) -> None:
    """The local layers rotate with the default frequencies of the global layers' base (what the model computes)."""
    full, local = params["full_attention"], params.get("sliding_attention") or {}
    kind = local.get("rope_type", "default")
    theta, local_theta = full.get("rope_theta"), local.get("rope_theta", full.get("rope_theta"))
    if kind != "default" or local_theta != theta:
        raise UserError(
            f"{where}: rope_parameters.sliding_attention of rope_type {kind!r}, rope_theta {local_theta!r}; the "
            f"toolkit's OLMo 3 local layers rotate with the default frequencies of the global base ({theta!r})"
        )
