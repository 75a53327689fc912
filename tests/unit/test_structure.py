"""The library's import graph: no cycle, and every import points down the declared layer order
(read with ``ast``, no import executed; function-local imports count: an import inside a function is
still an edge, only a later one)."""

import ast
import os
from typing import Dict, Iterator, List, Set, Tuple

from tests.helpers import REPO_ROOT

PACKAGES = ("toolkit", "toolkit_cli")

# fairseq's plugin API (--user-dir plugins' base classes), with the rest of fairseq's compatibility in compat/,
# which sits above checkpoint; the families' fairseq import paths reach it by name (core.registry), never by import.
PLUGIN_API = "toolkit.compat.fairseq.plugins"

# The layer order, bottom first (docs/design.md explains each). A package may import only the packages
# listed before it, so the order inside a layer matters too. ``toolkit`` is the root package's
# ``__init__`` (the version only); ``toolkit.options``, ``toolkit.checkpoint_utils``, ``toolkit.utils`` and
# ``toolkit.dataclass`` are fairseq-named facades for users (re-exports of toolkit.compat.fairseq; a name may be
# listed before its module exists) and nothing in the library imports them; ``toolkit_cli`` (the commands) parses
# flags and calls the layers below.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("core", ("toolkit", "toolkit.core")),
    ("ops", ("toolkit.ops",)),
    ("config", ("toolkit.config",)),
    ("logging", ("toolkit.logging",)),
    ("components", ("toolkit.tokenizers", "toolkit.data")),
    ("components", ("toolkit.models", "toolkit.criterions", "toolkit.tasks", "toolkit.optim", "toolkit.generation")),
    ("parallel", ("toolkit.distributed",)),
    ("checkpoint", ("toolkit.checkpoint",)),
    ("compat", ("toolkit.compat",)),
    ("inference", ("toolkit.inference",)),
    ("evaluation", ("toolkit.evaluation",)),
    ("train", ("toolkit.train",)),
    ("export", ("toolkit.export",)),
    ("plan", ("toolkit.plan",)),
    ("api facades", ("toolkit.options", "toolkit.checkpoint_utils", "toolkit.utils", "toolkit.dataclass")),
    ("commands", ("toolkit_cli",)),
]
ORDER = [package for _, packages in LAYERS for package in packages]


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
    return {target for target, _ in import_sites(module, path, known)}


def import_sites(module: str, path: str, known: Set[str]) -> Iterator[Tuple[str, int]]:
    """(imported toolkit module, line) for every import in the file, functions included."""
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
        for target in targets:
            if target in known and target != module:
                yield target, node.lineno


def package_of(module: str) -> str:
    """The unit of the layer table: ``toolkit.a.b.c`` -> ``toolkit.a``; ``toolkit`` and ``toolkit_cli.*`` whole."""
    parts = module.split(".")
    if parts[0] == "toolkit_cli":
        return "toolkit_cli"
    return ".".join(parts[:2])


def upward_edges(files: Dict[str, str], order: List[str]) -> List[str]:
    """One line per import that points up (or sideways to a later package) in ``order``."""
    rank = {package: i for i, package in enumerate(order)}
    found = []
    for module, path in sorted(files.items()):
        source = package_of(module)
        for target, line in import_sites(module, path, set(files)):
            dest = package_of(target)
            if dest != source and rank[dest] > rank[source]:
                found.append(
                    f"{os.path.relpath(path, REPO_ROOT)}:{line}: {module} imports {target} "
                    f"({source} may only import packages below it in LAYERS)"
                )
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
                return stack[stack.index(nxt) :] + [nxt]
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
    assert "toolkit.train.train_loop" in graph and graph["toolkit.train.train_loop"]
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))


def test_upward_edges_are_found():
    files = module_files()
    order = list(ORDER)
    order.remove("toolkit.core")
    order.append("toolkit.core")  # core put on top: everything that imports it now points up
    assert any("imports toolkit.core." in line for line in upward_edges(files, order))


def test_every_package_has_a_layer():
    missing = sorted({package_of(m) for m in module_files()} - set(ORDER))
    assert not missing, (
        f"{', '.join(missing)}: no layer; add it to LAYERS in tests/test_structure.py "
        f"and to the layer table in docs/design.md"
    )


