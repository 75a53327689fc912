"""Errors the command line reports as one line, without a traceback."""


class UserError(Exception):
    """Bad input from the user: the message names the file, line or flag and what to do."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C / SIGINT during training: the message says where the run stopped and what is saved.

    A KeyboardInterrupt still (every handler of one keeps working); the command line prints
    it as one line and exits 130, as a shell does for a process killed by SIGINT.
    """
