"""The package's shape, checked from its source text (``ast``; procpipe is never imported).

Three rules, each reporting every offender at once (and ``test_plans_are_pure``: the
per-epoch plans import no process, thread or clock API;
``test_long_modules_are_reported_for_review``: a warning, not a failure, for a module over 800
lines; and ``test_the_source_kind_is_tested_in_at_most_3_places``: "which kind of source is this?" is
answered once, by ``_consumer/kinds.py``; and ``test_adapters_use_only_the_public_api_and_the_extension_module``:
the adapters and ``procpipe.bench`` import, of procpipe, only its public modules, ``procpipe._ext`` and
each other):

1. **No import circles.** Every import of a procpipe module counts: top-level, inside a
   function, and under ``if TYPE_CHECKING:`` (a circle that exists only for type hints is
   still two modules that each need the other to be read). ``from . import wire`` is an
   edge to ``procpipe.wire``; ``from ._streaming import Shards`` is an edge to the package
   ``procpipe._streaming`` (whose ``__init__`` is a module of its own). Importing a
   submodule also runs its parent packages' ``__init__``; that implicit edge is not
   counted, since every module would then depend on ``procpipe`` itself.
2. **Layers.** Every module belongs to one layer of ``LAYERS`` (the same table as in
   ARCHITECTURE.md); a module may import its own layer and the layers below it, never a
   layer above. A new module must be added to the table.
3. **No reading another module's privates.** ``expr._name`` (not a dunder), where ``expr``
   is not ``self``/``cls`` and ``_name`` is not defined by the module itself but is defined
   by another procpipe module, reads (or writes) that module's internals: give it a public
   name, a property or a method instead. ``from .x import _name`` and ``getattr(obj, "_name")``
   (``setattr``, ``hasattr``, ``delattr``) count too. Third-party privates
   (``torch.utils.data._utils``, ``dill._dill``) are out of scope. A module's own private
   names are not checked at all (``other._x`` in a class that sets ``self._x`` is its own
   business), so a reader that happens to define the same private name is not caught.

Why the layers are what they are (bottom to top). The internal layers are ``_``-prefixed
packages (``_core/``, ``_worker/``, ``_plan/``, ``_engine/``, ``_consumer/``), so the table names
them by folder; the packages of one concept span layers (``_streaming``, one source kind, and
``_mix``, the mixture: their plans in ``plan``, their consumer side in ``consumer``), and the
top-level public modules are listed by name:

- ``base`` (``_core/``, ``errors``, ``config``): leaves that know nothing of processes or epochs:
  argument checks and the configuration, the ring and files (``shm``), collation, RNG, delivery
  order (``reassembly``), the wire.
- ``worker`` (``_worker/``): what runs in a worker process: the process's loop, producing a
  batch, the cache, starting it (``start_method``, ``preload``), and ``Records`` (read by
  ``fn`` in workers).
- ``plan`` (``_plan/``, the plans of ``_streaming`` and ``_mix``): which work an epoch holds,
  with no processes: the sampler, the plan contract (``_plan.base``) and its kinds
  (``_plan.index``, ``_streaming.shard_plan``, ``_mix.mix``), and the streaming source's blocks,
  interleave and batching. ``_streaming.shards`` and ``_streaming.batching`` use ``produce`` (a
  block is read and collated the same way in a worker and in the loader's process), so
  ``plan`` sits above ``worker``.
- ``engine`` (``_engine/``): ``epochs`` (an epoch's jobs, slots and counters around its plan,
  the stream's queue), the coordinator thread, the worker pool, faults, autotune, starting it all.
- ``consumer`` (``_consumer/``, ``loader``): what the user's loop touches: ``Loader``, the
  consumer-side nodes (its iterators), the saved state and resume, and the streaming plan and
  mixture positions the Loader drives; ``procpipe`` (the package) exports ``Loader``.
  ``_ext``, the extension module, re-exports what the adapters use of every layer below, so it
  sits at the top of this one.
- ``adapters``: built on the public API (and ``_ext``) and never imported by it: the torch package
  (its facade and ``Loader(device=...)``'s stage, found through the device-stage registry), Keras,
  tf.data, the bench tools, Ray, the readers (``readers.*``: open_fn for Shards over files and URLs).

A module listed here but absent from the tree is ignored, so that modules can be added in
one branch and listed in another.
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

#: layer name -> modules (without the ``procpipe.`` prefix; ``procpipe`` is the package
#: itself, ``bench.*`` the package ``bench`` and every module under it), bottom to top.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("errors", "_core.*", "config"),
    "worker": ("_worker.*",),
    "plan": ("_plan.*", "_streaming.shards", "_streaming.blocks", "_streaming.order", "_streaming.batching",
             "_streaming.shard_plan", "_streaming.even_ranks", "_mix", "_mix.mix", "_mix.kinds"),
    "engine": ("_engine.*",),
    "consumer": ("_consumer.*", "_mix.mixing", "_mix.virtual", "_mix.elastic", "_streaming.plan", "_streaming", "loader",
                 "procpipe", "_ext"),
    "adapters": ("torch", "torch.*", "keras", "keras.*", "tf", "tf.*", "jax", "jax.*", "bench.*", "ray", "ray.*",
                 "readers.*"),
}


# --------------------------------------------------------------------------- reading the tree
@dataclass(frozen=True)
class Module:
    """One ``.py`` file of the package, parsed."""

    name: str  # dotted, e.g. "procpipe._streaming.plan"; a package's __init__ is the package's name
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


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    line: str


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


def import_graph(modules: dict[str, Module]) -> dict[str, dict[str, Edge]]:
    """module -> {imported module -> the first place it is imported}."""
    known = set(modules)
    graph: dict[str, dict[str, Edge]] = {name: {} for name in modules}
    for module in modules.values():
        for node, target, _ in imports_of(module, known):
            if target != module.name:
                graph[module.name].setdefault(target, Edge(module.name, target, where(module, node)))
    return graph


# --------------------------------------------------------------------------- 1. circles
def strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Tarjan's components of more than one module (the import circles), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def a_circle(graph: dict[str, dict[str, Edge]], component: list[str]) -> list[Edge]:
    """One concrete circle through the component's first module (breadth-first, so shortest)."""
    members = set(component)
    start = component[0]
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target, edge in sorted(graph[node].items()):
                if target not in members:
                    continue
                if target == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                if target not in came:
                    came[target] = edge
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle through {start}")  # a component of > 1 always has one


