"""The one shape of a command: parse its options dataclass with the shared options machinery, call
``run(config)`` from the library, and report what went wrong in one line through one error handler.

Every ``toolkit_cli`` module is a thin parser over a library function (litgpt's one module per command):
the work lives in the layers below, so tests and Python users call the same ``run(config)``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Type

from toolkit.config import options
from toolkit.core import registry
from toolkit.core.errors import Interrupted, UserError, print_error_line


def fail(prog: str, message: object, status: int = 1) -> None:
    """``<prog>: error: <message>`` on one line (a message with newlines is joined), then exit ``status``."""
    print_error_line(prog, message)
    sys.exit(status)


@contextlib.contextmanager
def one_line_errors(
    prog: str, also: Tuple[Type[BaseException], ...] = (), interrupted: str = "interrupted"
) -> Iterator[None]:
    """The error handler every command shares: a ``UserError`` (or one of ``also``) exits 1, an ``OSError`` that
    escaped the library names its file and what to check (exit 1), Ctrl-C exits 130 saying where it stopped."""
    try:
        yield
    except (UserError,) + tuple(also) as e:
        fail(prog, e)
    except OSError as e:  # e.g. disk full or permission denied on a path the library did not check first
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        fail(prog, f"{where}{e.strerror or e}; check the path, its permissions and free space")
    except KeyboardInterrupt as e:  # Interrupted says where the run stopped; otherwise the command's own words
        fail(prog, e if isinstance(e, Interrupted) else interrupted, status=130)


def run_command(
    prog: str,
    config_cls: type,
    main: Callable,
    argv: Optional[List[str]],
    description: str,
    selectors: Sequence = (),
    sections: Sequence[type] = (),
    from_argv: Optional[Callable[[List[str]], Sequence]] = None,
):
    """``main(config, *sections, *from_argv(argv))``'s result, ``config`` and each of ``sections`` (more options
    dataclasses, e.g. generation's) parsed from ``argv``; ``from_argv`` gives what the dataclasses cannot (e.g.
    which task options were given). fairseq's bare ``--remove-bpe`` / ``--post-process`` mean ``subword_nmt``."""
    argv = options.fill_optional_values(list(sys.argv[1:] if argv is None else argv))
    configs = [config_cls, *sections]
    args = options.parse_with_components(
        prog, configs, argv, selectors=tuple(selectors), arch=False, description=description
    )
    extra = tuple(from_argv(argv)) if from_argv is not None else ()
    with one_line_errors(prog):
        registry.import_all_components()  # parsing imported only the chosen components' options (no torch)
        return main(*(options.config_from_args(cls, args) for cls in configs), *extra)
