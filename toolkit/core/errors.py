"""Errors the command line reports as one line, without a traceback."""

import json
import os
import sys
import time


class UserError(Exception):
    """Bad input from the user: the message names the file, line or flag and what to do."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C / SIGINT during training: the message says where the run stopped and what is saved.

    A KeyboardInterrupt still (every handler of one keeps working); the command line prints
    it as one line and exits 130, as a shell does for a process killed by SIGINT.
    """


def import_optional(module: str, message: str):
    """Import an optional package, or raise ``UserError(message)`` (which names its pip install)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(message) from None


def require(module: str, packages: str = "onnx onnxruntime onnxscript"):
    """An export's optional dependency (the ``toolkit[export]`` extra), or one UserError saying how to install it.

    Here rather than in ``toolkit.export`` because the model families' Hugging Face adapters (below export)
    need it too."""
    return import_optional(
        module, f"{module} is not installed; pip install toolkit[export] (or: pip install {packages})"
    )


PARSE_ERRORS = (ValueError, KeyError, TypeError, AttributeError, IndexError)  # what reading a malformed file raises


def _what_is_wrong(e: BaseException) -> str:
    if isinstance(e, KeyError) and e.args:
        return f"no {e.args[0]!r}"
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:240]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class malformed_file:  # noqa: N801 (used as ``with malformed_file(path, ...)``, like a function)
    """``with malformed_file(path, what_to_do):`` turns what parsing a damaged or hand-edited file raises
    (``errors``: invalid JSON, a missing key, a value of the wrong type; a reader library's own exception)
    into one ``UserError`` naming the file, what is wrong and ``what_to_do``, so every malformed input of a
    command is one line, not a traceback from deep inside the reader."""

    def __init__(self, path: str, what_to_do: str, errors=PARSE_ERRORS):
        self.path, self.what_to_do, self.errors = path, what_to_do, tuple(errors)

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:
        if e is None or isinstance(e, UserError) or not isinstance(e, self.errors):
            return False
        raise UserError(f"{self.path}: {_what_is_wrong(e)}; {self.what_to_do}") from None


def read_json_object(path: str, what_to_do: str) -> dict:
    """The JSON object (a dict) in ``path``; one ``UserError`` naming the file for invalid JSON or another type."""
    import json

    with malformed_file(path, what_to_do):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    if not isinstance(value, dict):
        raise UserError(f"{path}: holds a JSON {type(value).__name__}, not an object; {what_to_do}")
    return value


def print_error_line(prog: str, message: object) -> None:
    """``<prog>: error: <message>`` on stderr as one line (a message with newlines is joined): what every command
    and its argument parser print before exiting. Under torchrun the line is also the rank's error file, so
    torchrun's failure report names it as the root cause (instead of "To enable traceback see ..."); the
    ``ChildFailedError`` traceback after it is printed by torchrun's own process (docs/fairseq_flags.md)."""
    line = f"{prog}: error: {' '.join(str(message).splitlines())}"
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(
                    {
                        "message": {
                            "message": line,
                            "extraInfo": {"py_callstack": line + "\n", "timestamp": str(int(time.time()))},
                        }
                    },
                    f,
                )
        except OSError:
            pass  # torchrun's report then lacks the root cause; the exit status still says the rank failed