def test_no_import_circles() -> None:
    graph = import_graph(read_modules())
    report = []
    for component in strongly_connected(graph):
        circle = a_circle(graph, component)
        lines = [f"  {edge.source} -> {edge.target}   ({edge.line})" for edge in circle]
        report.append(f"circle among {', '.join(component)}:\n" + "\n".join(lines))
    if report:
        pytest.fail("import circles (every import counts, TYPE_CHECKING ones too):\n" + "\n".join(report),
                    pytrace=False)


# --------------------------------------------------------------------------- 2. layers
def layer_of() -> dict[str, int]:
    """Short module name (or ``name.*`` pattern) -> its layer's height."""
    table: dict[str, int] = {}
    for height, members in enumerate(LAYERS.values()):
        for member in members:
            assert member not in table, f"{member} is in two layers of LAYERS"
            table[member] = height
    return table


def height_of(short: str, table: dict[str, int]) -> int | None:
    if short in table:
        return table[short]
    parts = short.split(".")
    for cut in range(len(parts), 0, -1):
        pattern = ".".join(parts[:cut]) + ".*"
        if pattern in table:
            return table[pattern]
    return None


def test_every_module_has_a_layer() -> None:
    table = layer_of()
    missing = [module.short for module in read_modules().values() if height_of(module.short, table) is None]
    if missing:
        pytest.fail(f"modules in no layer: {', '.join(missing)}; add it to the table LAYERS in "
                    "tests/test_architecture.py (and to ARCHITECTURE.md's layer table)", pytrace=False)


def test_no_layer_imports_upward() -> None:
    modules = read_modules()
    table = layer_of()
    names = list(LAYERS)
    report = []
    for source, targets in sorted(import_graph(modules).items()):
        low = height_of(modules[source].short, table)
        for target, edge in sorted(targets.items()):
            high = height_of(modules[target].short, table)
            if low is not None and high is not None and high > low:
                report.append(f"  {edge.line}: {modules[source].short} ({names[low]}) imports "
                              f"{modules[target].short} ({names[high]})")
    if report:
        pytest.fail("imports from a lower layer to a higher one (LAYERS, bottom to top: "
                    f"{', '.join(LAYERS)}):\n" + "\n".join(report), pytrace=False)


#: The per-epoch plans and what they use: pure bookkeeping, run in whichever thread drives
#: them. They must not start, wait for or talk to anything (issue: "plan/: pure, no processes").
PURE_PLANS = ("_plan.sampler", "_plan.base", "_plan.index", "_streaming.shard_plan", "_streaming.order")
NOT_PURE = {"os", "threading", "multiprocess", "multiprocessing", "queue", "select", "selectors", "signal",
            "socket", "subprocess", "time", "concurrent", "asyncio", "psutil"}


def test_plans_are_pure() -> None:
    modules = read_modules()
    known = set(modules)
    report = []
    for short in PURE_PLANS:
        module = modules[f"{PACKAGE}.{short}"]
        for tree in ast.walk(module.tree):
            names = ([a.name for a in tree.names] if isinstance(tree, ast.Import)
                     else [tree.module or ""] if isinstance(tree, ast.ImportFrom) and not tree.level else [])
            for name in names:
                if name.split(".")[0] in NOT_PURE:
                    report.append(f"{where(module, tree)}: imports {name}")
    assert known and not report, "a plan module imports a process, thread or clock API:\n" + "\n".join(report)


