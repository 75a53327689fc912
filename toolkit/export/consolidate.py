"""toolkit-consolidate's work: a sharded checkpoint (``--use-sharded-state``) as one ``.pt`` file, or any
checkpoint in fairseq's ``transformer_lm`` layout (``--to-fairseq``).

The result of the first is the checkpoint ``toolkit-train`` writes without ``--use-sharded-state``:
``toolkit-eval-lm --path``, ``from_pretrained`` and ``--restore-file`` (any world size) load it. Runs in one
process; no GPU and no process group. The fairseq key layout is documented in
:mod:`toolkit.compat.fairseq.export`.
"""

from __future__ import annotations

import os
import tempfile

from toolkit.checkpoint import sharded
from toolkit.compat.fairseq import adapter as fairseq_adapter
from toolkit.config.commands import ConsolidateConfig  # noqa: F401  (its options, torch-free for --help)
from toolkit.core.errors import UserError

PROG = "toolkit-consolidate"


def check_output(flag: str, output: str, force: bool) -> None:
    """The output is one file: a folder (even with --force) or an existing file without --force is refused."""
    if os.path.isdir(output):
        raise UserError(
            f"{flag} {output}: is a folder; give the file to write, e.g. {os.path.join(output, 'checkpoint.pt')}"
        )
    if os.path.exists(output) and not force:
        raise UserError(f"{output}: already exists; pass --force to overwrite it or {flag} to write elsewhere")


def to_fairseq(cfg: ConsolidateConfig) -> str:
    output = cfg.to_fairseq
    check_output("--to-fairseq", output, cfg.force)
    folder = None if os.path.isfile(cfg.checkpoint) else sharded.find_sharded(cfg.checkpoint)
    if folder is None:
        summary = fairseq_adapter.write_fairseq_checkpoint(cfg.checkpoint, output)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            consolidated = os.path.join(tmp, "consolidated.pt")
            sharded.consolidate(folder, consolidated, include_optimizer=False)
            summary = fairseq_adapter.write_fairseq_checkpoint(consolidated, output)
    print(
        f"{PROG}: wrote {output} in fairseq's layout: {summary['tensors']} tensors, "
        f"{summary['params']} parameters (from {cfg.checkpoint})"
    )
    return output


def run(cfg: ConsolidateConfig) -> str:
    """The path written."""
    if cfg.to_fairseq:
        return to_fairseq(cfg)
    folder = sharded.find_sharded(cfg.checkpoint)
    if folder is None:
        raise UserError(
            f"{cfg.checkpoint}: no complete sharded checkpoint there (a folder with "
            f"{sharded.DCP_INDEX} and {sharded.META_FILE}, as toolkit-train --use-sharded-state writes)"
        )
    output = cfg.output or sharded.folder_name(os.path.normpath(cfg.checkpoint)) + ".pt"
    check_output("-o", output, cfg.force)
    summary = sharded.consolidate(folder, output, include_optimizer=not cfg.no_optimizer)
    print(
        f"{PROG}: wrote {output}: {summary['tensors']} tensors, {summary['params']} parameters"
        f"{', optimizer state' if summary['optimizer'] else ''} (from {summary['world_size']} shards in {folder})"
    )
    return output
