"""The package's shape, checked from its source text (``ast``; procpipe is never imported), for what
import-linter cannot say.

The layering itself is declared as import-linter contracts in ``pyproject.toml``
(``[tool.importlinter]``) and checked by ``lint-imports`` in CI (``.ci/run``, after mypy): the
layers of the package (``layers``), the source kinds as one package each over one contract
(``kinds``), no framework in the core (``frameworks``), orders and epoch plans with no process,
thread or clock (``pure-orders``) and no import circles at any depth, ``TYPE_CHECKING`` imports
included (``acyclic``). Here:

1. **The contracts are there and CI runs them**, and ARCHITECTURE.md's layer table is the
   ``layers`` contract's.
2. **No reading another module's privates.** ``expr._name`` (not a dunder), where ``expr``
   is not ``self``/``cls`` and ``_name`` is not defined by the module itself but is defined
   by another procpipe module, reads (or writes) that module's internals: give it a public
   name, a property or a method instead. ``from .x import _name`` and ``getattr(obj, "_name")``
   (``setattr``, ``hasattr``, ``delattr``) count too. Third-party privates
   (``torch.utils.data._utils``, ``dill._dill``) are out of scope. A module's own private
   names are not checked at all (``other._x`` in a class that sets ``self._x`` is its own
   business), so a reader that happens to define the same private name is not caught.
3. **The source kind is asked once** (``_sources/resolve.py``'s ``kind_of``), in at most 3 places.
4. **One name, one concept**: no module name in two packages.
5. ``test_long_modules_are_reported_for_review``: a warning, not a failure, for a module over 800 lines.
6. **The adapters' door**: the adapters and ``procpipe.bench`` import, of procpipe, only its public
   modules, ``procpipe._ext`` and each other.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # starts no process: `python -m pytest -m unit` (tests/conftest.py)

PACKAGE = "procpipe"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / PACKAGE

# --------------------------------------------------------------------------- reading the tree
@dataclass(frozen=True)
class Module:
    """One ``.py`` file of the package, parsed."""

    name: str  # dotted, e.g. "procpipe._sources.stream.shard_order"; a package's __init__ is the package's name
    path: Path
    is_package: bool
    tree: ast.Module

    @property
    def short(self) -> str:
        """The name as the layer table spells it: without ``procpipe.`` (the package: ``procpipe``)."""
        return self.name if self.name == PACKAGE else self.name[len(PACKAGE) + 1:]


def read_modules() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(parts)
        modules[name] = Module(name, path, is_package, ast.parse(path.read_text(), filename=str(path)))
    return modules


def where(module: Module, node: ast.AST) -> str:
    return f"{module.path.relative_to(PACKAGE_DIR.parent)}:{getattr(node, 'lineno', '?')}"


def imports_of(module: Module, known: set[str]) -> Iterator[tuple[ast.AST, str, tuple[str, ...]]]:
    """Every import of a procpipe module in ``module``: (node, target module, names imported from it)."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    yield node, deepest_known(alias.name, known), ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # the package this relative import starts from: a package's own name, else its parent
                anchor = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known:
                    yield node, submodule, ()
                else:
                    yield node, deepest_known(base, known), (alias.name,)


def deepest_known(name: str, known: set[str]) -> str:
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


# --------------------------------------------------------------------------- 1. the contracts
PYPROJECT = PACKAGE_DIR.parent / "pyproject.toml"
CONTRACTS = ("layers", "kinds", "adapters", "frameworks", "pure-orders", "acyclic")


def contracts() -> dict[str, dict]:
    """pyproject.toml's import-linter contracts, by id."""
    import tomllib  # (3.11: this file is not in the 3.10 CI subset)

    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    return {contract["id"]: contract for contract in config["contracts"]}


def test_the_layering_is_declared_as_import_linter_contracts_run_by_ci() -> None:
    declared = contracts()
    assert set(CONTRACTS) <= set(declared), f"pyproject.toml lacks the contracts {set(CONTRACTS) - set(declared)}"
    assert declared["layers"]["exhaustive"] and declared["kinds"]["exhaustive"], "a new package must be given a layer"
    ci = (PACKAGE_DIR.parent / ".ci" / "run").read_text()
    assert any(line.strip().endswith("lint-imports") and not line.lstrip().startswith("#") for line in ci.splitlines()), (
        ".ci/run does not run lint-imports")
    lint_extra = (PYPROJECT.read_text().split("lint = [", 1)[1].split("]", 1)[0])
    assert "import-linter==" in lint_extra, "the lint extra does not pin import-linter"