def test_imports_point_down_the_layers():
    upward = upward_edges(module_files(), ORDER)
    assert not upward, f"{len(upward)} upward imports:\n" + "\n".join(upward)


def test_package_graph_has_no_cycle():
    files = module_files()
    graph: Dict[str, Set[str]] = {}
    for module, path in files.items():
        deps = {package_of(t) for t in imported_modules(module, path, set(files))}
        graph.setdefault(package_of(module), set()).update(deps - {package_of(module)})
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))


def test_design_doc_names_every_package():
    text = open(os.path.join(REPO_ROOT, "docs", "design.md")).read()
    missing = [p for p in ORDER if p != "toolkit" and f"`{p.split('.', 1)[-1]}" not in text]
    assert not missing, f"docs/design.md does not describe {', '.join(missing)}: add it to its layer table"


# What the library above compat/ takes from it: the adapter (fairseq's checkpoint files, for the run's
# checkpoint manager, model loading and EMA), the flag aliases (toolkit-train's resolution) and the YAML
# configs (``train_config``: toolkit-train --config and toolkit-hydra-train), fairseq's hub methods and
# keywords (``hub``: the hub, toolkit-generate's checkpoint names), and the plugin API's package (the trainer's
# ``calls_the_model``, fairseq's criterion contract). The rest of compat/fairseq/ is its own business, so a caller
# never branches on "is this fairseq"; the fairseq-named facades (api facades) re-export what they name.
COMPAT_DOORS = {
    "toolkit.compat",
    "toolkit.compat.fairseq",
    "toolkit.compat.fairseq.adapter",
    "toolkit.compat.fairseq.flags",
    "toolkit.compat.fairseq.train_config",
    "toolkit.compat.fairseq.hub",
    PLUGIN_API,
}
FAIRSEQ_FACADES = {"toolkit.options", "toolkit.checkpoint_utils", "toolkit.utils", "toolkit.dataclass"}


def test_library_reaches_fairseq_files_through_the_adapter():
    files = module_files()
    found = [
        f"{os.path.relpath(path, REPO_ROOT)}:{line}: {module} imports {target}"
        for module, path in sorted(files.items())
        if module.startswith("toolkit.")
        and not module.startswith("toolkit.compat.")
        and package_of(module) not in FAIRSEQ_FACADES
        for target, line in import_sites(module, path, set(files))
        if package_of(target) == "toolkit.compat" and target not in COMPAT_DOORS
    ]
    assert not found, "use toolkit.compat.fairseq.adapter (add what is missing there):\n" + "\n".join(found)


# The fairseq import paths a plugin uses inside the families, which serve the plugin API's names by name.
PLUGIN_API_PATHS = {
    "toolkit.models.fairseq_model": "model",
    "toolkit.tasks.fairseq_task": "task",
    "toolkit.criterions.fairseq_criterion": "criterion",
}


def test_the_families_fairseq_paths_serve_the_plugin_apis_names_without_importing_it():
    """Every name a family's fairseq path lists is the plugin API's object, and nothing below compat/ imports
    the plugin API (the families sit below it: they reach it through ``core.registry.fairseq_plugin_name``)."""
    import importlib

    files = module_files()
    for path, part in PLUGIN_API_PATHS.items():
        facade, home = importlib.import_module(path), importlib.import_module(f"{PLUGIN_API}.{part}")
        assert facade.FAIRSEQ_NAMES and all(getattr(facade, n) is getattr(home, n) for n in facade.FAIRSEQ_NAMES)
    rank = {package: i for i, package in enumerate(ORDER)}
    found = [
        f"{os.path.relpath(path, REPO_ROOT)}:{line}: {module} imports {target}"
        for module, path in sorted(files.items())
        if rank[package_of(module)] < rank["toolkit.compat"]
        for target, line in import_sites(module, path, set(files))
        if target.startswith(PLUGIN_API)
    ]
    assert not found, "the layers below compat/ reach fairseq's plugin API by name only:\n" + "\n".join(found)
