"""``--format peft``: a LoRA run's adapters as Hugging Face PEFT saves them, with the base model they adapt.

The folder is what ``peft.PeftModel.from_pretrained`` reads:

    adapter_config.json         peft_type LORA, r, lora_alpha, lora_dropout, target_modules (the adapted layers'
                                names), base_model_name_or_path (the ``base`` folder below)
    adapter_model.safetensors   base_model.model.<the transformers module>.lora_A.weight [r, in] and
                                .lora_B.weight [out, r] of each adapted layer
    base/                       the base model as ``--format hf`` writes it (config.json, model.safetensors and
                                the tokenizer), without the adapters merged

so ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out + "/base"), out)`` computes what the
run trained. The transformers names come from the family's key map (``DecoderHFAdapter.key_map``); a family whose
Linear layers are not one-to-one with transformers' (GPT-2's fused ``c_attn`` for ``transformer_lm``) is refused.
Before the folder appears, transformers loads ``base/`` (its logits against the base's, fp32) and, where peft is
installed, peft loads the adapters onto it: the same adapted modules and the trained model's logits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from typing import Dict, List, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.export.common import StepProgress, require
from toolkit.export.hf_format import TOLERANCE, _tokenizer, _write_weights, folder_config, unsupported, write_folder
from toolkit.export.target import export_directory

BASE = "base"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _hf_module_names(model, adapted: List[str], model_type: str, hf_state: Dict[str, torch.Tensor]) -> List[str]:
    """The transformers module of each adapted layer, or a one-line refusal where the family renames them
    otherwise than one weight for one weight (a fused or transposed tensor has no PEFT adapter of our shape)."""
    from toolkit.models.common.hf_adapter import DecoderHFAdapter

    adapter_cls = getattr(type(model), "HF_ADAPTER", None)
    if adapter_cls is None or not issubclass(adapter_cls, DecoderHFAdapter):
        raise UserError(
            f"--format peft: {type(model).__name__}'s Linear layers are not one-to-one with its transformers "
            f"class's (GPT-2 fuses q/k/v into c_attn), so its adapters have no PEFT layout; export the merged model "
            f"with --format hf; nothing written"
        )
    keys = adapter_cls().key_map(model_type)
    names = []
    for name in adapted:
        theirs = keys.to_hf(f"{name}.weight")
        ours = model.get_submodule(name).weight
        if theirs not in hf_state or hf_state[theirs].shape != ours.shape:
            raise UserError(
                f"--format peft: {name} is not one transformers weight of the same shape ({theirs}); export the "
                f"merged model with --format hf; nothing written"
            )
        names.append(theirs[: -len(".weight")])
    return names


def exact_targets(hf_names: List[str]) -> str:
    """``target_modules`` in PEFT's regex form, matched against whole module names: exactly these layers."""
    return "|".join(re.escape(name) for name in sorted(hf_names))


def adapter_config(lora, hf_names: List[str], base_path: str) -> Dict:
    """PEFT's ``LoraConfig`` fields for these adapters (``target_modules``: the layers' last names)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in hf_names}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def peft_adapted(folder: str, base_folder: str, tokens: torch.Tensor) -> Tuple[List[str], torch.Tensor]:
    """What peft makes of the folder: the modules it adapts (transformers names) and its logits for ``tokens``."""
    peft = require("peft", "peft")
    transformers = require("transformers", "transformers")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, folder).eval()
    suffix = ".lora_A.default.weight"
    adapted = sorted(n[len(PEFT_PREFIX) : -len(suffix)] for n, _ in model.named_parameters() if n.endswith(suffix))
    with torch.no_grad():
        return adapted, model(tokens, attention_mask=torch.ones_like(tokens)).logits


def _peft_check(folder: str, base_folder: str, tokens: torch.Tensor, want: torch.Tensor, hf_names: List[str]):
    """Whether peft adapts exactly ``hf_names`` (False: ``target_modules`` names others too); where it does, its
    logits are the trained model's (``want``) or a RuntimeError. Returns (exact, progress line)."""
    adapted, logits = peft_adapted(folder, base_folder, tokens)
    if adapted != sorted(hf_names):
        return False, ""
    diff = (logits - want).abs().max().item()
    if not diff <= TOLERANCE:
        raise RuntimeError(f"{folder}: peft's logits differ from the trained model's by {diff:.3g}; nothing written")
    return True, f"peft loads the adapters onto base/; max |logits diff| {diff:.2g}"


