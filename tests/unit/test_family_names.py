"""Generic code names no family's modules: what parallelism, the planner, export, training and checkpointing need
of a family they ask its plan and Protocols (``toolkit.core.protocols``), so a new family is a new folder.

The family-only names are read from the families' own plans (module path parts one family has and another has
not: ``fc1``, ``qkv_proj``, ``gate_proj``, ``input_layernorm``, ``embed_positions``...), so a new family's names
are checked without editing a list. Code is read with ``ast``: names, attributes and string constants count,
docstrings and comments (which may explain a family as an example) do not. Left out: the family packages
themselves (``toolkit/models/<family>/``) and ``toolkit/compat/`` (fairseq's checkpoint layout is
``transformer_lm``'s by definition)."""

from __future__ import annotations

import ast
import os
import re
from typing import Iterator, Set, Tuple

from tests.helpers import REPO_ROOT
from toolkit.models import build_on_meta

# Archs covering each family's optional modules (learned positions, input/output projections, q/k/v biases).
FAMILY_BUILDS = (
    ("transformer_lm", {}),
    ("transformer_lm_gpt2_tiny", {}),
    ("transformer_lm_gpt2_tiny", dict(decoder_input_dim=32, decoder_output_dim=32, decoder_learned_pos=True)),
    ("llama_tiny", {}),
    ("llama_tiny_gqa", {}),
)
# Module names that are also torch's or the protocol's words (``F.layer_norm``, a ``norm`` kind, a gradient norm).
SHARED_WORDS = {"norm", "layer_norm"}
LEFT_OUT = (os.path.join("toolkit", "compat"),)


def plan_names(arch: str, overrides: dict) -> Set[str]:
    plan = build_on_meta(arch, vocab_size=40, tokens_per_sample=16, **overrides).tensor_parallel_plan()
    return {part for path in (*plan.top, *plan.block) for part in path.split(".") if not part.isdigit()}


def family_only_names() -> Set[str]:
    by_family = {}
    for arch, overrides in FAMILY_BUILDS:
        family = "llama" if arch.startswith("llama") else "transformer_lm"
        by_family.setdefault(family, set()).update(plan_names(arch, overrides))
    everywhere = set.intersection(*by_family.values())
    return set.union(*by_family.values()) - everywhere - SHARED_WORDS


def generic_files() -> Iterator[str]:
    models = os.path.join(REPO_ROOT, "toolkit", "models")
    for package in ("toolkit", "toolkit_cli"):
        for folder, subfolders, names in os.walk(os.path.join(REPO_ROOT, package)):
            if folder == models:
                subfolders.clear()  # a family package names its own modules
            rel = os.path.relpath(folder, REPO_ROOT)
            if rel.startswith(LEFT_OUT):
                continue
            yield from (os.path.join(folder, name) for name in names if name.endswith(".py"))


def named_words(path: str) -> Iterator[Tuple[int, str]]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield from ((node.lineno, word) for word in re.findall(r"[A-Za-z_]\w*", node.value))
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id


def test_the_family_only_names_are_found():
    names = family_only_names()
    assert {"fc1", "qkv_proj", "embed_positions", "gate_proj", "q_proj", "input_layernorm"} <= names, names
    assert not names & {"layers", "embed_tokens", "output_projection", "norm"}  # shared or generic


def test_generic_code_names_no_family_module():
    names = family_only_names()
    hits = [
        f"{os.path.relpath(path, REPO_ROOT)}:{line}: {word}"
        for path in generic_files()
        for line, word in named_words(path)
        if word in names
    ]
    assert not hits, "generic code names a family's module (ask the family's plan or a Protocol):\n" + "\n".join(hits)


def test_the_check_catches_a_family_name(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""fc1 in a docstring is fine."""\nCOLUMN = ("qkv_proj",)\nx = model.gate_proj\n')
    names = family_only_names()
    assert sorted(w for _, w in named_words(str(sample)) if w in names) == ["gate_proj", "qkv_proj"]
