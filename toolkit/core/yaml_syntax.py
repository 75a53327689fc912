"""The first YAML syntax error in a folder of YAML files, named by file and line.

Readers that take a folder of YAML (Hydra's config folder, lm-eval's ``--include-path``) either skip a file
they cannot parse (lm-eval: the task then comes back as "unknown task") or report the error against
another file (Hydra: the primary config). Parsing each file first names the broken one. Only the syntax is
read (``yaml.compose``: no alias is expanded, no tag constructed, so readers' own tags such as lm-eval's
``!function`` pass); what the keys mean stays the reader's to judge.
"""

from __future__ import annotations

import os
from typing import List, Optional


def yaml_files(folder: str) -> List[str]:
    """Every ``*.yaml`` / ``*.yml`` under ``folder``, sorted."""
    return sorted(
        os.path.join(parent, name)
        for parent, _, names in os.walk(folder)
        for name in names
        if name.endswith((".yaml", ".yml"))
    )


def syntax_error(path: str) -> Optional[str]:
    """``"PATH: line L, column C: invalid YAML (problem)"`` for a file that does not parse, else None."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            list(yaml.compose_all(f, Loader=yaml.SafeLoader))
    except UnicodeDecodeError as e:
        return f"{path}: not UTF-8 text ({e.reason}); save it as UTF-8"
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        return f"{path}:{where} invalid YAML ({problem})"
    return None


def first_syntax_error(folder: str) -> Optional[str]:
    """:func:`syntax_error` of the first broken file under ``folder`` (None when all parse)."""
    return next((error for error in map(syntax_error, yaml_files(folder)) if error is not None), None)
