"""toolkit-preprocess: fairseq-compatible data-bins, worker-count independence, and bad input."""

import subprocess
import sys

from tests.helpers.preprocess import PROG


def test_console_script_error_is_one_line(tmp_path):
    dest = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit_cli.preprocess",
            "--only-source",
            "--trainpref",
            str(tmp_path / "missing.txt"),
            "--destdir",
            str(dest),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"{PROG}: error: --trainpref {tmp_path / 'missing.txt'}: no such file; check the path"
    ]
    assert "Traceback" not in proc.stdout
    assert not dest.exists()
