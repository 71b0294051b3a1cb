"""The extras install what they say, and every message that names one names the right one.

pyproject.toml's optional dependencies are read as pip reads them (markers evaluated for this
machine); every extra (``procpipe[...]``) that a test's skip reason, procpipe's messages or the docs
name must exist, and a test skipped for want of a module must name an extra that installs it.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import tomllib
from conftest import REPO_ROOT

pytestmark = pytest.mark.unit  # starts no process: `python -m pytest -m unit` (tests/conftest.py)

requirements = pytest.importorskip("packaging.requirements", reason="packaging (a dependency of pytest) reads them")

ROOT = pathlib.Path(REPO_ROOT)
_NAMED = re.compile(r"procpipe\[([a-z][\w,-]*)\]")
# The distributions that provide a module (a module not listed: the distribution of its name).
PROVIDERS = {"tensorflow": {"tensorflow", "tensorflow-cpu"}, "procpipe.torch": {"torch"}, "google_crc32c": {"google-crc32c"}}


def _extras() -> dict[str, set[str]]:
    """Each extra's distributions, as pip would install them here (markers evaluated)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    out = {}
    for name, reqs in extras.items():
        parsed = [requirements.Requirement(r) for r in reqs]
        out[name] = {r.name.lower() for r in parsed if r.marker is None or r.marker.evaluate()}
    return out


def _provides(extra: set[str], module: str) -> bool:
    return bool(PROVIDERS.get(module, {module.split(".")[0]}) & extra)


def _texts() -> dict[str, str]:
    paths = [*ROOT.glob("tests/*.py"), *ROOT.glob("procpipe/**/*.py"), *ROOT.glob("docs/**/*.md"), ROOT / "README.md"]
    return {str(p.relative_to(ROOT)): p.read_text() for p in paths}


def test_every_extra_named_exists():
    extras = _extras()
    unknown = [f"{where}: procpipe[{names}]" for where, text in _texts().items() for names in _NAMED.findall(text)
               if any(n not in extras for n in names.split(","))]
    assert unknown == []


def test_a_skipped_test_names_an_extra_that_installs_what_it_lacks():
    extras = _extras()
    wrong = []
    for path in sorted(ROOT.glob("tests/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args):
                continue
            module = node.args[0].value if isinstance(node.args[0], ast.Constant) else None
            reason = next((k.value.value for k in node.keywords if k.arg == "reason" and isinstance(k.value, ast.Constant)), "")
            for names in _NAMED.findall(str(reason)):
                if not any(_provides(extras.get(n, set()), str(module)) for n in names.split(",")):
                    wrong.append(f"{path.name}: importorskip({module!r}) says procpipe[{names}]")
    assert wrong == []
    from test_keras_backends import EXTRAS  # (its skips name the extra of each backend's package)

    assert {package: _provides(extras[extra], package) for package, extra in EXTRAS.items()} == dict.fromkeys(EXTRAS, True)


def test_tf_does_not_pull_the_full_tensorflow_wheel_where_a_cpu_build_exists():
    """On Linux x86_64, [tf] asks for tensorflow-cpu: asking for tensorflow would install the 572 MB
    wheel over an installed tensorflow-cpu (pip does not know one stands for the other)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        tf = [requirements.Requirement(r) for r in tomllib.load(f)["project"]["optional-dependencies"]["tf"]]
    linux_x86 = {"sys_platform": "linux", "platform_machine": "x86_64"}
    mac_arm = {"sys_platform": "darwin", "platform_machine": "arm64"}
    on = {name: {r.name for r in tf if r.marker is None or r.marker.evaluate(env)}
          for name, env in (("linux_x86", linux_x86), ("mac_arm", mac_arm))}
    assert on == {"linux_x86": {"tensorflow-cpu", "keras"}, "mac_arm": {"tensorflow", "keras"}}
    assert {"jax", "flax", "optax", "orbax-checkpoint"} <= _extras()["jax"]
