"""toolkit-export: a checkpoint as safetensors, ONNX or a Hugging Face transformers folder (and back).

    toolkit-export --path checkpoints/checkpoint_best.pt --format safetensors --out exported/
    toolkit-export --path checkpoints/checkpoint_best.pt --format onnx --kv-cache --out onnx/
    toolkit-export --path checkpoints/checkpoint_best.pt --format hf --out hf/
    toolkit-export --from hf --path gpt2-folder/ --out gpt2-toolkit/
"""
from __future__ import annotations

import sys
from typing import List, Optional

from toolkit.config import options
from toolkit.core.errors import UserError
from toolkit.export.api import ExportConfig, run_export
from toolkit.logging.setup import setup_logging


def cli_main(argv: Optional[List[str]] = None) -> None:
    args = options.parse_with_components("toolkit-export", [ExportConfig], argv, selectors=(), arch=False,
                                         description="Export a checkpoint (or import a transformers GPT-2).")
    cfg = options.config_from_args(ExportConfig, args)
    try:
        setup_logging(cfg.log_file)
        run_export(cfg)
    except UserError as e:
        print(f"toolkit-export: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