def _write_adapters(tmp: str, config: Dict, adapters: Dict[str, Tuple], hf_names: List[str], dtype: str) -> None:
    tensors = {}
    for (_, (a, b)), hf in zip(adapters.items(), hf_names):
        tensors[f"{PEFT_PREFIX}{hf}.lora_A.weight"] = a
        tensors[f"{PEFT_PREFIX}{hf}.lora_B.weight"] = b
    _write_weights(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), dtype)
    with open(os.path.join(tmp, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def _check(tmp: str, adapter_cfg: Dict, named: Tuple, tokens: torch.Tensor, want: torch.Tensor, dtype: str) -> str:
    """peft loads the folder onto ``base/`` with exactly the trained layers adapted and computes ``want``; where
    the layers' last names name others too (a MoE's experts), ``target_modules`` names ours exactly. The
    progress line (without peft: how to install it)."""
    adapters, hf_names = named
    base = os.path.join(tmp, BASE)
    if dtype != "fp32":
        return f"not compared with peft ({dtype} weights; compare an fp32 export)"
    if importlib.util.find_spec("peft") is None:
        return "not loaded with peft, which is not installed (pip install peft)"
    exact, line = _peft_check(tmp, base, tokens, want, hf_names)
    if not exact:
        adapter_cfg["target_modules"] = exact_targets(hf_names)
        _write_adapters(tmp, adapter_cfg, adapters, hf_names, dtype)
        exact, line = _peft_check(tmp, base, tokens, want, hf_names)
    if not exact:
        raise RuntimeError(f"{tmp}: peft adapts other layers than the trained ones; nothing written")
    return line


def export_peft(loaded, out_dir: str, lora, dtype: str = "fp32") -> str:
    """Write ``out_dir`` (module docstring) from a checkpoint loaded with its adapters kept (``LoRALinear``)."""
    from toolkit.core.protocols import HFExportable
    from toolkit.models.lora import detach_adapters

    model = loaded.model
    if not isinstance(model, HFExportable):
        raise unsupported(model, "peft")
    require("transformers", "transformers")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.embed_tokens.num_embeddings, (2, min(12, model.max_positions())), generator=g)
    with torch.no_grad():
        trained_logits = model(tokens)
    adapters = detach_adapters(model)  # the model is the base from here on
    weights = model.hf_weights("auto", loaded.dictionary, loaded.first_symbol, loaded.data_dir)
    hf_names = _hf_module_names(model, list(adapters), weights.config["model_type"], weights.state)
    config = folder_config(weights, dtype)
    base_path = os.path.abspath(os.path.join(out_dir, BASE))
    with StepProgress(5, "peft") as progress, export_directory(out_dir) as tmp:
        os.makedirs(os.path.join(tmp, BASE))
        tokenizer = _tokenizer(loaded, weights.tokenizer_files)
        base = os.path.join(tmp, BASE)
        write_folder(base, model, weights.architecture, config, weights.state, dtype, tokenizer, progress)
        adapter_cfg = adapter_config(lora, hf_names, base_path)
        _write_adapters(tmp, adapter_cfg, adapters, hf_names, dtype)
        line = _check(tmp, adapter_cfg, (adapters, hf_names), tokens, trained_logits, dtype)
        progress.advance(f"{len(adapters)} adapted layers (r {lora.rank}, lora_alpha {lora.alpha:g}); {line}")
    return out_dir
