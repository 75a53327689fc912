"""``--format hf``: a transformers folder whose class computes exactly what our model computes.

Which class computes a model, its config and its weights in that class's names are the family's
(:class:`toolkit.core.protocols.HFExportable`: ``toolkit/models/transformer_lm/hf.py``,
``toolkit/models/common/hf_folder.py``). Here: the folder (config.json, model.safetensors, the
tokenizer), written under a temporary name, and before it appears transformers loads it and its
logits are compared with ours (fp32). A family without adapters is refused in one line naming the
formats it can use.

Ids are the dictionary's: <s>=0, <pad>=1, </s>=2, <unk>=3. ``bos_token_id`` is the symbol our
LMs see before a sentence's first token (</s>, or <s> with ``--add-bos-token``), as in fairseq.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Callable, Dict, Optional

import torch

from toolkit.core.errors import UserError
from toolkit.core.protocols import HFExportable, OnnxCacheExportable
from toolkit.export.common import DTYPES, StepProgress, require
from toolkit.export.target import export_directory

logger = logging.getLogger(__name__)

TOLERANCE = 1e-4


def _write_weights(state: Dict[str, torch.Tensor], path: str, dtype: str) -> None:
    save_file = require("safetensors.torch", "safetensors").save_file
    # Each tensor on its own storage: split and transposed views of one tensor share it. Integer tensors (a
    # quantized storage's codes and scales) are written as they are; floating ones in the dtype asked.
    tensors = {k: _in_dtype(v.detach(), dtype).contiguous().clone() for k, v in state.items()}
    save_file(tensors, path, metadata={"format": "pt"})


def _in_dtype(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    return tensor.to(DTYPES[dtype]) if tensor.is_floating_point() else tensor


def verify(folder: str, model: torch.nn.Module) -> float:
    """Load the folder with transformers and compare logits with ours on a random batch (fp32). A
    quantized folder (its config's ``quantization_config``) loads dequantized: this check runs on the CPU."""
    transformers = require("transformers", "transformers")
    options = {}
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        quantization = json.load(f).get("quantization_config")
    if quantization is not None:
        auto = require("transformers.quantizers.auto", "transformers").AutoQuantizationConfig
        options["quantization_config"] = auto.from_dict({**quantization, "dequantize": True})
    hf_logging = transformers.utils.logging
    hf_logging.disable_progress_bar()  # its per-tensor "Loading weights" bar, inside our own progress
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **options).eval()
    finally:
        hf_logging.enable_progress_bar()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.embed_tokens.num_embeddings, (2, min(12, model.max_positions())), generator=g)
    with torch.no_grad():  # an all-ones mask: the same computation as none, without HF's padding warning
        diff = (hf(tokens, attention_mask=torch.ones_like(tokens)).logits - model(tokens)).abs().max().item()
    if not diff <= TOLERANCE:
        raise RuntimeError(f"{folder}: transformers logits differ from ours by {diff:.3g}; nothing written")
    return diff


def write_folder(
    tmp: str,
    model,
    architecture: str,
    config: dict,
    state: Dict[str, torch.Tensor],
    dtype: str,
    tokenizer: Callable[[str], str],
    progress,
) -> None:
    """Weights, config.json and the tokenizer into ``tmp`` (one progress step each), then the transformers check."""
    progress.advance(f"{architecture}: {len(state)} tensors")
    _write_weights(state, os.path.join(tmp, "model.safetensors"), dtype)
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    quantized = config.get("quantization_config")
    stored = dtype if quantized is None else f"{dtype}; {quantized['quant_method']} where the release quantizes"
    progress.advance(f"wrote config.json and model.safetensors ({stored})")
    progress.advance(tokenizer(tmp))
    if dtype == "fp32":
        progress.advance(f"transformers {architecture} loads it; max |logits diff| {verify(tmp, model):.2g}")
    else:
        progress.advance(f"not compared with transformers ({dtype} weights; compare an fp32 export)")


