"""Errors the command line reports as one line, without a traceback."""


class UserError(Exception):
    """Bad input from the user: the message names the file, line or flag and what to do."""


def import_optional(module: str, message: str):
    """Import an optional package, or raise ``UserError(message)`` (which names its pip install)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(message) from None