def test_architecture_md_shows_the_same_layers() -> None:
    """ARCHITECTURE.md's layer table is this one: ``| layer | `module`, ... | why |`` rows, in order."""
    text = (PACKAGE_DIR.parent / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    shown: dict[str, tuple[str, ...]] = {}
    for row in section.splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] in LAYERS:
            shown[cells[0]] = tuple(name.strip().strip("`") for name in cells[1].split(","))
    assert list(shown.items()) == list(LAYERS.items()), (
        "ARCHITECTURE.md's layer table (section 'Layers') and LAYERS in tests/test_architecture.py differ")


# --------------------------------------------------------------------------- 3. privates
def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_names(module: Module) -> set[str]:
    """The private names ``module`` defines itself: functions, classes, module-level and
    class-level names, ``self._x = ...`` / ``cls._x = ...`` attributes, and names it imports
    under a private alias (``from .rng import mix_seed as _mix``)."""
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


def _graph_of(sources: dict[str, str]) -> dict[str, dict[str, Edge]]:
    return import_graph(_modules_of(sources))


def test_the_checker_sees_every_kind_of_import() -> None:
    graph = _graph_of({
        "procpipe": "from .loader import Loader\nfrom .sub import thing\n",
        "procpipe.loader": "from . import wire\nif TYPE_CHECKING:\n    from .sub.deep import X\n",
        "procpipe.wire": "def f():\n    import procpipe.sub.deep\n",
        "procpipe.sub": "from .deep import Y\nfrom .. import wire\n",
        "procpipe.sub.deep": "from ..loader import Loader\nimport numpy\n",
    })
    assert set(graph["procpipe"]) == {"procpipe.loader", "procpipe.sub"}
    assert set(graph["procpipe.loader"]) == {"procpipe.wire", "procpipe.sub.deep"}
    assert set(graph["procpipe.wire"]) == {"procpipe.sub.deep"}
    assert set(graph["procpipe.sub"]) == {"procpipe.sub.deep", "procpipe.wire"}
    assert set(graph["procpipe.sub.deep"]) == {"procpipe.loader"}
    circles = strongly_connected(graph)
    assert circles == [["procpipe.loader", "procpipe.sub.deep", "procpipe.wire"]]
    path = [edge.source for edge in a_circle(graph, circles[0])]
    assert path == ["procpipe.loader", "procpipe.sub.deep"]  # the shortest: loader -> deep -> loader


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



# --------------------------------------------------------------------------- 5. the adapters' door
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


# --------------------------------------------------------------------------- 4. the source kind, asked once
#: Where "which kind of source is this?" is answered: ``_consumer.kinds`` resolves a Loader's source once
#: (its plan, reader, inline driver, saved-state check); ``worker.reader`` is its worker side.
KIND_MODULES = ("_consumer.kinds", "_worker.reader")
#: The classes whose ``isinstance`` asks a source's (or its plan's, or its task's) kind.
KIND_CLASSES = {"Shards", "StreamPlan", "MixStreamPlan", "Mix", "MixSampler", "Sampler", "ExplicitBatches",
                "Block", "RecordKey"}
#: Attributes whose presence (``hasattr``/``getattr`` with a constant name) tells one kind from another.
KIND_ATTRIBUTES = {"produce_block", "plan_class", "mixing", "check_progress", "streaming", "cache_kind"}
#: The other modules that may still test a kind (at most 3), and why.
KIND_TESTS_ALLOWED: dict[str, str] = {
    "_mix.mix": "a mixture's own tree (nested mixtures), and that its sources are all streams or all indexed",
    "_consumer.state": "the position format (a stream's progress or an index plan's), for any sampler it is given",
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
        pytest.fail("the source kind is asked outside procpipe/_consumer/kinds.py (resolved once: ask the Loader's "
                    "SourceKind, its plan or its reader instead):\n" + "\n".join(report), pytrace=False)


def test_the_kind_checker_finds_every_kind_test() -> None:
    modules = _modules_of({
        "procpipe._consumer.kinds": "isinstance(source, Shards)\n",
        "procpipe._mix.mix": "isinstance(source, Mix)\n",
        "procpipe.loader": ("isinstance(source, (Shards, Mix))\nhasattr(source, 'produce_block')\n"
                            "getattr(sampler, 'plan_class', None)\ntype(indices) is not list\n"
                            "isinstance(x, dict)\ntype(x) is tuple\ngetattr(x, 'name', None)\n"),
    })
    lines = [line.split(": ", 1)[1] for line in kind_test_report(modules)]
    assert lines == ["isinstance(source, (Shards, Mix))", "hasattr(source, 'produce_block')",
                     "getattr(sampler, 'plan_class', None)", "type(indices) is not list"], lines


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


if __name__ == "__main__":  # pragma: no cover - a quick look at the graph
    graph = import_graph(read_modules())
    for source, targets in sorted(graph.items()):
        print(source, "->", ", ".join(sorted(targets)))
    for component in strongly_connected(graph):
        print("circle:", " -> ".join(edge.source for edge in a_circle(graph, component)))