def _tokenizer(loaded, files: Dict[str, str]):
    """Write the tokenizer into a folder: the model's own ``files`` ({name: path}) as they are, else one built
    from ``dict.txt`` and the BPE (``hf_tokenizer``); returns the progress line. A ``dict.txt`` that is a
    tokenizer's vocabulary without that tokenizer is refused: a tokenizer built from it would give other ids."""
    from toolkit.export.hf_tokenizer import write_tokenizer, write_tokenizer_config

    def write(folder: str) -> str:
        if not files:
            if loaded.dictionary.fixed_ids:
                raise UserError(
                    f"{os.path.join(loaded.data_dir, 'dict.txt')}: the vocabulary of a tokenizer "
                    f"(toolkit-export --from hf), but neither tokenizer.json nor hf_byte_bpe.json is "
                    f"beside it; give --data the import's folder (or a data-bin binarized with its "
                    f"tokenizer); nothing written"
                )
            return write_tokenizer(loaded, folder)
        for name, path in files.items():
            shutil.copyfile(path, os.path.join(folder, name))
        line = f"tokenizer: the model's own ({', '.join(files)} from {os.path.dirname(next(iter(files.values())))})"
        if "tokenizer_config.json" not in files:  # else AutoTokenizer would pick the class by model_type
            write_tokenizer_config(loaded, folder, loaded.dictionary.bos())
            line += "; tokenizer_config.json written for it"
        return line

    return write


def unsupported(model, fmt: str) -> UserError:
    """One line for a family without the adapters ``--format fmt`` needs, naming the formats it has."""
    formats = ["safetensors", "onnx (--kv-cache too)" if isinstance(model, OnnxCacheExportable) else "onnx"]
    if isinstance(model, HFExportable):
        formats.append("hf")
    return UserError(
        f"--format {fmt}: {type(model).__name__} ({type(model).__module__}) provides no Hugging Face "
        f"adapters (hf_weights, see toolkit.core.protocols.HFExportable); it exports as "
        f"{', '.join(formats)}; nothing written"
    )


def check_quantization(model, quantize: str) -> None:
    """One line for ``--quantize`` of a family whose release is not stored so, naming the families that write it."""
    if quantize in getattr(model, "HF_QUANTIZATIONS", ()):
        return
    from toolkit.core import registry

    registry.import_all_components()
    families = [
        name
        for name, entry in sorted(registry.MODEL_REGISTRY.entries.items())
        if quantize in getattr(entry.cls, "HF_QUANTIZATIONS", ())
    ]
    raise UserError(
        f"--quantize {quantize}: written for {' and '.join(families) or 'no'} models (their releases' storage), "
        f"not {type(model).__name__}; export without --quantize (every weight in --dtype); nothing written"
    )


def folder_config(weights, dtype: str) -> dict:
    """``config.json`` of the folder: the family's values, the class and the weights' dtype."""
    names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    return {**weights.config, "architectures": [weights.architecture], "dtype": names[dtype]}


def export_hf(loaded, out_dir: str, hf_class: str = "auto", dtype: str = "fp32", quantize: Optional[str] = None) -> str:
    """Write config.json, model.safetensors and the tokenizer (the model's own, or one mapped from the BPE); with
    ``quantize`` the tensors the family's release quantizes stored as it stores them (the others in ``dtype``)."""
    model = loaded.model
    if not isinstance(model, HFExportable):
        raise unsupported(model, "hf")
    quantizing = {}
    if quantize is not None:
        check_quantization(model, quantize)
        quantizing["quantize"] = quantize
    require("transformers", "transformers")
    weights = model.hf_weights(hf_class, loaded.dictionary, loaded.first_symbol, loaded.data_dir, **quantizing)
    config = folder_config(weights, dtype)
    with StepProgress(4, "hf") as progress, export_directory(out_dir) as tmp:
        write_folder(
            tmp,
            model,
            weights.architecture,
            config,
            weights.state,
            dtype,
            _tokenizer(loaded, weights.tokenizer_files),
            progress,
        )
    return out_dir
