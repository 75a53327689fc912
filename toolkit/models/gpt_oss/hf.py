"""The gpt-oss family's Hugging Face adapter: ``GptOssForCausalLM`` folders in (``toolkit-export --from hf``; bf16 or
fp32 weights, or the release's MXFP4 experts) and out (``--format hf``, the weights in ``--dtype``).

The attention, norms, embeddings, windows (``sliding_window``, ``layer_types``) and YaRN are the shared settings
(``common/hf_config.py``); the attention's biases and sinks are ours under ``model.``; the router is
``mlp.router`` (ours ``mlp.gate``). The experts differ in layout: transformers keeps each layer's experts as
``gate_up_proj`` [E, C, 2F] (gate and up in alternate columns: gate the even ones), ``gate_up_proj_bias`` [E, 2F],
``down_proj`` [E, F, C] and ``down_proj_bias`` [E, C], inputs first; ours are ``gate_proj``, ``up_proj`` [E, F, C],
``down_proj`` [E, C, F] (outputs first, as the MoE family's) and their biases, so the import de-interleaves and
transposes, the export interleaves back.

MXFP4 (a ``quantization_config`` of ``quant_method`` mxfp4, as the release ships): ``gate_up_proj_blocks`` /
``_scales`` and ``down_proj_blocks`` / ``_scales`` (``mxfp4.py``: [E, out, in] per matrix) are dequantized to fp32
as they are read, a matrix once both its tensors arrived; the biases and every other tensor are plain. The export
writes plain weights, or with ``--quantize mxfp4`` the experts' matrices as the release stores them (uint8 blocks and
scales, the release's ``quantization_config``; the model compared with transformers' load holds them as stored).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.core.protocols import HFWeights
from toolkit.models.common import hf_config
from toolkit.models.common.hf_adapter import DECODER_KEYS, DecoderHFAdapter, KeyMap, template_pattern
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.gpt_oss import mxfp4
from toolkit.models.moe.hf import MoEAdapter

KINDS = {"gpt_oss": DecoderClass("GptOssForCausalLM", window_always=True, layer_types=True)}
KEYS = KeyMap(
    rules=(("layers.{layer}.mlp.gate.{part}", "model.layers.{layer}.mlp.router.{part}"),) + DECODER_KEYS.rules,
    dropped=("{prefix}rotary_emb.inv_freq",),
)
THEIRS = template_pattern("model.layers.{layer}.mlp.experts.{name}")
OURS = template_pattern("layers.{layer}.mlp.experts.{name}")
EXPERT = "layers.{layer}.mlp.experts.{name}"
QUANTIZED = ("_blocks", "_scales")
#: the release's ``quantization_config`` (gpt-oss-20b and -120b): the experts in MXFP4, every other tensor plain
RELEASE_QUANTIZATION = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


class GptOssAdapter(MoEAdapter):
    FAMILY, FAMILY_NAME, KINDS = "gpt_oss", "the gpt-oss family", KINDS
    MLP = "gpt-oss's experts are its clamped SwiGLU (silu)"
    HF_KEYS = {
        **hf_config.HF_KEYS,
        "moe_num_experts": "num_local_experts",
        "moe_top_k": "num_experts_per_tok",
        "moe_ffn_embed_dim": "intermediate_size",
        "moe_aux_loss_coef": "router_aux_loss_coef",
        "moe_swiglu_limit": "swiglu_limit",
        "moe_swiglu_alpha": "swiglu_alpha",
    }
    QUANTIZATIONS = ("mxfp4",)
    mxfp4 = False  # the folder read (or written) stores its experts in MXFP4 (its quantization_config)

    def key_map(self, model_type: str) -> KeyMap:
        return KEYS

    def config_keys(self, config: Dict[str, Any]) -> Dict[str, str]:
        return hf_config.rope_keys(self.HF_KEYS, config)

    def complete(self, config: Dict[str, Any]) -> Dict[str, Any]:
        return config

    def options(self, config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
        """The shared attention, shape and rotary options, then the experts'; remembers whether the experts are
        MXFP4 (``state_from_hf`` dequantizes them, ``state_to_hf`` names the folder's tensors)."""
        self.mxfp4 = _is_mxfp4(config.get("quantization_config"), where)
        if config.get("attention_bias", True) is not True:
            raise UserError(
                f"{where}: attention_bias {config['attention_bias']!r}; the toolkit's gpt-oss has biases on q, k, v "
                "and o (attention_bias true, as every gpt-oss checkpoint)"
            )
        out = DecoderHFAdapter.options(self, config, kind, where)
        counts = {k: config.get(k) for k in ("num_local_experts", "num_experts_per_tok")}
        wrong = [f"{k} {v!r}" for k, v in counts.items() if type(v) is not int or v < 1]
        if wrong:
            raise UserError(f"{where}: {', '.join(wrong)}; these are counts (positive integers)")
        out.update(
            attention_qkv_bias=True,
            moe_num_experts=counts["num_local_experts"],
            moe_top_k=counts["num_experts_per_tok"],
            moe_ffn_embed_dim=config["intermediate_size"],
            moe_renormalize=True,
            moe_score_func="softmax",
            moe_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
            moe_swiglu_limit=float(config.get("swiglu_limit", 7.0)),
            moe_swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        )
        return out

    def write(self, model: Any, hf_class: str, dictionary: Any, first_symbol: int, data_dir: str) -> HFWeights:
        """The shared folder; with ``quantize`` mxfp4 the experts' matrices as MXFP4 blocks and scales, and the
        model's own experts rounded to what those hold, so the export's comparison with transformers compares
        the model the folder stores."""
        self.mxfp4 = self.quantize == "mxfp4"
        if self.mxfp4:
            round_experts_to_mxfp4(model)
        return super().write(model, hf_class, dictionary, first_symbol, data_dir)

    def state_from_hf(
        self, tensors: Iterable[Tuple[str, torch.Tensor]], given: Dict[str, Any], model_type: str
    ) -> Dict[str, torch.Tensor]:
        self._halves: Dict[Tuple[str, str], Dict[str, torch.Tensor]] = {}  # an MXFP4 matrix's first tensor read
        return super().state_from_hf(tensors, given, model_type)

    def put_from_hf(
        self, state: Dict[str, torch.Tensor], name: str, tensor: torch.Tensor, given: Dict[str, Any], keys: KeyMap
    ) -> None:
        """An expert tensor into ours (de-interleaved, transposed, dequantized); any other renamed by the key map."""
        m = THEIRS.fullmatch(name)
        if m is None:
            DecoderHFAdapter.put_from_hf(self, state, name, tensor, given, keys)
            return
        layer, theirs = m["layer"], m["name"]
        if theirs.endswith(QUANTIZED):
            matrix, part = theirs[: -len("_blocks")], theirs[-len("blocks") :]
            pending = self._halves.setdefault((layer, matrix), {})
            pending[part] = tensor
            if len(pending) < 2:
                return
            del self._halves[(layer, matrix)]
            tensor, theirs = mxfp4.dequantize(pending["blocks"], pending["scales"]).transpose(1, 2), matrix
        for ours, value in _ours(theirs, tensor.float()).items():
            state[EXPERT.format(layer=layer, name=ours)] = value.contiguous()

    def state_to_hf(self, state: Dict[str, torch.Tensor], model_type: str) -> Dict[str, torch.Tensor]:
        """Their tensors: gate and up interleaved into ``gate_up_proj`` (MXFP4 blocks and scales when the folder
        read has them), the experts' matrices inputs first, the rest renamed by the key map."""
        out: Dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            m = OURS.fullmatch(name)
            if m is None:
                out[KEYS.to_hf(name)] = tensor
                continue
            theirs = "model.layers.{}.mlp.experts.".format(m["layer"])
            ours = m["name"]
            if ours in ("up_proj", "up_proj_bias"):
                continue  # written with its gate
            if ours.startswith("gate_proj"):
                up = state[name.replace("gate_proj", "up_proj")]
                tensor, ours = torch.stack([tensor, up], dim=2).flatten(1, 2), "gate_up_proj" + ours[len("gate_proj") :]
            if tensor.dim() == 3 and self.mxfp4:  # [E, out, in] rows in blocks
                blocks, scales = mxfp4.quantize(tensor)
                out.update({theirs + ours + "_blocks": blocks, theirs + ours + "_scales": scales})
            else:
                out[theirs + ours] = tensor.transpose(1, 2) if tensor.dim() == 3 else tensor
        return out

    def hf_config(self, cfg, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
        """(GptOssForCausalLM, config.json) computing ``cfg``: plain weights (no quantization_config), or the
        experts in MXFP4 (the release's quantization_config) when the export writes them so."""
        config = hf_config.decoder_hf_config(cfg, vocab_size, base, "gpt_oss")
        config.pop("quantization_config", None)
        if self.mxfp4:
            config["quantization_config"] = copy.deepcopy(RELEASE_QUANTIZATION)
        scaling = config.pop("rope_scaling", None)
        rope = {"rope_type": "default"} if scaling is None else scaling
        config.update(
            rope_parameters=dict(rope, rope_theta=cfg.rope_theta),
            attention_bias=True,
            num_local_experts=cfg.moe_num_experts,
            num_experts_per_tok=cfg.moe_top_k,
            intermediate_size=cfg.moe_ffn_embed_dim,
            router_aux_loss_coef=cfg.moe_aux_loss_coef,
            swiglu_limit=cfg.moe_swiglu_limit,
            swiglu_alpha=cfg.moe_swiglu_alpha,
            sliding_window=cfg.sliding_window,
            layer_types=hf_config.layer_type_names(cfg),
        )
        return self.CLASSES["gpt_oss"], config


def _ours(theirs: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Our expert tensors of one of theirs (inputs first, gate and up in alternate columns)."""
    if theirs == "gate_up_proj":
        rows = tensor.transpose(1, 2)  # [E, 2F, C]
        return {"gate_proj": rows[:, 0::2], "up_proj": rows[:, 1::2]}
    if theirs == "gate_up_proj_bias":
        return {"gate_proj_bias": tensor[:, 0::2], "up_proj_bias": tensor[:, 1::2]}
    if theirs == "down_proj":
        return {"down_proj": tensor.transpose(1, 2)}
    return {theirs: tensor}


def _is_mxfp4(quantization: Any, where: str) -> bool:
    """Whether ``quantization_config`` says MXFP4 experts (none: plain weights); another method is refused."""
    if quantization is None:
        return False
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    if method != "mxfp4":
        raise UserError(
            f"{where}: quantization_config quant_method {method!r}; the toolkit reads gpt-oss folders with plain "
            "weights or MXFP4 experts (quant_method mxfp4) only"
        )
    return True


def round_experts_to_mxfp4(model: torch.nn.Module) -> None:
    """Each expert matrix of ``model`` (ours [E, out, in]) replaced by its MXFP4 value, in place: the model an
    MXFP4 folder of it computes (a row's blocks are the same in ours and in the interleaved ``gate_up_proj``)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if OURS.fullmatch(name) and p.dim() == 3:
                p.copy_(mxfp4.dequantize(*mxfp4.quantize(p)).to(p.dtype))