def layer_rows(markdown: str) -> list[str]:
    """The layers of ARCHITECTURE.md's table (section 'Layers'), top to bottom, as the contract spells them."""
    section = markdown.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for row in section.splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1].startswith("`"):
            rows.append(" | ".join(name.strip().strip("`") for name in cells[1].split(",")))
    return rows


def test_architecture_md_shows_the_same_layers() -> None:
    """ARCHITECTURE.md's layer table is the ``layers`` contract: a row per layer, top to bottom."""
    shown = layer_rows((PACKAGE_DIR.parent / "ARCHITECTURE.md").read_text())
    declared = [" | ".join(part.strip() for part in layer.replace(":", "|").split("|")) for layer in contracts()["layers"]["layers"]]
    assert shown == declared, f"ARCHITECTURE.md's layer table {shown} is not pyproject.toml's layers contract {declared}"


def test_the_layer_table_reader_reads_rows() -> None:
    table = "## Layers\n\n| layer | modules | why |\n|---|---|---|\n| adapters | `torch`, `tf` | x |\n| base | `_core` | y |\n"
    assert layer_rows(table) == ["torch | tf", "_core"]


# --------------------------------------------------------------------------- 2. privates
def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(module: Module) -> set[str]:
    """The private names ``module`` defines itself: functions, classes, module-level and
    class-level names, ``self._x = ...`` / ``cls._x = ...`` attributes, and names it imports
    under a private alias (``from .rng import mix_seed as _sources.mix``)."""
    names: set[str] = set()

    def targets(node: ast.AST) -> Iterator[ast.AST]:
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                yield from ast.walk(target)

    for node in ast.walk(module.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname for alias in node.names if alias.asname)
        for target in targets(node):
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                    and target.value.id in ("self", "cls"):
                names.add(target.attr)
    # module-level and class-level names (not a function's locals)
    scopes: list[ast.AST] = [module.tree] + [node for node in ast.walk(module.tree) if isinstance(node, ast.ClassDef)]
    for scope in scopes:
        for statement in walk_scope(scope):
            for target in targets(statement):
                if isinstance(target, ast.Name):
                    names.add(target.id)
    return {name for name in names if is_private(name)}


