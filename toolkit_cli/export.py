"""toolkit-export: a checkpoint as safetensors, ONNX or a Hugging Face transformers folder (and back).

    toolkit-export --path checkpoints/checkpoint_best.pt --format safetensors --out exported/
    toolkit-export --path checkpoints/checkpoint_best.pt --format onnx --kv-cache --out onnx/
    toolkit-export --path checkpoints/checkpoint_best.pt --format hf --out hf/
    toolkit-export --path checkpoints/checkpoint_best.pt --format peft --out adapter/   (a --lora-rank run)
    toolkit-export --from hf --path gpt2-folder/ --out gpt2-toolkit/
    toolkit-export --from peft --path adapter/ --base llama-folder/ --out llama-lora/   (continue a PEFT LoRA)

The work is in :mod:`toolkit.export.api`.
"""

from __future__ import annotations

from typing import List, Optional

from toolkit.config.commands import ExportConfig
from toolkit_cli.command import run_command


def _logged_export(cfg: ExportConfig) -> str:
    # torch: after parsing (--help and argument errors exit first)
    from toolkit.export.api import run_export
    from toolkit.logging.setup import setup_logging

    setup_logging(cfg.log_file)
    return run_export(cfg)


def cli_main(argv: Optional[List[str]] = None) -> None:
    run_command(
        "toolkit-export",
        ExportConfig,
        _logged_export,
        argv,
        "Export a checkpoint (or, with --from hf, import a transformers folder: GPT-2, Llama, Mistral, Qwen2/3, "
        "OLMo 2, Gemma 3, and the mixtures of experts Qwen3-MoE, OLMoE, Mixtral).",
    )


if __name__ == "__main__":
    cli_main()
