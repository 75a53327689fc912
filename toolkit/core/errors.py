"""Errors the command line reports as one line, without a traceback."""


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
    return import_optional(module, f"{module} is not installed; pip install toolkit[export] "
                                   f"(or: pip install {packages})")