def walk_scope(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of one scope (a module or a class body), not those of the scopes inside it."""
    pending = list(ast.iter_child_nodes(scope))
    while pending:
        node = pending.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))


def module_level_names(module: Module) -> set[str]:
    """Private names at the module's top level (those ``from module import _x`` could mean)."""
    names: set[str] = set()
    for node in walk_scope(module.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(name.id for name in ast.walk(target) if isinstance(name, ast.Name))
    return {name for name in names if is_private(name)}


def attribute_uses(module: Module) -> Iterator[tuple[ast.AST, ast.AST, str]]:
    """``(node, object, attribute name)`` for each ``obj.name`` and each ``getattr`` / ``setattr`` /
    ``hasattr`` / ``delattr(obj, "name", ...)`` with a constant name in ``module``."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Attribute):
            yield node, node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            yield node, node.args[0], node.args[1].value


def private_reads(modules: dict[str, Module]) -> list[str]:
    """``file:line: the expression  (whose private it is)`` for every read or write of another
    procpipe module's private name."""
    known = set(modules)
    own = {name: defined_names(module) for name, module in modules.items()}
    owners: dict[str, set[str]] = {}
    for name, privates in own.items():
        for private in privates:
            owners.setdefault(private, set()).add(name)
    report = []
    for name, module in sorted(modules.items()):
        for node, target, attr in attribute_uses(module):
            if not is_private(attr) or attr in own[name]:
                continue
            if isinstance(target, ast.Name) and target.id in ("self", "cls"):
                continue
            others = sorted(owners.get(attr, ()))
            if others:
                report.append(f"  {where(module, node)}: {ast.unparse(node)}  ({attr} belongs to {', '.join(others)})")
        for node, target, names in imports_of(module, known):
            for imported in names:
                if is_private(imported) and target != name and imported in module_level_names(modules[target]):
                    report.append(f"  {where(module, node)}: from {target} import {imported}")
    return report


def test_no_module_reads_another_modules_privates() -> None:
    report = private_reads(read_modules())
    if report:
        pytest.fail("reads or writes of another procpipe module's private names (give them a public name, "
                    "a property or a method of their owner):\n" + "\n".join(report), pytrace=False)


# --------------------------------------------------------------------------- the checker itself
def _modules_of(sources: dict[str, str]) -> dict[str, Module]:
    modules = {}
    for name, text in sources.items():
        is_package = name in {n.rsplit(".", 1)[0] for n in sources if "." in n}
        path = PACKAGE_DIR.parent / (name.replace(".", "/") + ("/__init__.py" if is_package else ".py"))
        modules[name] = Module(name, path, is_package, ast.parse(text))
    return modules


def test_the_checker_tells_own_privates_from_others() -> None:
    module = Module("procpipe.m", PACKAGE_DIR / "m.py", False, ast.parse(
        "_TABLE = {}\nclass A:\n    _slot = 1\n    def _step(self):\n        self._count = 0\n"
        "        def inner():\n            _local = 2\nfrom .rng import mix as _mix\n"))
    assert defined_names(module) == {"_TABLE", "_slot", "_step", "_count", "_mix"}
    assert module_level_names(module) == {"_TABLE"}


def test_the_checker_finds_private_reads_across_modules() -> None:
    modules = _modules_of({
        "procpipe.owner": "_LIMIT = 3\nclass Loader:\n    def __init__(self):\n        self._epoch = 0\n"
                          "        self._spec = None\n",
        "procpipe.reader": ("from .owner import _LIMIT\n"
                            "def f(loader, other):\n    loader._spec = 1\n    getattr(loader, '_epoch', None)\n"
                            "    other._fields\n    self._spec\n"),
        "procpipe.own": "class It:\n    def __init__(self):\n        self._spec = 1\n"
                        "    def same(self, other):\n        return other._spec\n",
    })
    report = private_reads(modules)
    lines = sorted(line.split(": ", 1)[1] for line in report)
    assert lines == ["from procpipe.owner import _LIMIT",
                     "getattr(loader, '_epoch', None)  (_epoch belongs to procpipe.owner)",
                     "loader._spec  (_spec belongs to procpipe.own, procpipe.owner)"], report
    assert all(line.strip().startswith("procpipe/reader.py:") for line in report), report



# --------------------------------------------------------------------------- 3. the source kind, asked once
#: Where "which kind of source is this?" is answered: ``_sources.resolve`` resolves a Loader's source once
#: (its plan, reader, inline driver, saved-state check); ``_worker.index_producer`` is its worker side.
KIND_MODULES = ("_sources.resolve", "_worker.index_producer")
#: The classes whose ``isinstance`` asks a source's (or its plan's, or its task's) kind.
KIND_CLASSES = {"Shards", "ShardOrder", "MixShardOrder", "Mix", "MixOrder", "IndexOrder", "CallerOrder",
                "Block", "RecordKey"}
#: Attributes whose presence (``hasattr``/``getattr`` with a constant name) tells one kind from another.
KIND_ATTRIBUTES = {"produce_block", "epoch_plan", "mixing", "check_progress", "streaming", "cache_kind"}
#: The other modules that may still test a kind (at most 3), and why.
KIND_TESTS_ALLOWED: dict[str, str] = {
    "_sources.mix.mixture": "a mixture's own tree (nested mixtures), and that its sources are all streams or all indexed",
}
MAX_KIND_TEST_MODULES = 3


def kind_tests(module: Module) -> Iterator[str]:
    """``file:line: expression`` for each place ``module`` asks which kind a source is: ``isinstance``
    against a kind's class, ``hasattr``/``getattr`` of an attribute one kind has and another lacks,
    and ``type(x) is list`` (a task's kind told by its type)."""
    for node in ast.walk(module.tree):
        found = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            if node.func.id == "isinstance":
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                found = any(isinstance(k, ast.Name) and k.id in KIND_CLASSES for k in kinds)
            elif node.func.id in ("hasattr", "getattr"):
                name = node.args[1]
                found = isinstance(name, ast.Constant) and name.value in KIND_ATTRIBUTES
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call):
            call = node.left
            found = (isinstance(call.func, ast.Name) and call.func.id == "type"
                     and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
                     and any(isinstance(c, ast.Name) and c.id == "list" for c in node.comparators))
        if found:
            yield f"  {where(module, node)}: {ast.unparse(node)}"


def kind_test_report(modules: dict[str, Module]) -> list[str]:
    """Every kind test outside ``KIND_MODULES`` and ``KIND_TESTS_ALLOWED``, and a note if the allow-list grew."""
    report = []
    for _name, module in sorted(modules.items()):
        if module.short in KIND_MODULES or module.short in KIND_TESTS_ALLOWED:
            continue
        report.extend(kind_tests(module))
    if len(KIND_TESTS_ALLOWED) > MAX_KIND_TEST_MODULES:
        report.append(f"  KIND_TESTS_ALLOWED lists {len(KIND_TESTS_ALLOWED)} modules; at most {MAX_KIND_TEST_MODULES}")
    return report


def test_the_source_kind_is_tested_in_at_most_3_places() -> None:
    report = kind_test_report(read_modules())
    if report:
        pytest.fail("the source kind is asked outside procpipe/_sources/resolve.py (resolved once: ask the Loader's "
                    "SourceKind, its plan or its reader instead):\n" + "\n".join(report), pytrace=False)


def test_the_kind_checker_finds_every_kind_test() -> None:
    modules = _modules_of({
        "procpipe._sources.resolve": "isinstance(source, Shards)\n",
        "procpipe._sources.mix.mixture": "isinstance(source, Mix)\n",
        "procpipe.loader": ("isinstance(source, (Shards, Mix))\nhasattr(source, 'produce_block')\n"
                            "getattr(sampler, 'epoch_plan', None)\ntype(indices) is not list\n"
                            "isinstance(x, dict)\ntype(x) is tuple\ngetattr(x, 'name', None)\n"),
    })
    lines = [line.split(": ", 1)[1] for line in kind_test_report(modules)]
    assert lines == ["isinstance(source, (Shards, Mix))", "hasattr(source, 'produce_block')",
                     "getattr(sampler, 'epoch_plan', None)", "type(indices) is not list"], lines


# --------------------------------------------------------------------------- 6. the adapters' door
#: The adapters and the bench tools (issue 44): built on the public API and on ``procpipe._ext``, the
#: extension module, never on another internal module (``ray`` is engine code on a cluster: not here).
ADAPTER_PACKAGES = ("torch", "jax", "tf", "keras", "readers", "bench")
#: What an adapter may import of procpipe: the public modules, the extension module, the adapters.
ADAPTER_MAY_IMPORT = ("procpipe", "config", "errors", "loader", "_ext", "ray", *ADAPTER_PACKAGES)
_IMPORTERS = {"import_module", "__import__"}


def adapter_report(modules: dict[str, Module]) -> list[str]:
    """``file:line: module imports target`` for each internal import of an adapter: every ``import``
    (top-level, in a function, under ``TYPE_CHECKING``) and each ``import_module("procpipe._x")``."""
    known = set(modules)

    def allowed(short: str) -> bool:
        return short in ADAPTER_MAY_IMPORT or short.split(".")[0] in ADAPTER_PACKAGES

    report = []
    for _name, module in sorted(modules.items()):
        if module.short.split(".")[0] not in ADAPTER_PACKAGES:
            continue
        for node, target, _ in imports_of(module, known):
            short = modules[target].short
            if not allowed(short):
                report.append(f"  {where(module, node)}: {module.short} imports {short}")
        for node in ast.walk(module.tree):
            if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str) and node.args[0].value.startswith(PACKAGE + ".")
                    and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in _IMPORTERS):
                short = node.args[0].value[len(PACKAGE) + 1:]
                if not allowed(short):
                    report.append(f"  {where(module, node)}: {module.short} imports {short} (by name)")
    return list(dict.fromkeys(report))  # once per line and module (``from x import a, b`` is one import)


