"""The extension API (``procpipe._ext``) and the device-stage registry behind ``Loader(device=...)``.

``procpipe._ext`` is what the adapters use of procpipe's internals (``tests/test_architecture.py``
checks they use nothing else); importing it imports no framework. ``device=`` finds its stage
through the registry (``procpipe/_consumer/device_stages.py``): a registered factory, else the
entry point of the group ``procpipe.device_stages``, else an error that says how to get one.
"""

from __future__ import annotations

import ast
import pathlib
import sys
import textwrap

import numpy as np
import pytest
import tomllib
from conftest import REPO_ROOT, run_python

import procpipe
from procpipe import _ext
from procpipe._consumer import device_stages

ROOT = pathlib.Path(REPO_ROOT)
FRAMEWORKS = ("torch", "tensorflow", "jax", "keras")


class FakeStage:
    """A device stage that needs no framework: each batch's arrays doubled, in the consumer's thread."""

    slots_held = 0

    def __init__(self, device, prefetch, device_fn, seed) -> None:
        self.device, self.calls = device, 0

    def __call__(self, it):
        def moved(batch):
            self.calls += 1
            return ("moved", self.device, np.asarray(batch) * 2)

        return _ext.Mapped(it, moved)

    def info(self) -> dict[str, int]:
        return {"fake_batches": self.calls}

    def close(self) -> None:
        pass


@pytest.mark.unit
def test_a_registered_factory_serves_device_and_is_restored() -> None:
    before = _ext.register_device_stage("torch", FakeStage)
    try:
        with procpipe.Loader(range(8), batch_size=4, workers=0, device="cpu") as loader:
            batches = list(loader)
            assert loader.stats()["device"] == {"fake_batches": 2}
        assert [(tag, device, b.tolist()) for tag, device, b in batches] == [
            ("moved", "cpu", [0, 2, 4, 6]),
            ("moved", "cpu", [8, 10, 12, 14]),
        ]
    finally:
        _ext.register_device_stage("torch", before)
    assert device_stages._factories.get("torch") is before  # put back (None: none was registered)


@pytest.mark.unit
def test_without_a_stage_device_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_stages, "_factories", {})
    monkeypatch.setattr(device_stages.metadata, "entry_points", lambda group: [])
    with pytest.raises(RuntimeError, match=r"pip install 'procpipe\[torch\]'.*import procpipe\.torch"):
        procpipe.Loader(range(8), batch_size=4, workers=0, device="cpu")


@pytest.mark.unit
def test_the_torch_stage_is_declared_as_an_entry_point_that_exists() -> None:
    with open(ROOT / "pyproject.toml", "rb") as f:
        points = tomllib.load(f)["project"]["entry-points"][device_stages.ENTRY_POINT_GROUP]
    module, _, name = points["torch"].partition(":")
    path = ROOT / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, points
    registers = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "register_device_stage"]
    assert registers, f"{path.name} does not register its stage when imported"


@pytest.mark.unit
def test_no_core_module_names_an_adapter_in_a_string() -> None:
    """The core finds the torch stage through the registry, never by the adapter's module name."""
    adapters = ("procpipe.torch", "procpipe.jax", "procpipe.tf", "procpipe.keras", "procpipe.ray")
    found = []
    for path in sorted((ROOT / "procpipe").rglob("*.py")):
        part = path.relative_to(ROOT / "procpipe").parts[0]
        if part in ("torch", "jax", "tf", "keras", "ray", "readers", "bench"):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and any(node.value == a or node.value.startswith(a + ".") for a in adapters)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    # the zygote imports the torch adapter beside torch, ahead of a worker's need (not device=)
    allowed = {"procpipe/_worker/zygote.py"}
    assert [f for f in found if f.split(":")[0] not in allowed] == []


def test_importing_the_extension_api_imports_no_framework() -> None:
    code = textwrap.dedent(f"""
        import sys
        import procpipe._ext as ext
        loaded = [m for m in {FRAMEWORKS!r} if m in sys.modules]
        assert not loaded, f"import procpipe._ext imported {{loaded}}"
        assert set(ext.__all__) <= set(dir(ext)), set(ext.__all__) - set(dir(ext))
        missing = [n for n in ext.__all__ if n not in ext._NEED_TORCH and not hasattr(ext, n)]
        assert not missing, missing
        loaded = [m for m in {FRAMEWORKS!r} if m in sys.modules]
        assert not loaded, f"procpipe._ext's eager names imported {{loaded}}"
        print("ok")
    """)
    done = run_python(["-c", code], timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_a_registered_stage_serves_device_without_importing_torch() -> None:
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import procpipe
        from procpipe._ext import Mapped, register_device_stage

        class Stage:
            slots_held = 0
            def __init__(self, device, prefetch, device_fn, seed):
                self.device = device
            def __call__(self, it):
                return Mapped(it, lambda batch: ("moved", self.device, np.asarray(batch).tolist()))
            def info(self):
                return {}
            def close(self):
                pass

        before = register_device_stage("torch", Stage)
        try:
            with procpipe.Loader(range(8), batch_size=4, workers=0, device="cpu") as loader:
                got = list(loader)
        finally:
            register_device_stage("torch", before)
        assert got == [("moved", "cpu", [0, 1, 2, 3]), ("moved", "cpu", [4, 5, 6, 7])], got
        assert "torch" not in sys.modules, "device= imported torch although a stage was registered"
        print("ok")
    """)
    done = run_python(["-c", code], timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_the_torch_stage_registers_itself_on_import() -> None:
    pytest.importorskip("torch", reason="procpipe[torch]")
    code = textwrap.dedent("""
        import procpipe.torch.device as d
        from procpipe._consumer import device_stages
        assert device_stages.device_stage_factory("torch") is d.device_stage
        print("ok")
    """)
    done = run_python(["-c", code], timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
