"""fairseq-generate's ``--results-path DIR``: the output goes to ``DIR/generate-{gen_subset}.txt``.

As fairseq, the file holds what stdout would (the S-/T-/H-/D-/P- lines) and the summary lines.
It is written under a temporary name and renamed when generation has finished, so a failed
run leaves no half-written results file.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, Optional

from toolkit.core.errors import UserError
from toolkit.core.fileio import atomic_write

logger = logging.getLogger(__name__)


def results_file(results_path: str, gen_subset: str) -> str:
    if os.path.exists(results_path) and not os.path.isdir(results_path):
        raise UserError(f"--results-path {results_path}: exists and is not a folder; give a folder")
    return os.path.join(results_path, f"generate-{gen_subset}.txt")


def generate_with_results_path(cfg, gen_cfg, task_overrides: Optional[Dict] = None):
    """``generate_main``, its output in ``--results-path``'s file when given (else stdout)."""
    from toolkit.inference.generate import generate_main

    if cfg.results_path is None:
        return generate_main(cfg, gen_cfg, task_overrides)
    path = results_file(cfg.results_path, cfg.gen_subset)
    os.makedirs(cfg.results_path, exist_ok=True)
    with atomic_write(path, "w") as out:
        handler = logging.StreamHandler(out)
        handler.setFormatter(logging.Formatter("%(message)s"))
        summary = logging.getLogger("toolkit.generation")
        summary.addHandler(handler)
        try:
            session = generate_main(cfg, gen_cfg, task_overrides, out=out)
        finally:
            summary.removeHandler(handler)
    logger.info(f"wrote the output to {path}")
    return session
