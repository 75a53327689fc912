"""The multi-token prediction loss of a Hugging Face folder's MTP layer computed with transformers' own modules, as
vLLM's and SGLang's MTP drafters run the released layers (DeepSeek-V3, GLM-4.5, Qwen3-Next): the decoder's normed
output (``last_hidden_state``) and the next token's embedding, each through its norm, joined [embedding; hidden]
by the projection, a copy of one of the decoder's layers holding the MTP layer's block, the norm before the head,
``lm_head``; the cross-entropy of the token two ahead. Transformers drops the MTP tensors on load, so the test reads
them from the folder. Import only after ``pytest.importorskip("transformers")``."""

from __future__ import annotations

import copy
from typing import Dict

import torch
import torch.nn.functional as F


def layer_state(tensors: Dict[str, torch.Tensor], prefix: str, experts: int) -> Dict[str, torch.Tensor]:
    """The tensors under ``prefix`` as a transformers decoder layer's state dict: the experts fused as transformers
    holds them (gate and up stacked per expert, [E, 2F, C]; down [E, C, F])."""
    block = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    if experts and "mlp.experts.0.up_proj.weight" in block:
        gate_up = [
            torch.cat([block.pop(f"mlp.experts.{e}.gate_proj.weight"), block.pop(f"mlp.experts.{e}.up_proj.weight")])
            for e in range(experts)
        ]
        block["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        block["mlp.experts.down_proj"] = torch.stack(
            [block.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(experts)]
        )
    return {
        k: v
        for k, v in block.items()
        if not k.startswith(("embed_tokens.", "shared_head.head.", "enorm", "hnorm", "eh_proj", "shared_head.norm"))
    }


def mtp_loss(hf, like: int, block: Dict[str, torch.Tensor], norms, fc: torch.Tensor, tokens, target, pad: int):
    """The loss of ``target``'s token two ahead at each position of ``tokens`` (``target`` the next tokens), the
    MTP layer's block ``block`` run in a copy of decoder layer ``like`` (its kind), ``norms`` the (embedding,
    hidden, head) norms' weights, ``fc`` the joining projection [C, 2C]; ``pad`` labels ignored."""
    layer = copy.deepcopy(hf.model.layers[like])
    layer.load_state_dict(block)
    embedding, hidden, head = [copy.deepcopy(hf.model.norm) for _ in range(3)]
    for norm, weight in zip((embedding, hidden, head), norms):
        norm.weight.data.copy_(weight)
    T = tokens.size(1)
    with torch.no_grad():
        joined = torch.cat([embedding(hf.model.embed_tokens(target)), hidden(hf.model(tokens).last_hidden_state)], -1)
        joined = F.linear(joined, fc)
        positions = torch.arange(T)[None]
        causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = layer(
            joined,
            position_embeddings=hf.model.rotary_emb(joined, positions),
            attention_mask=causal,
            position_ids=positions,
        )
        logits = hf.lm_head(head(out[0] if isinstance(out, tuple) else out))[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target[:, 1:].reshape(-1), ignore_index=pad)


def our_mtp_loss(model, tokens, target):
    """The model's ``mtp_loss`` in a training forward (the module left in evaluation mode)."""
    model.train()
    try:
        with torch.no_grad():
            return model(tokens, target=target)[1]["aux_losses"]["mtp_loss"][0]
    finally:
        model.eval()


def next_layer_mtp_loss(hf, folder: str, layer: int, like: int, tokens, target, pad: int):
    """``mtp_loss`` of a DeepSeek-V3-style folder's MTP layer ``layer`` (after ``num_hidden_layers``: ``enorm``,
    ``hnorm``, ``eh_proj``, ``shared_head.norm`` beside the block), run in a copy of decoder layer ``like``."""
    from safetensors.torch import load_file

    prefix = f"model.layers.{layer}."
    own = {k[len(prefix) :]: v for k, v in load_file(f"{folder}/model.safetensors").items() if k.startswith(prefix)}
    block = layer_state(own, "", hf.config.n_routed_experts)
    norms = [own[f"{n}.weight"] for n in ("enorm", "hnorm", "shared_head.norm")]
    return mtp_loss(hf, like, block, norms, own["eh_proj.weight"], tokens, target, pad)
