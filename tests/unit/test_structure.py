"""The library's import graph has no cycle (read with ``ast``, no import executed)."""
import ast
import os
from typing import Dict, List, Set

from tests.helpers import REPO_ROOT

PACKAGES = ("toolkit", "toolkit_cli")


def module_files() -> Dict[str, str]:
    files = {}
    for package in PACKAGES:
        for folder, _, names in os.walk(os.path.join(REPO_ROOT, package)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, REPO_ROOT)[:-3].replace(os.sep, ".")
                    files[module[: -len(".__init__")] if module.endswith(".__init__") else module] = path
    return files


def imported_modules(module: str, path: str, known: Set[str]) -> Set[str]:
    """Every toolkit module ``module`` imports, anywhere in the file (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if path.endswith("__init__.py") else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != module)
    return found


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import cycle as a path (empty when there is none); depth-first search with colours."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_library_has_no_import_cycle():
    files = module_files()
    graph = {m: imported_modules(m, p, set(files)) for m, p in files.items()}
    assert "toolkit.train_loop" in graph and graph["toolkit.train_loop"]
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))
