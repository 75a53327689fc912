"""The DeepSeek-V3 family's Hugging Face adapter: ``DeepseekV3ForCausalLM`` folders (DeepSeek-V3, Moonlight, Kimi
K2 as transformers reads them) in (``toolkit-export --from hf``) and out (``--format hf``).

The tensors are ours under ``model.`` (``KEYS``: the shared decoder's map, the router's correction bias named
``e_score_correction_bias``), the experts one matrix per expert stacked into ours as the MoE family's adapter
does. One tensor layout differs: DeepSeek's checkpoints store each rotary part as interleaved pairs (``rope_interleave``
true, transformers' default for the class), ours as two halves (``rope.apply_rope``), so the rotary rows of the
query projection (``q_proj`` / ``q_b_proj``, per head) and of ``kv_a_proj_with_mqa`` are reordered on the way in
(pairs (0, 1), (2, 3) ... to evens then odds) and back on the way out: the same products, the same logits.
Multi-token prediction layers (``num_nextn_predict_layers`` of them after the ``num_hidden_layers``, which transformers
skips) are our ``--mtp-depth`` depths (``common/mtp.py``) when the folder holds their tensors: ``enorm``, ``hnorm``,
``eh_proj`` and ``shared_head.norm`` are the depth's own (``mtp.{k}.enorm`` ... ``mtp.{k}.norm``), the decoder layer's
tensors its block's (``mtp.{k}.layer.``, experts stacked and rotary rows reordered as the other layers'), and the
copies of the embedding and the output head the layer stores (``embed_tokens``, ``shared_head.head``) are dropped:
the depths use the model's own. Export writes the copies back. A folder whose config.json names such layers but
holds no tensor of them (transformers' ``save_pretrained`` writes none) is imported without them, saying so in one
line.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Dict, Optional, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.models.common import hf_config
from toolkit.models.common.hf_folder import tensor_names
from toolkit.models.common.hf_adapter import DECODER_KEYS, KeyMap, template_pattern
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.common.options import head_dim
from toolkit.models.moe.hf import OURS, MoEAdapter

logger = logging.getLogger(__name__)
KINDS = {"deepseek_v3": DecoderClass("DeepseekV3ForCausalLM", no_attention_bias=True)}
KEYS = KeyMap(
    rules=(("layers.{layer}.mlp.gate.expert_bias", "model.layers.{layer}.mlp.gate.e_score_correction_bias"),)
    + DECODER_KEYS.rules,
    dropped=("{prefix}rotary_emb.inv_freq",),
)
EXPERT = "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
QUERY_ROWS = re.compile(r"layers\.\d+\.self_attn\.q_b?_proj\.weight")  # [H (Dn + Dr), in]: per head, rotary last
LATENT_ROWS = re.compile(r"layers\.\d+\.self_attn\.kv_a_proj_with_mqa\.weight")  # [r + Dr, C]: rotary last
LAYER = re.compile(r"model\.layers\.(\d+)\.")
OUR_LAYER = re.compile(r"layers\.(\d+)\.")
MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight"}
MTP_OWN["shared_head.norm.weight"] = "norm.weight"  # the depth's norm before the shared head
MTP_DEPTH = re.compile(r"mtp\.(\d+)\.")


class NextLayersAdapter:
    """The multi-token prediction layers of a DeepSeek-V3-style folder (DeepSeek-V3, GLM-4.5: the
    ``num_nextn_predict_layers`` layers after the ``num_hidden_layers``) as the model's depths, in and out (a mixin
    before the family's adapter base; see the module docstring). The family's options take ``mtp_options``; its own
    conversion of the decoder's tensors to theirs is ``layers_to_hf``."""

    main_layers = 0  # num_hidden_layers: the multi-token prediction layers come after them
    mtp_held = 0  # the multi-token prediction layers whose tensors the folder read holds

    def read(self, folder: str, config: Dict[str, Any], out_dir: str, tokens_per_sample: Optional[int], advance):
        """The shared import; first, which multi-token prediction layers the folder holds (one line when config.json
        names some that it does not hold)."""
        named, layers = int(config.get("num_nextn_predict_layers") or 0), int(config.get("num_hidden_layers") or 0)
        held = {int(m.group(1)) for m in map(LAYER.match, tensor_names(folder)) if m is not None}
        self.mtp_held = sum(1 for k in range(named) if layers + k in held)
        if named and not self.mtp_held:
            logger.warning(
                f"{folder}: config.json's num_nextn_predict_layers {named}, but the folder holds no tensor of them "
                "(transformers saves none): imported without multi-token prediction (--mtp-depth 0)"
            )
        return super().read(folder, config, out_dir, tokens_per_sample, advance)

    def mtp_options(self, config: Dict[str, Any]) -> Dict[str, Any]:
        """``--mtp-depth``: the layers the folder holds."""
        self.main_layers = config["num_hidden_layers"]
        return {"mtp_depth": self.mtp_held}

    def put_from_hf(
        self, state: Dict[str, torch.Tensor], name: str, tensor: torch.Tensor, given: Dict[str, Any], keys: KeyMap
    ) -> None:
        """Of a multi-token prediction layer, the depth's own tensors under ``mtp.{k}.``, its block's under their
        layer index (``state_from_hf`` moves them), the copies of the embedding and the head dropped, as are the
        layers past ``--mtp-depth``; any other tensor as the family's base puts it."""
        layer = LAYER.match(name)
        depth = -1 if layer is None else int(layer.group(1)) - given["decoder_layers"]
        if depth >= given["mtp_depth"]:
            return
        if depth >= 0:
            rest = name[layer.end() :]
            if rest in MTP_OWN:
                state[f"mtp.{depth}.{MTP_OWN[rest]}"] = tensor.float()
            if rest in MTP_OWN or rest in ("embed_tokens.weight", "shared_head.head.weight"):
                return
        super().put_from_hf(state, name, tensor, given, keys)

    def state_from_hf(self, tensors, given: Dict[str, Any], model_type: str) -> Dict[str, torch.Tensor]:
        """The shared conversion; the multi-token prediction layers' block tensors moved under ``mtp.{k}.layer.``."""
        return depth_blocks(super().state_from_hf(tensors, given, model_type), given["decoder_layers"])

    def write(self, model: Any, hf_class: str, dictionary: Any, first_symbol: int, data_dir: str):
        self.main_layers = model.cfg.decoder_layers
        return super().write(model, hf_class, dictionary, first_symbol, data_dir)

    def state_to_hf(self, state: Dict[str, torch.Tensor], model_type: str) -> Dict[str, torch.Tensor]:
        """``layers_to_hf`` of the decoder's tensors and of the depths' blocks as the layers after the decoder's;
        each depth's own tensors and its copies of the embedding and the head under that layer's names."""
        ours, theirs = _mtp_as_layers(state, self.main_layers)
        return {**self.layers_to_hf(ours, model_type), **theirs}

    def layers_to_hf(self, state: Dict[str, torch.Tensor], model_type: str) -> Dict[str, torch.Tensor]:
        """Their tensors of a state without depths: the family's base conversion."""
        return super().state_to_hf(state, model_type)


