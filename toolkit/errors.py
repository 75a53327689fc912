"""Errors the command line reports as one line, without a traceback."""


class UserError(Exception):
    """Bad input from the user: the message names the file, line or flag and what to do."""