def test_adapters_use_only_the_public_api_and_the_extension_module() -> None:
    report = adapter_report(read_modules())
    if report:
        pytest.fail("an adapter (or procpipe.bench) imports an internal module other than procpipe._ext (add what "
                    "it needs to procpipe/_ext.py and import it from there):\n" + "\n".join(report), pytrace=False)


def test_the_adapter_checker_finds_every_internal_import() -> None:
    modules = _modules_of({
        "procpipe": "from ._core.rng import sample_rng\n",
        "procpipe._ext": "from ._core.rng import sample_rng\n",
        "procpipe._core": "",
        "procpipe._core.rng": "",
        "procpipe._engine": "",
        "procpipe._engine.policy": "",
        "procpipe.loader": "",
        "procpipe.torch": ("from .._ext import sample_rng\nfrom .. import Shards\nfrom ..loader import Loader\n"
                           "from . import device\nfrom .._core.rng import sample_rng\n"),
        "procpipe.torch.device": ("def f():\n    from .._engine import policy\n"
                                  "def g():\n    import importlib\n    importlib.import_module('procpipe._core.rng')\n"
                                  "    importlib.import_module('procpipe.loader')\n"),
        "procpipe.bench": "if TYPE_CHECKING:\n    import procpipe._core.rng\n",
    })
    lines = sorted(line.split(": ", 1)[1] for line in adapter_report(modules))
    assert lines == ["bench imports _core.rng", "torch imports _core.rng", "torch.device imports _core.rng (by name)",
                     "torch.device imports _engine.policy"], lines




