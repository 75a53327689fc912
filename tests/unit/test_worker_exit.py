"""A spawned training worker leaves with os._exit (gloo's teardown at interpreter finalization can abort it,
pytorch/pytorch#179291), after closing every writer: nothing buffered is lost, and the exit code is kept."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO_ROOT
from tests.helpers.cli import subprocess_env

# In a fresh interpreter (os._exit would end the test process): a block-buffered print, a log file line, a
# TensorBoard scalar never flushed, an exit handler a plugin registered; then the worker's exit.
WORKER = """
import atexit, logging, sys
from torch.utils.tensorboard import SummaryWriter
from toolkit.distributed import launch
from toolkit.logging import progress_bar
from toolkit.logging.setup import add_file_handler

out, code, fail = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
logging.getLogger().setLevel(logging.INFO)
add_file_handler(out + "/train.log")
writer = SummaryWriter(out + "/tb", flush_secs=3600)
writer.add_scalar("loss", 1.5, 7)
progress_bar._tensorboard_writers[("test", "train")] = writer
atexit.register(lambda: open(out + "/plugin.txt", "w").write("closed"))
if fail:
    def broken():
        raise OSError(28, "No space left on device")
    progress_bar.close_tensorboard_writers = broken
logging.getLogger("toolkit.test").info("last log line")
print("last stdout line")
launch._leave(code)
"""


def leave(tmp_path, code: int, fail: bool = False) -> subprocess.CompletedProcess:
    env = subprocess_env({"PYTHONUNBUFFERED": ""})  # stdout to a pipe: block-buffered, as in a spawned worker
    return subprocess.run(
        [sys.executable, "-c", WORKER, str(tmp_path), str(code), "1" if fail else "0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )


def test_every_writer_is_flushed_before_the_exit(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = leave(tmp_path, 0)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "last stdout line"
    assert (tmp_path / "train.log").read_text().splitlines()[-1].endswith("| INFO | toolkit.test | last log line")
    assert (tmp_path / "plugin.txt").read_text() == "closed"
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(7, 1.5)]


def test_the_exit_code_is_kept_and_a_failing_close_is_not_an_exit_0(tmp_path):
    assert leave(tmp_path, 3).returncode == 3
    proc = leave(tmp_path, 0, fail=True)
    assert proc.returncode == 1 and "No space left on device" in proc.stderr
    assert proc.stdout.splitlines()[-1] == "last stdout line"  # the other writers were still flushed
