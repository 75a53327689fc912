"""Close what a run writes through before a process leaves without the interpreter's exit (``os._exit``)."""

from __future__ import annotations

import atexit
import logging
import sys

from toolkit.logging import progress_bar, wandb_writer


def close_writers() -> None:
    """Flush and close everything a run writes through: TensorBoard writers, a W&B run, the exit handlers that
    others registered (a plugin's, W&B's own), the log handlers, stdout/stderr. Each is tried even when one
    before it fails (a full disk); the first error is raised at the end.

    The interpreter's exit does this; a process that leaves with ``os._exit`` (a spawned training worker,
    :mod:`toolkit.distributed.launch`) skips it, and would lose what is still buffered without this call.
    """
    steps = [progress_bar.close_tensorboard_writers]
    if "wandb" in sys.modules:  # a run that never used W&B does not import it here
        steps.append(wandb_writer.finish)
    # atexit: what the interpreter would run next (it reports its handlers' errors itself)
    steps += [atexit._run_exitfuncs, logging.shutdown, sys.stdout.flush, sys.stderr.flush]
    first_error = None
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: B902 - the other writers still get flushed
            first_error = first_error or e
    if first_error is not None:
        raise first_error
