"""toolkit-interactive: generate from a trained language model, one prompt per input line.

    echo "The tower is" | toolkit-interactive data-bin/wikitext-103 --path checkpoints/checkpoint_best.pt \\
        --sampling --sampling-topk 10 --beam 1
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional, Tuple

from toolkit.config import options
from toolkit.core.registry import TASK_REGISTRY
from toolkit_cli.command import run_command


def _task_overrides(argv: List[str]) -> Tuple[Dict]:
    """The task options given on the command line (they replace the checkpoint's; the data folder is positional)."""
    from toolkit.config.components import LanguageModelingConfig

    return ({k: v for k, v in options.given_options(LanguageModelingConfig, argv).items() if k != "data"},)


def run(prog: str, command_config: type, main: Callable, argv: Optional[List[str]], description: str) -> None:
    """toolkit-interactive and toolkit-generate: ``main(command config, GenerationConfig, task overrides)``."""
    from toolkit.config.commands import GenerationConfig

    run_command(
        prog,
        command_config,
        main,
        argv,
        description,
        selectors=(TASK_REGISTRY,),
        sections=(GenerationConfig,),
        from_argv=_task_overrides,
    )


def _interactive(*configs):
    from toolkit.inference.generate import interactive_main  # torch: after parsing

    return interactive_main(*configs)


def cli_main(argv: Optional[List[str]] = None) -> None:
    from toolkit.config.commands import InteractiveConfig

    run(
        "toolkit-interactive",
        InteractiveConfig,
        _interactive,
        argv,
        "Generate from a language model, one prompt per line of stdin (fairseq's S-/W-/H-/D-/P- lines).",
    )


if __name__ == "__main__":
    cli_main(sys.argv[1:])
