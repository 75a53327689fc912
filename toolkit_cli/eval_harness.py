"""toolkit-eval-harness: lm-evaluation-harness tasks on a toolkit checkpoint.

    toolkit-eval-harness data-bin/wikitext-103 --path checkpoints/checkpoint_best.pt \
        --tasks hellaswag,arc_easy --batch-size 16 --output-path results.json

Needs the optional lm-eval package (pip install lm-eval). The work is in
:mod:`toolkit.evaluation.harness_main`.
"""

from __future__ import annotations

from typing import List, Optional

from toolkit.config.commands import EvalHarnessConfig
from toolkit_cli.command import run_command


def main(cfg: EvalHarnessConfig):
    from toolkit.evaluation.harness_main import run  # torch: after parsing (--help and argument errors exit first)

    return run(cfg)


def cli_main(argv: Optional[List[str]] = None) -> None:
    run_command(
        "toolkit-eval-harness",
        EvalHarnessConfig,
        main,
        argv,
        "Evaluate a language model on lm-evaluation-harness tasks (prints the harness's table).",
    )


if __name__ == "__main__":
    cli_main()