# --------------------------------------------------------------------------- 4. one name, one concept
def repeated_module_names(paths: list[Path]) -> dict[str, list[str]]:
    """Module file names (``__init__.py`` aside) that stand in more than one package, with where."""
    where_named: dict[str, list[str]] = {}
    for path in paths:
        if path.name != "__init__.py":
            where_named.setdefault(path.name, []).append(str(path.parent.relative_to(PACKAGE_DIR.parent)))
    return {name: places for name, places in sorted(where_named.items()) if len(places) > 1}


def test_no_module_name_stands_for_two_concepts() -> None:
    """A module's name says the one thing it holds: ``kinds.py`` in three packages meant three things."""
    repeated = repeated_module_names(sorted(PACKAGE_DIR.rglob("*.py")))
    assert not repeated, f"module names used in more than one package (name each by what it holds): {repeated}"


def repeated_class_names(modules: dict[str, Module]) -> dict[str, list[str]]:
    """Class names defined in more than one module (nested classes included), with where."""
    where_defined: dict[str, list[str]] = {}
    for name, module in sorted(modules.items()):
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef):
                where_defined.setdefault(node.name, []).append(name)
    return {cls: places for cls, places in sorted(where_defined.items()) if len(set(places)) > 1}


def test_no_class_name_stands_for_two_concepts() -> None:
    """Two classes named ``EpochIterator`` (the Loader's and the torch facade's) were two concepts."""
    repeated = repeated_class_names(read_modules())
    assert not repeated, f"class names defined in more than one module (name each by what it is): {repeated}"


def test_the_class_name_checker_finds_a_repeated_class() -> None:
    modules = _modules_of({"procpipe.a": "class Batching:\n    pass\n", "procpipe.b": "class Batching:\n    pass\n",
                           "procpipe.c": "class Order:\n    pass\n"})
    assert repeated_class_names(modules) == {"Batching": ["procpipe.a", "procpipe.b"]}


def test_the_name_checker_finds_a_repeated_name() -> None:
    root = PACKAGE_DIR
    paths = [root / "a" / "state.py", root / "b" / "state.py", root / "a" / "__init__.py", root / "b" / "__init__.py",
             root / "c" / "plan.py"]
    assert repeated_module_names(paths) == {"state.py": ["procpipe/a", "procpipe/b"]}


#: A module longer than this is worth a look in review: does it hold two concepts? It is a warning,
#: printed, not a failure: a concept is not split to fit a line count.
REVIEW_LINES = 800


def long_modules() -> list[str]:
    """``procpipe/x.py: N lines`` for each module over ``REVIEW_LINES``."""
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > REVIEW_LINES:
            found.append(f"{path.relative_to(PACKAGE_DIR.parent)}: {lines} lines")
    return found


def test_long_modules_are_reported_for_review() -> None:
    """Modules over REVIEW_LINES lines are printed as a warning (``pytest -rw`` shows it)."""
    import warnings

    found = long_modules()
    if found:
        warnings.warn(f"modules over {REVIEW_LINES} lines, to look at in review: {found}", UserWarning, stacklevel=1)
