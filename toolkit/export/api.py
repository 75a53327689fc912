"""``toolkit-export``'s one entry point that dispatches to the format modules (its options, ``ExportConfig``,
are declared torch-free in ``toolkit.config.commands`` for the parser and re-exported here)."""

from __future__ import annotations

import logging
import os
from typing import Optional

from toolkit.config.commands import FORMATS, HF_CLASSES, ExportConfig  # noqa: F401  (torch-free for --help)
from toolkit.core.errors import UserError
from toolkit.export.common import DTYPES, LoadedModel, StepProgress  # noqa: F401  (DTYPES: its old import path)
from toolkit.export.target import check_target

logger = logging.getLogger("toolkit.export")


def _check(cfg: ExportConfig) -> None:
    if cfg.path is None:
        raise UserError("--path is required: the checkpoint to export (or, with --from hf, the folder to import)")
    if cfg.out is None:
        raise UserError("--out is required: the folder to write")
    if cfg.import_from is None and cfg.format is None:
        raise UserError(f"--format is required: one of {', '.join(FORMATS)}")
    if cfg.format == "onnx" and cfg.dtype != "fp32":
        raise UserError(f"--dtype {cfg.dtype}: applies to --format safetensors|hf|peft; the ONNX graphs are fp32")
    if cfg.kv_cache and cfg.format != "onnx":
        raise UserError(f"--kv-cache: applies to --format onnx only (not {cfg.import_from or cfg.format})")
    if cfg.quantize is not None and (cfg.import_from is not None or cfg.format != "hf"):
        given = f"--from {cfg.import_from}" if cfg.import_from is not None else f"--format {cfg.format}"
        raise UserError(f"--quantize {cfg.quantize}: applies to --format hf only (not {given})")
    if os.path.abspath(cfg.out) == os.path.abspath(cfg.path):
        raise UserError(f"--out {cfg.out}: is the input itself; choose another folder")
    check_target(cfg.out, cfg.path, cfg.force)


def load(cfg: ExportConfig) -> LoadedModel:
    from toolkit import inference

    with StepProgress(1, "load") as progress:
        import torch

        keep_adapters = cfg.format == "peft"  # every other format merges a LoRA run's adapters into the weights
        model, task, args = inference.load_model(
            cfg.path, cfg.data, torch.device("cpu"), merge_adapters=not keep_adapters
        )
        loaded = LoadedModel(model.float().eval(), task, args, cfg.path)
        n = sum(p.numel() for p in model.parameters())
        progress.advance(
            f"{cfg.path}: --arch {args.arch}, {n:,} parameters, dictionary of "
            f"{len(task.dictionary)} from {loaded.data_dir}"
        )
    return loaded


def run_export(cfg: ExportConfig) -> str:
    """Export (or import, with ``--from hf``); returns the folder written."""
    _check(cfg)
    if cfg.base is not None and cfg.import_from != "peft":
        raise UserError(f"--base {cfg.base}: applies to --from peft only")
    if cfg.import_from == "hf":
        return import_hf(cfg.path, cfg.out, cfg.tokens_per_sample)
    if cfg.import_from == "peft":
        from toolkit.export.peft_import import import_peft

        return import_peft(cfg.path, cfg.out, cfg.base, cfg.tokens_per_sample)
    loaded = load(cfg)
    if cfg.format == "safetensors":
        from toolkit.export.safetensors_format import export_safetensors

        out = export_safetensors(loaded, cfg.out, cfg.dtype)
    elif cfg.format == "onnx":
        from toolkit.export.onnx_format import export_onnx

        out = export_onnx(loaded, cfg.out, kv_cache=cfg.kv_cache, opset=cfg.opset)
    elif cfg.format == "peft":
        out = export_peft(loaded, cfg.out, cfg.dtype)
    else:
        out = export_hf(loaded, cfg.out, cfg.hf_class, cfg.dtype, cfg.quantize)
    logger.info(f"wrote {out}: {', '.join(sorted(os.listdir(out)))}")
    return out


def import_hf(folder: str, out_dir: str, tokens_per_sample: Optional[int] = None) -> str:
    """``--from hf``: the family that reads the folder's ``model_type`` builds the checkpoint (``hf_family``)."""
    from toolkit.export.hf_family import import_hf as import_through_family

    return import_through_family(folder, out_dir, tokens_per_sample)


def export_hf(loaded: LoadedModel, out: str, hf_class: str, dtype: str, quantize: Optional[str] = None) -> str:
    """``--format hf``: the model's family says which transformers class computes it (``hf_format``)."""
    from toolkit.export.hf_format import export_hf as export_through_family

    return export_through_family(loaded, out, hf_class=hf_class, dtype=dtype, quantize=quantize)


def export_peft(loaded: LoadedModel, out: str, dtype: str) -> str:
    """``--format peft``: a LoRA run's adapters as PEFT saves them, with the base model (``peft_format``)."""
    from toolkit.export.peft_format import export_peft as export_adapters
    from toolkit.models.lora import SavedLoRA

    lora = SavedLoRA.of(vars(loaded.args))
    if not lora.rank:
        raise UserError(
            f"--format peft: {loaded.path} was trained without --lora-rank, so it has no adapters; "
            f"use --format hf; nothing written"
        )
    return export_adapters(loaded, out, lora, dtype)
