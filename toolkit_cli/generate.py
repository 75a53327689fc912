"""toolkit-generate: generate from a trained language model, prompts from a data-bin split.

    toolkit-generate data-bin/wikitext-103 --path checkpoints/checkpoint_best.pt --task language_modeling \\
        --sample-break-mode eos --prefix-size 4 --beam 5 --nbest 2
"""

from __future__ import annotations

import sys
from typing import List, Optional

from toolkit_cli.interactive import run


def _generate(*configs):
    from toolkit.inference.results_file import generate_with_results_path  # torch: after parsing

    return generate_with_results_path(*configs)


def cli_main(argv: Optional[List[str]] = None) -> None:
    from toolkit.config.commands import GenerateConfig

    run(
        "toolkit-generate",
        GenerateConfig,
        _generate,
        argv,
        "Generate from a language model with prompts from a data-bin split (fairseq's S-/T-/H-/D-/P- lines).",
    )


if __name__ == "__main__":
    cli_main(sys.argv[1:])
