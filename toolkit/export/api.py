"""``toolkit-export``'s options and the one entry point that dispatches to the format modules."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from toolkit.config import opt
from toolkit.core.errors import UserError
from toolkit.export.common import DTYPES, LoadedModel, StepProgress
from toolkit.export.target import check_target

logger = logging.getLogger("toolkit.export")

FORMATS = ("safetensors", "onnx", "hf")
HF_CLASSES = ("auto", "xglm", "opt", "gpt2")


@dataclass
class ExportConfig:
    path: Optional[str] = opt(None, "checkpoint to export (with --from hf: the transformers folder to import)")
    format: Optional[str] = opt(None, "what to write: safetensors (weights + config, no pickle), onnx "
                                      "(decoder graphs) or hf (a transformers folder)", choices=list(FORMATS))
    out: Optional[str] = opt(None, "output folder, new or empty (written atomically: complete or absent)")
    force: bool = opt(False, "replace --out when it holds an earlier export (its toolkit_export.json lists "
                             "every file there); never any other folder")
    data: Optional[str] = opt(None, "data-bin with dict.txt and the BPE model (default: the one the "
                                    "checkpoint was trained on)")
    dtype: str = opt("fp32", "weight dtype of --format safetensors|hf", choices=list(DTYPES))
    kv_cache: bool = opt(False, "--format onnx: also write decoder_with_past.onnx, which takes and "
                                "returns per-layer keys/values [B, H, P, D] for incremental decoding")
    opset: int = opt(18, "--format onnx: ONNX opset (17 or later)")
    hf_class: str = opt("auto", "--format hf: transformers class to write (auto: XGLM for sinusoidal "
                                "positions, OPT for learned ones)", choices=list(HF_CLASSES))
    import_from: Optional[str] = opt(None, "import instead of export: build a toolkit checkpoint folder "
                                           "from a transformers folder (--path): GPT2LMHeadModel, "
                                           "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                                           "Qwen3ForCausalLM, Olmo2ForCausalLM or Gemma3ForCausalLM",
                                     choices=["hf"], aliases=("--from",))
    tokens_per_sample: Optional[int] = opt(None, "--from hf: tokens per sample recorded in the checkpoint "
                                                 "(default: GPT-2's n_positions; the Llama family's "
                                                 "max_position_embeddings, at most 2048)")
    log_file: Optional[str] = opt(None, "also write the log to this file")


def _check(cfg: ExportConfig) -> None:
    if cfg.path is None:
        raise UserError("--path is required: the checkpoint to export (or, with --from hf, the folder to import)")
    if cfg.out is None:
        raise UserError("--out is required: the folder to write")
    if cfg.import_from is None and cfg.format is None:
        raise UserError(f"--format is required: one of {', '.join(FORMATS)}")
    if cfg.format == "onnx" and cfg.dtype != "fp32":
        raise UserError(f"--dtype {cfg.dtype}: applies to --format safetensors|hf; the ONNX graphs are fp32")
    if cfg.kv_cache and cfg.format != "onnx":
        raise UserError(f"--kv-cache: applies to --format onnx only (not {cfg.import_from or cfg.format})")
    if os.path.abspath(cfg.out) == os.path.abspath(cfg.path):
        raise UserError(f"--out {cfg.out}: is the input itself; choose another folder")
    check_target(cfg.out, cfg.path, cfg.force)


def load(cfg: ExportConfig) -> LoadedModel:
    from toolkit import inference

    with StepProgress(1, "load") as progress:
        import torch

        model, task, args = inference.load_model(cfg.path, cfg.data, torch.device("cpu"))
        loaded = LoadedModel(model.float().eval(), task, args, cfg.path)
        n = sum(p.numel() for p in model.parameters())
        progress.advance(f"{cfg.path}: --arch {args.arch}, {n:,} parameters, dictionary of "
                         f"{len(task.dictionary)} from {loaded.data_dir}")
    return loaded


def run_export(cfg: ExportConfig) -> str:
    """Export (or import, with ``--from hf``); returns the folder written."""
    _check(cfg)
    if cfg.import_from == "hf":
        return import_hf(cfg.path, cfg.out, cfg.tokens_per_sample)
    loaded = load(cfg)
    if cfg.format == "safetensors":
        from toolkit.export.safetensors_format import export_safetensors

        out = export_safetensors(loaded, cfg.out, cfg.dtype)
    elif cfg.format == "onnx":
        from toolkit.export.onnx_format import export_onnx

        out = export_onnx(loaded, cfg.out, kv_cache=cfg.kv_cache, opset=cfg.opset)
    else:
        out = export_hf(loaded, cfg.out, cfg.hf_class, cfg.dtype)
    logger.info(f"wrote {out}: {', '.join(sorted(os.listdir(out)))}")
    return out


def import_hf(folder: str, out_dir: str, tokens_per_sample: Optional[int] = None) -> str:
    """``--from hf``: the family that reads the folder's ``model_type`` builds the checkpoint (``hf_family``)."""
    from toolkit.export.hf_family import import_hf as import_through_family

    return import_through_family(folder, out_dir, tokens_per_sample)


def export_hf(loaded: LoadedModel, out: str, hf_class: str, dtype: str) -> str:
    """``--format hf``: the model's family says which transformers class computes it (``hf_format``)."""
    from toolkit.export.hf_format import export_hf as export_through_family

    return export_through_family(loaded, out, hf_class=hf_class, dtype=dtype)
