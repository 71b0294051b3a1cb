"""Docstrings and comments name files and modules that exist (they are the code map's footnotes).

A file moves, and the docstrings that say where to look go stale (``worker.py`` after the
move to ``_worker/process.py``, ``plans.Loaded`` after ``_sources/epoch_plan.py``): this reads every
module of the package and checks each ``name.py`` / ``folder/name.py`` it mentions, and each
````module.Name```` whose module is one of procpipe's (or, capitalised, any importable one).
"""
from __future__ import annotations

import pytest

import ast
import importlib.util
import pathlib
import re

from conftest import REPO_ROOT

import procpipe  # its __all__: the public names, some imported lazily (PEP 562)

pytestmark = pytest.mark.unit  # starts no process: `python -m pytest -m unit` (tests/conftest.py)

PACKAGE = pathlib.Path(REPO_ROOT) / "procpipe"
EXAMPLES = {"mytrain/data.py"}  # a user's file in an example, not one of ours
ALIASES = {"np"}  # numpy: how its users name it
VARIABLES = {"loader"}  # ``loader.epoch``: a Loader the user made, not procpipe/loader.py
EXTERNAL = {"torch", "keras", "ray", "tf", "tensorflow", "jax"}  # our adapters' names, and the libraries they adapt (``torch.Tensor``, ``tf.data``)
_FILE = re.compile(r"[A-Za-z_][A-Za-z0-9_/.]*\.py\b")
_DOTTED = re.compile(r"``([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def _modules() -> dict[str, list[pathlib.Path]]:
    found: dict[str, list[pathlib.Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        found.setdefault(path.stem, []).append(path)
        if path.name == "__init__.py":
            found.setdefault(path.parent.name, []).append(path)
    return found


def _top_names(path: pathlib.Path) -> set[str]:
    names = {p.stem for p in path.parent.glob("*.py")} if path.name == "__init__.py" else set()
    names |= {p.name for p in path.parent.iterdir() if p.is_dir()} if path.name == "__init__.py" else set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _file_exists(name: str, here: pathlib.Path, basenames: set[str]) -> bool:
    if name in EXAMPLES:
        return True
    candidates = (here.parent / name, PACKAGE / name, pathlib.Path(REPO_ROOT) / name)
    return any(c.exists() for c in candidates) or ("/" not in name and name in basenames)


def test_every_file_a_docstring_or_comment_names_exists() -> None:
    basenames = {p.name for p in PACKAGE.rglob("*.py")}
    stale = [f"{path.relative_to(REPO_ROOT)}:{n}: {m.group(0)}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             for m in _FILE.finditer(line) if not _file_exists(m.group(0), path, basenames)]
    assert not stale, "files named in docstrings or comments that do not exist:\n" + "\n".join(stale)


def test_every_module_attribute_a_docstring_names_exists() -> None:
    modules = _modules()
    names = {path: _top_names(path) for paths in modules.values() for path in paths}
    stale = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for match in _DOTTED.finditer(path.read_text()):
            parts = match.group(1).split(".")
            if parts[0] == "procpipe":
                parts = parts[1:]
                if parts and parts[0] not in modules:  # a public name: procpipe.Loader
                    if parts[0] not in names[PACKAGE / "__init__.py"] and parts[0] not in procpipe.__all__:
                        stale.append(f"{path.relative_to(REPO_ROOT)}: ``{match.group(1)}``")
                    continue
            if not parts or parts[0] in VARIABLES or parts[0] in EXTERNAL:
                continue
            if parts[0] in modules:
                attr = parts[1] if len(parts) > 1 else None
                if attr in (None, "py", "proto") or any(attr in names[m] for m in modules[parts[0]]):
                    continue
                stale.append(f"{path.relative_to(REPO_ROOT)}: ``{match.group(1)}``")
            elif len(parts) > 1 and parts[1][:1].isupper() and parts[0] not in ALIASES:
                if importlib.util.find_spec(parts[0]) is None:
                    stale.append(f"{path.relative_to(REPO_ROOT)}: ``{match.group(1)}`` (no module {parts[0]!r})")
    assert not stale, "module attributes named in docstrings that do not exist:\n" + "\n".join(stale)
