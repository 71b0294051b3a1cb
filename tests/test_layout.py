"""The package's layout as the docs promise it: every import the docs show works, the top of
``procpipe/`` holds only the public modules and packages (and ``_ext.py``, the adapters' door), and
ARCHITECTURE.md's table "Where does X live" names files that exist.

The public surface is read from the docs themselves (docs/, README.md, examples/): each
``from procpipe... import name`` and ``import procpipe...`` they show is imported here, so a
module moved without its documented path fails this test. An import that needs an optional
framework which is absent (tf.data, Keras without TensorFlow) is skipped, naming it.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "procpipe"
_FROM = re.compile(r"^\s*from\s+(procpipe(?:\.\w+)*)\s+import\s+\(?([\w\s,]+?)\)?\s*(?:#.*)?$", re.MULTILINE)
_DOTTED = re.compile(r"(?<![\w.])procpipe((?:\.[A-Za-z_]\w*)+)")
_IMPORT = re.compile(r"^\s*import\s+(procpipe(?:\.\w+)*)(?:\s+as\s+\w+)?\s*(?:#.*)?$", re.MULTILINE)
#: names the docs use that the text scan cannot see (attribute paths in prose and API tables)
ALSO_DOCUMENTED = [
    ("procpipe.torch", "DataLoader"),
    ("procpipe.tf", "dataset"),
    ("procpipe.keras", "dataset"),
    ("procpipe", "readers"),
    ("procpipe.ray", None),
    ("procpipe.bench", None),
]


def documented_imports() -> list[tuple[str, str | None]]:
    """``(module, name)`` for each import the docs show (``name`` None: ``import module``)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.py")),
             *sorted((ROOT / "examples").rglob("*.md"))]
    found: set[tuple[str, str | None]] = set(ALSO_DOCUMENTED)
    for path in files:
        text = path.read_text(encoding="utf-8")
        for module, names in _FROM.findall(text):
            for name in names.replace("\n", " ").split(","):
                name = name.strip().split(" as ")[0].strip()
                if name:
                    found.add((module, name))
        for module in _IMPORT.findall(text):
            found.add((module, None))
        for dotted in _DOTTED.findall(text):  # procpipe.torch.DataLoader, procpipe.sample_rng, ...
            parts = dotted.strip(".").split(".")
            found.add(("procpipe" + "".join("." + p for p in parts[:-1]), parts[-1]))
    return sorted(found, key=lambda pair: (pair[0], pair[1] or ""))


@pytest.mark.unit
def test_the_docs_show_the_public_surface() -> None:
    names = documented_imports()
    assert ("procpipe", "Loader") in names and ("procpipe.torch", "DataLoader") in names, names


def resolve(dotted: str) -> object:
    """The object ``dotted`` names: its longest importable module, then attributes; a name after a
    class (``procpipe.Loader.state_dict``) is that class's own, checked on the class."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] != "procpipe":
                pytest.skip(f"{dotted} needs {exc.name}, which is not installed here")
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
            if isinstance(found, type):  # a class: what follows is a method or an argument the docs name
                return found
        return found
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize(("module", "name"), documented_imports(), ids=lambda v: str(v))
def test_every_documented_import_works(module: str, name: str | None) -> None:
    resolve(module if name is None else f"{module}.{name}")


@pytest.mark.unit
def test_the_top_of_the_package_is_the_public_modules_and_packages() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    # the public modules, and _ext: the extension API the adapters use (procpipe/_ext.py's docstring)
    assert modules == ["__init__.py", "_ext.py", "config.py", "errors.py", "loader.py"], modules
    assert not [p for p in PACKAGE.rglob("torch_*.py")], "torch code belongs in procpipe/torch/"
    mixture = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*mix*.py"))
    assert all(m.startswith("_sources/mix/") for m in mixture), mixture


def where_table() -> list[tuple[str, list[str]]]:
    """ARCHITECTURE.md's "Where does X live" rows: (concern, the paths it names)."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("## Where does X live", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and line.lstrip().startswith("|") and not set(cells[0]) <= {"-", " "}:
            paths = re.findall(r"`(procpipe/[\w/.]*)`", cells[1])
            if paths:
                rows.append((cells[0], paths))
    return rows


@pytest.mark.unit
def test_the_where_table_names_files_that_exist() -> None:
    rows = where_table()
    assert len(rows) >= 15, rows
    missing = [f"{concern}: {path}" for concern, paths in rows for path in paths if not (ROOT / path).exists()]
    assert not missing, "ARCHITECTURE.md's 'Where does X live' names paths that do not exist:\n" + "\n".join(missing)
