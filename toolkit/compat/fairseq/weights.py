"""The ``transformer_lm`` family's state dict in fairseq's names, both ways (a pure rename of tensors).

fairseq's decoder keeps q, k and v apart (``self_attn.{q,k,v}_proj``; before 0.9 one
``in_proj_weight``; before 0.10 ``layer_norms.{0,2}``), prefixes every key with ``decoder.``, stores
a tied output projection under both names and keeps a few buffers; ours fuses q/k/v into
``self_attn.qkv_proj`` (rows ``[q | k | v]``). Reading and writing whole fairseq files (options,
optimizer state, the pickle) is ``checkpoint`` / ``export`` beside this module; the
adaptive input/softmax keys are ``toolkit.models.adaptive``'s.
"""

from __future__ import annotations

import collections
import re
from typing import Any, Dict, Optional, Tuple

import torch

from toolkit.core.errors import UserError

_QKV = re.compile(r"(layers\.\d+\.self_attn)\.([qkv])_proj\.(weight|bias)")
_IN_PROJ = re.compile(r"(layers\.\d+\.self_attn)\.in_proj_(weight|bias)")
_OLD_LAYER_NORMS = re.compile(r"(layers\.\d+)\.layer_norms\.([02])\.(weight|bias)")
FAIRSEQ_IGNORED = {"version", "embed_positions._float_tensor", "embed_positions.weights"}


def to_toolkit_weights(
    model_sd: Dict[str, Any], path: str, shared: bool, drop_final_norm: bool = False
) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(our state dict, our name -> the fairseq key it came from) for a fairseq ``model`` dict."""
    out: Dict[str, torch.Tensor] = {}
    source: Dict[str, str] = {}
    qkv: Dict[Tuple[str, str], Dict[str, torch.Tensor]] = collections.defaultdict(dict)
    for key, value in model_sd.items():
        if not key.startswith("decoder."):
            raise UserError(f"{path}: cannot load: weight {key} is not part of a transformer_lm decoder")
        name = key[len("decoder.") :]
        if (
            name in FAIRSEQ_IGNORED
            or (shared and name == "output_projection.weight")
            or (drop_final_norm and name.startswith("layer_norm."))
        ):
            continue
        m = _QKV.fullmatch(name)
        if m:
            qkv[(m[1], m[3])][m[2]] = value
            continue
        if _IN_PROJ.fullmatch(name):
            name = _IN_PROJ.sub(r"\1.qkv_proj.\2", name)  # fairseq < 0.9: already fused, rows [q|k|v]
        m = _OLD_LAYER_NORMS.fullmatch(name)
        if m:
            name = f"{m[1]}.{'self_attn_layer_norm' if m[2] == '0' else 'final_layer_norm'}.{m[3]}"
        if name == "embed_out":
            name = "output_projection.weight"
        out[name], source[name] = value, key
    for (prefix, kind), parts in qkv.items():
        name = f"{prefix}.qkv_proj.{kind}"
        missing = [p for p in "qkv" if p not in parts]
        if missing:
            raise UserError(f"{path}: cannot load: decoder.{prefix}.{missing[0]}_proj.{kind} is missing")
        out[name] = torch.cat([parts["q"], parts["k"], parts["v"]])
        source[name] = f"decoder.{prefix}.q_proj.{kind}"
    return out, source


def to_fairseq_weights(
    weights: Dict[str, torch.Tensor], cfg: Dict[str, Any]
) -> collections.OrderedDict[str, torch.Tensor]:
    """Our state dict in fairseq's names and module order (q/k/v split, ``decoder.`` prefix, version 3)."""
    w, out = dict(weights), collections.OrderedDict()

    def take(name: str, as_name: Optional[str] = None) -> None:
        if name in w:
            out["decoder." + (as_name or name)] = w.pop(name)

    take("embed_tokens.weight")
    take("project_in_dim.weight")
    if "embed_positions.weight" in w:
        take("embed_positions.weight")
    elif not cfg.get("no_token_positional_embeddings"):
        out["decoder.embed_positions._float_tensor"] = torch.zeros(1)  # fairseq <= 0.10 expects this buffer
    take("layernorm_embedding.weight")
    take("layernorm_embedding.bias")
    layer = 0
    while f"layers.{layer}.self_attn.qkv_proj.weight" in w:
        p = f"layers.{layer}."
        split = {kind: dict(zip("qkv", w.pop(f"{p}self_attn.qkv_proj.{kind}").chunk(3))) for kind in ("weight", "bias")}
        for part in "kvq":  # fairseq's MultiheadAttention order
            for kind in ("weight", "bias"):
                out[f"decoder.{p}self_attn.{part}_proj.{kind}"] = split[kind][part].clone()
        for module in ("self_attn.out_proj", "self_attn_layer_norm", "fc1", "fc2", "final_layer_norm"):
            take(f"{p}{module}.weight")
            take(f"{p}{module}.bias")
        layer += 1
    take("layer_norm.weight")
    take("layer_norm.bias")
    take("project_out_dim.weight")
    if "output_projection.weight" in w:
        take("output_projection.weight")
    else:  # tied: fairseq's state dict holds the shared tensor under both names
        out["decoder.output_projection.weight"] = out["decoder.embed_tokens.weight"]
    if w:
        raise UserError(f"--to-fairseq: weight {sorted(w)[0]} has no counterpart in fairseq's transformer_lm")
    out["decoder.version"] = torch.Tensor([3])
    return out
