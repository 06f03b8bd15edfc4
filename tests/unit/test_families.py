"""One home per model family: ``usp.models.families`` is the one list, each family is its folder
``usp/models/<name>/``, and no other module of ``usp/`` names a family (compares with it, keys a
dict by it, lists it): it asks the registry. The scan reads the source (on the tree before the
families had a home it named 23 places in config/model.py, models/adapters.py,
models/hf_model.py and models/llama_hf.py)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from usp.models.family import WINDOWS
from usp.models.families import FAMILIES, family

PACKAGE = Path(__file__).resolve().parents[2] / "usp"
REGISTRY = "models/families.py"


def family_words() -> set[str]:
    """What names a family in code: its name (transformers' ``model_type``, ``model.hf`` /
    ``model.arch``) and its transformers config class."""
    return {w for f in FAMILIES.values() for w in (f.name, f.config_class)}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of ``tree`` (module, classes, functions)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def family_strings(root: Path, words: set[str], homes: tuple[str, ...] = ()) -> list[str]:
    """``path:line: 'word'`` for each string in the code of ``root`` (docstrings aside) that is
    exactly one of ``words``, outside ``homes`` (files or folders relative to ``root``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(rel == h or rel.startswith(h.rstrip("/") + "/") for h in homes):
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        found += [f"{rel}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value in words and id(node) not in docs]
    return found


def test_no_module_outside_the_registry_and_the_family_folders_names_a_family():
    homes = (REGISTRY, *(f"models/{name}/" for name in FAMILIES))
    found = family_strings(PACKAGE, family_words(), homes)
    assert not found, ("these modules name a family; ask usp.models.families instead:\n"
                       + "\n".join(found))


def test_the_scan_sees_a_branch_a_key_and_a_list_but_not_prose(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "build.py").write_text(
        '"""Builds a llama."""\n'
        'ARCHS = ("llama", "qwen2")\n'
        'def build(mc):\n'
        '    """For mistral too."""\n'
        '    if mc.hf == "mistral":\n'
        '        return {"qwen2": 1}\n'
        '    return f"no {mc.hf}: use mistral", "llama3"\n')
    (tmp_path / "models" / "families.py").write_text('FAMILIES = ("llama",)\n')
    found = family_strings(tmp_path, {"llama", "qwen2", "mistral"}, (REGISTRY,))
    assert found == ["build.py:2: 'llama'", "build.py:2: 'qwen2'", "build.py:5: 'mistral'",
                     "build.py:6: 'qwen2'"]


def test_each_family_is_a_folder_of_usp_models_and_the_registry_lists_every_folder():
    folders = {p.parent.name for p in (PACKAGE / "models").glob("*/__init__.py")}
    assert folders == set(FAMILIES)
    for name, f in FAMILIES.items():
        assert importlib.import_module(f"usp.models.{name}").FAMILY is f is family(name)
        assert f.name == name


def test_a_built_in_model_without_arch_exports_as_one_family_whatever_its_windows():
    exported = sorted(f.exports for f in FAMILIES.values() if f.exports is not None)
    assert exported == sorted(WINDOWS)


def test_an_unknown_family_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="model.hf='gpt2' is not one of " + ", ".join(FAMILIES)):
        family("gpt2", "model.hf")
