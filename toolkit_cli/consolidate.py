"""toolkit-consolidate: turn a sharded checkpoint (``--use-sharded-state``) into one ``.pt`` file.

    toolkit-consolidate checkpoints/checkpoint_best            # -> checkpoints/checkpoint_best.pt
    toolkit-consolidate checkpoints/checkpoint_last -o last.pt --no-optimizer
    toolkit-consolidate checkpoints/checkpoint_best.pt --to-fairseq fairseq_best.pt

The work is in :mod:`toolkit.export.consolidate`.
"""

from __future__ import annotations

from typing import List, Optional

from toolkit.config.commands import ConsolidateConfig
from toolkit_cli.command import run_command


def main(cfg: ConsolidateConfig) -> str:
    from toolkit.export.consolidate import run  # torch: after parsing (--help and argument errors exit first)

    return run(cfg)


def cli_main(argv: Optional[List[str]] = None) -> None:
    run_command(
        "toolkit-consolidate",
        ConsolidateConfig,
        main,
        argv,
        "Consolidate a sharded (DCP) checkpoint into one file, or write a checkpoint in fairseq's layout "
        "(--to-fairseq).",
    )


if __name__ == "__main__":
    cli_main()
