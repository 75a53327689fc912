"""toolkit-validate: a checkpoint's loss and perplexity on validation splits (fairseq-validate).

    toolkit-validate data-bin/wikitext-103 --path checkpoints/checkpoint_best.pt --valid-subset valid,test

Prints the ``valid`` line the training run prints for the same checkpoint; the work is in
:mod:`toolkit.train.validate`.
"""

from __future__ import annotations

from typing import List, Optional

from toolkit.config.commands import ValidateConfig
from toolkit_cli.command import run_command


def main(cfg: ValidateConfig):
    from toolkit.train.validate import main  # torch: after parsing (--help and argument errors exit first)

    return main(cfg)


def cli_main(argv: Optional[List[str]] = None) -> None:
    run_command(
        "toolkit-validate",
        ValidateConfig,
        main,
        argv,
        "Validate a checkpoint: loss and perplexity on --valid-subset, batched as the trainer does.",
    )


if __name__ == "__main__":
    cli_main()