def depth_blocks(state: Dict[str, torch.Tensor], layers: int) -> Dict[str, torch.Tensor]:
    """``state`` with the tensors of layers ``layers + k`` moved under ``mtp.{k}.layer.`` (the depths' blocks)."""
    for name in [n for n in state if (m := OUR_LAYER.match(n)) and int(m.group(1)) >= layers]:
        m = OUR_LAYER.match(name)
        state[f"mtp.{int(m.group(1)) - layers}.layer.{name[m.end() :]}"] = state.pop(name)
    return state


class DeepSeekV3Adapter(NextLayersAdapter, MoEAdapter):
    FAMILY, FAMILY_NAME = "deepseek_v3", "the DeepSeek-V3 family"
    MLP, KINDS = "the DeepSeek-V3 family's MLP and experts are SwiGLU (silu)", KINDS
    interleaved = True  # the folder read stores its rotary rows as interleaved pairs (its rope_interleave)

    def key_map(self, model_type: str) -> KeyMap:
        return KEYS

    def complete(self, config: Dict[str, Any]) -> Dict[str, Any]:
        return config

    def options(self, config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
        """The shared sizes and rotary settings, then latent attention's, the router's and the dense layers'.
        Remembers whether the folder's rotary rows are interleaved (``state_from_hf`` reorders them) and the widths
        that say which rows are rotary (``state_to_hf`` names the folder's tensors from them)."""
        self.interleaved = bool(config.get("rope_interleave", True))
        out = {
            **hf_config.shape_options(config, KINDS[kind]),
            **hf_config.rope_options(config, where),
            **_latent(config, where),
            **_router(config, where),
        }
        scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
        out["rope_mscale_all_dim"] = float(scaling.get("mscale_all_dim") or 0.0) if out["rope_scaling_factor"] else 0.0
        out["decoder_kv_heads"] = config["num_attention_heads"]
        out.update(self.mtp_options(config))
        self.dims = _dims({**config, **out, "decoder_embed_dim": config["hidden_size"]})
        return out

    def put_from_hf(
        self, state: Dict[str, torch.Tensor], name: str, tensor: torch.Tensor, given: Dict[str, Any], keys: KeyMap
    ) -> None:
        """As the multi-token prediction layers' and the MoE family's (experts stacked), the rotary rows in halves."""
        super().put_from_hf(state, name, tensor, given, keys)
        ours = keys.from_hf(name)
        if ours in state and self.interleaved:
            state[ours] = rotary_rows(ours, state[ours], _dims(given), to_halves=True)

    def write(self, model: Any, hf_class: str, dictionary: Any, first_symbol: int, data_dir: str):
        self.dims = _dims(vars(model.cfg))
        return super().write(model, hf_class, dictionary, first_symbol, data_dir)

    def layers_to_hf(self, state: Dict[str, torch.Tensor], model_type: str) -> Dict[str, torch.Tensor]:
        """Their tensors: the stacked experts cut into per-expert matrices, the rotary rows interleaved, the rest
        renamed by the key map."""
        stacked = template_pattern(OURS)
        out: Dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            m = stacked.fullmatch(name)
            if m is None:
                out[KEYS.to_hf(name)] = rotary_rows(name, tensor, self.dims, to_halves=False)
                continue
            for e in range(tensor.size(0)):
                out[EXPERT.format(layer=m["layer"], expert=e, proj=m["proj"])] = tensor[e]
        return out

    def hf_config(self, cfg, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
        """(DeepseekV3ForCausalLM, config.json) computing ``cfg``, or a one-line refusal."""
        _refuse_other(cfg)
        config = hf_config.decoder_hf_config(cfg, vocab_size, base, "deepseek_v3")
        scaling = config.pop("rope_scaling", None)
        rope = {"rope_type": "default"} if scaling is None else dict(scaling, mscale_all_dim=cfg.rope_mscale_all_dim)
        config.update(
            rope_parameters=dict(rope, rope_theta=cfg.rope_theta),
            num_key_value_heads=cfg.decoder_attention_heads,
            attention_bias=False,
            rope_interleave=True,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_rope_head_dim=head_dim(cfg),
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            v_head_dim=cfg.v_head_dim,
            **router_hf_config(cfg),
            num_nextn_predict_layers=cfg.mtp_depth,
        )
        config.pop("qk_head_dim", None)
        return self.CLASSES["deepseek_v3"], config


def _mtp_as_layers(state: Dict[str, torch.Tensor], layers: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(``state`` with depth k's block tensors as layer ``layers + k``'s, our names; the depths' own tensors and
    their copies of the embedding and the head, Hugging Face's names ``model.layers.{layers + k}.``)."""
    ours: Dict[str, Any] = {}
    theirs: Dict[str, Any] = {}
    head = state.get("output_projection.weight", state["embed_tokens.weight"])
    for name, tensor in state.items():
        m = MTP_DEPTH.match(name)
        if m is None:
            ours[name] = tensor
            continue
        layer, rest = layers + int(m.group(1)), name[m.end() :]
        if rest.startswith("layer."):
            ours[f"layers.{layer}.{rest[len('layer.') :]}"] = tensor
            continue
        theirs[f"model.layers.{layer}.{next(k for k, v in MTP_OWN.items() if v == rest)}"] = tensor
        if rest == "eh_proj.weight":
            theirs[f"model.layers.{layer}.embed_tokens.weight"] = state["embed_tokens.weight"]
            theirs[f"model.layers.{layer}.shared_head.head.weight"] = head
    return ours, theirs


def _dims(options: Dict[str, Any]) -> Tuple[int, int, int]:
    """(unrotated, rotary features of a query head, latent rank) of a model's options."""
    rope = options.get("decoder_head_dim") or options["decoder_embed_dim"] // options["decoder_attention_heads"]
    return options["qk_nope_head_dim"], rope, options["kv_lora_rank"]


def rotary_rows(name: str, tensor: torch.Tensor, dims: Tuple[int, int, int], to_halves: bool) -> torch.Tensor:
    """``tensor`` (our name ``name``) with the rotary rows of a query head or of the latent's key part reordered:
    interleaved pairs to halves (``to_halves``) or back; any other tensor as it is."""
    nope, rope, rank = dims
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if not to_halves:
        order = torch.argsort(order)
    if QUERY_ROWS.fullmatch(name):
        heads = tensor.view(-1, nope + rope, tensor.size(-1))
        return torch.cat([heads[:, :nope], heads[:, nope:][:, order]], dim=1).view_as(tensor)
    if LATENT_ROWS.fullmatch(name):
        return torch.cat([tensor[:rank], tensor[rank:][order]])
    return tensor


def _latent(config: Dict[str, Any], where: str) -> Dict[str, Any]:
    names = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    wrong = [f"{k} {config.get(k)!r}" for k in names if type(config.get(k)) is not int or config[k] < 1]
    q_rank = config.get("q_lora_rank")
    if q_rank is not None and (type(q_rank) is not int or q_rank < 1):
        wrong.append(f"q_lora_rank {q_rank!r}")
    if wrong:
        raise UserError(f"{where}: {', '.join(wrong)}; give the config.json transformers saved with the model")
    return dict(
        q_lora_rank=q_rank,
        kv_lora_rank=config["kv_lora_rank"],
        decoder_head_dim=config["qk_rope_head_dim"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        v_head_dim=config["v_head_dim"],
        qk_norm=False,
        sliding_window=None,
        layer_types=None,
    )


def _router(config: Dict[str, Any], where: str) -> Dict[str, Any]:
    counts = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
    wrong = [f"{k} {config.get(k)!r}" for k in counts if type(config.get(k)) is not int or config[k] < 1]
    if wrong:
        raise UserError(f"{where}: {', '.join(wrong)}; these are counts (positive integers)")
    width = config["moe_intermediate_size"]
    return dict(
        moe_num_experts=config["n_routed_experts"],
        moe_top_k=config["num_experts_per_tok"],
        moe_ffn_embed_dim=width,
        moe_shared_ffn_embed_dim=width * int(config.get("n_shared_experts") or 0),
        moe_score_func="sigmoid",
        moe_renormalize=bool(config.get("norm_topk_prob", True)),
        moe_n_group=int(config.get("n_group") or 1),
        moe_topk_group=int(config.get("topk_group") or 1),
        moe_routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
        moe_aux_loss_coef=0.0,
    )


def router_hf_config(cfg) -> Dict[str, Any]:
    """config.json's DeepSeekMoE router and dense-layer keys computing ``cfg``: the inverse of ``_router``, shared by
    the families whose checkpoints carry DeepSeek-V3's router (GLM-4.5)."""
    return dict(
        n_routed_experts=cfg.moe_num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        moe_intermediate_size=cfg.moe_ffn_embed_dim,
        n_shared_experts=cfg.moe_shared_ffn_embed_dim // cfg.moe_ffn_embed_dim,
        n_group=cfg.moe_n_group,
        topk_group=cfg.moe_topk_group,
        routed_scaling_factor=cfg.moe_routed_scaling_factor,
        norm_topk_prob=cfg.moe_renormalize,
        first_k_dense_replace=cfg.first_k_dense_replace,
    )


def _refuse_other(cfg) -> None:
    if (
        cfg.moe_score_func != "sigmoid"
        or cfg.mlp_activation != "silu"
        or cfg.moe_shared_ffn_embed_dim % cfg.moe_ffn_embed_dim
        or cfg.sliding_window is not None
        or cfg.layer_types is not None
    ):
        raise UserError(
            "--format hf: DeepseekV3ForCausalLM routes by sigmoid scores, has SwiGLU experts, shared experts a "
            "whole number of experts wide and no window; this model differs, nothing written"
        )
