"""toolkit-interactive: generate from a trained language model, one prompt per input line.

    echo "The tower is" | toolkit-interactive data-bin/wikitext-103 --path checkpoints/checkpoint_best.pt \\
        --sampling --sampling-topk 10 --beam 1
"""
from __future__ import annotations

import sys
from typing import Callable, List, Optional

from toolkit.config import options
from toolkit.core.registry import TASK_REGISTRY
from toolkit_cli.command import one_line_errors

def run(prog: str, command_config: type, main: Callable, argv: Optional[List[str]], description: str) -> None:
    from toolkit.generation import GenerationConfig
    from toolkit.tasks.language_modeling import LanguageModelingConfig

    argv = options.fill_optional_values(list(sys.argv[1:] if argv is None else argv))
    args = options.parse_with_components(prog, [command_config, GenerationConfig], argv,
                                         selectors=(TASK_REGISTRY,), arch=False, description=description)
    task_overrides = {k: v for k, v in options.given_options(LanguageModelingConfig, argv).items() if k != "data"}
    with one_line_errors(prog):
        main(options.config_from_args(command_config, args), options.config_from_args(GenerationConfig, args),
             task_overrides)


def cli_main(argv: Optional[List[str]] = None) -> None:
    from toolkit.inference.generate import InteractiveConfig, interactive_main

    run("toolkit-interactive", InteractiveConfig, interactive_main, argv,
        "Generate from a language model, one prompt per line of stdin (fairseq's S-/W-/H-/D-/P- lines).")


if __name__ == "__main__":
    cli_main(sys.argv[1:])
