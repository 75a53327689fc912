"""The shape of a simple command: parse one options dataclass, run, report a UserError in one line."""
from __future__ import annotations

import sys
from typing import Callable, List, Optional

from toolkit.config import options
from toolkit.core.errors import UserError


def run_command(prog: str, config_cls: type, main: Callable, argv: Optional[List[str]], description: str):
    """``main(config)``'s result; a UserError prints ``<prog>: error: <message>`` and exits 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = options.parse_with_components(prog, [config_cls], argv, selectors=(), arch=False, description=description)
    try:
        return main(options.config_from_args(config_cls, args))
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)
