"""toolkit-consolidate: turn a sharded checkpoint (``--use-sharded-state``) into one ``.pt`` file.

    toolkit-consolidate checkpoints/checkpoint_best            # -> checkpoints/checkpoint_best.pt
    toolkit-consolidate checkpoints/checkpoint_last -o last.pt --no-optimizer

The result is the checkpoint ``toolkit-train`` writes without ``--use-sharded-state``:
``toolkit-eval-lm --path``, ``from_pretrained`` and ``--restore-file`` (any world
size) load it. Runs in one process; no GPU and no process group needed.

    toolkit-consolidate checkpoints/checkpoint_best.pt --to-fairseq fairseq_best.pt

``--to-fairseq OUT.pt`` writes the model (a consolidated ``.pt`` or a sharded folder)
in fairseq's ``transformer_lm`` checkpoint layout, which fairseq's
``checkpoint_utils.load_model_ensemble`` (``fairseq-eval-lm --path``) reads; the key
layout is documented in :mod:`toolkit.compat.fairseq.export`.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from toolkit.core.errors import UserError

PROG = "toolkit-consolidate"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Consolidate a sharded (DCP) checkpoint into one file.")
    p.add_argument("checkpoint", help="sharded checkpoint folder (e.g. checkpoints/checkpoint_last), "
                                      "or its .pt name (checkpoints/checkpoint_last.pt)")
    p.add_argument("-o", "--output", default=None,
                   help="file to write (default: the folder's name + .pt, beside it)")
    p.add_argument("--no-optimizer", action="store_true",
                   help="leave the optimizer state out (a smaller file for evaluation)")
    p.add_argument("--force", action="store_true", help="overwrite the output file if it exists")
    p.add_argument("--to-fairseq", metavar="OUT.pt", default=None,
                   help="write the model in fairseq's transformer_lm checkpoint layout to OUT.pt")
    return p


def check_output(flag: str, output: str, force: bool) -> None:
    """The output is one file: a folder (even with --force) or an existing file without --force is refused."""
    if os.path.isdir(output):
        raise UserError(f"{flag} {output}: is a folder; give the file to write, e.g. "
                        f"{os.path.join(output, 'checkpoint.pt')}")
    if os.path.exists(output) and not force:
        raise UserError(f"{output}: already exists; pass --force to overwrite it or {flag} to write elsewhere")


def to_fairseq(args: argparse.Namespace) -> str:
    import tempfile

    from toolkit.checkpoint import sharded
    from toolkit.compat.fairseq import export as fairseq_export

    output = args.to_fairseq
    check_output("--to-fairseq", output, args.force)
    folder = None if os.path.isfile(args.checkpoint) else sharded.find_sharded(args.checkpoint)
    if folder is None:
        summary = fairseq_export.export(args.checkpoint, output)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            consolidated = os.path.join(tmp, "consolidated.pt")
            sharded.consolidate(folder, consolidated, include_optimizer=False)
            summary = fairseq_export.export(consolidated, output)
    print(f"{PROG}: wrote {output} in fairseq's layout: {summary['tensors']} tensors, "
          f"{summary['params']} parameters (from {args.checkpoint})")
    return output


def main(args: argparse.Namespace) -> str:
    from toolkit.checkpoint import sharded

    if args.to_fairseq:
        return to_fairseq(args)
    folder = sharded.find_sharded(args.checkpoint)
    if folder is None:
        raise UserError(f"{args.checkpoint}: no complete sharded checkpoint there (a folder with "
                        f"{sharded.DCP_INDEX} and {sharded.META_FILE}, as toolkit-train --use-sharded-state writes)")
    output = args.output or sharded.folder_name(os.path.normpath(args.checkpoint)) + ".pt"
    check_output("-o", output, args.force)
    summary = sharded.consolidate(folder, output, include_optimizer=not args.no_optimizer)
    print(f"{PROG}: wrote {output}: {summary['tensors']} tensors, {summary['params']} parameters"
          f"{', optimizer state' if summary['optimizer'] else ''} (from {summary['world_size']} shards in {folder})")
    return output


def cli_main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        main(args)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
