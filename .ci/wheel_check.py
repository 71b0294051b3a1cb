"""Checks of procpipe as a user gets it, for .ci/wheel_check.sh (no third-party imports).

``python .ci/wheel_check.py contents DIST REPO``: the sdist and the wheel in ``DIST`` hold what they
should: the wheel every file git tracks under ``procpipe/`` (``py.typed`` included) and nothing
else of the repository (no tests, docs, examples, benchmarks); the sdist what a rebuild needs
(``pyproject.toml``, ``procpipe/``, ``README.md``, ``LICENSE``) and ``CHANGELOG.md``, without the tests.

``python -I .ci/wheel_check.py smoke REPO`` (run by the venv the wheel was installed into, from a
directory outside the clone): ``procpipe`` is imported from that venv, not from the clone;
``procpipe.__version__`` is the installed metadata's version; ``py.typed`` is installed; every module
imports (those that need an absent optional framework excepted); worker processes start and
deliver; the README's quick start (word for word) and ``examples/dict_preprocessing.py`` run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

#: the optional frameworks an adapter module may need (procpipe's extras); absent in the smoke venv
OPTIONAL = (
    "torch",
    "tensorflow",
    "keras",
    "jax",
    "flax",
    "optax",
    "orbax",
    "ray",
    "fsspec",
    "pyarrow",
    "google",
    "google_crc32c",
    "webdataset",
    "matplotlib",
    "grain",
)


def fail(message: str) -> None:
    print(f"CI FAILED (package): {message}", file=sys.stderr)
    sys.exit(1)


def tracked_package_files(repo: Path) -> set[str]:
    """Every file git tracks under procpipe/ (a module or data file the wheel must carry)."""
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "procpipe"], check=True, capture_output=True, text=True
    ).stdout
    return set(out.split())


def contents(dist: Path, repo: Path) -> None:
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        fail(f"expected one wheel and one sdist in {dist}, found {[p.name for p in dist.iterdir()]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = [n for n in wheel.namelist() if not n.endswith("/")]
    dist_info = [n for n in names if n.split("/")[0].endswith(".dist-info")]
    package = {n for n in names if n.startswith("procpipe/")}
    stray = sorted(set(names) - set(dist_info) - package)
    if stray:
        fail(f"the wheel holds files outside procpipe/ and its .dist-info (tests? docs?): {stray[:10]}")
    missing = sorted(tracked_package_files(repo) - package)
    if missing:
        fail(f"files git tracks under procpipe/ are missing from the wheel: {missing}")
    if "procpipe/py.typed" not in package:
        fail("the wheel has no procpipe/py.typed (PEP 561)")
    with tarfile.open(sdists[0]) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if m.isfile() and "/" in m.name}
    needed = {"pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "procpipe/__init__.py", "procpipe/py.typed"}
    if needed - members:
        fail(f"the sdist lacks {sorted(needed - members)}")
    tests = sorted(m for m in members if m.startswith(("tests/", "docs/")))
    if tests:
        fail(f"the sdist holds part of tests/ or docs/ (MANIFEST.in prunes them): {tests[:5]}")
    print(
        f"package contents: {wheels[0].name} ({len(package)} files under procpipe/, py.typed), "
        f"{sdists[0].name} ({len(members)} files)"
    )


def quick_start(readme: Path) -> str:
    """The first python code block of the README's "Quick start" section."""
    section = readme.read_text(encoding="utf-8").split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    if block is None:
        fail("README.md's Quick start section has no python code block")
    return block.group(1)


def run_script(path: Path, expect: str | None = None) -> None:
    """``path`` run as a user runs it (its own interpreter, isolated: no clone on its sys.path)."""
    result = subprocess.run([sys.executable, "-I", str(path)], capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0 or (expect is not None and expect not in result.stdout):
        fail(
            f"{path.name} exited {result.returncode} (expected {expect!r} in its output)\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    print(f"ran {path.name} with the installed wheel")


def smoke(repo: Path) -> None:
    import importlib
    import importlib.metadata
    import importlib.resources
    import pkgutil
    import sysconfig

    import procpipe

    where = Path(procpipe.__file__).resolve()
    if where.is_relative_to(repo.resolve()) or not where.is_relative_to(Path(sysconfig.get_path("purelib")).resolve()):
        fail(f"procpipe was imported from {where}, not from the venv the wheel was installed into")
    installed = importlib.metadata.version("procpipe")
    if procpipe.__version__ != installed:
        fail(f"procpipe.__version__ is {procpipe.__version__!r}, the installed metadata says {installed!r}")
    if not importlib.resources.files("procpipe").joinpath("py.typed").is_file():
        fail("py.typed is not installed")
    skipped = []
    for module in pkgutil.walk_packages(procpipe.__path__, "procpipe."):
        if module.name.endswith(".__main__"):
            continue
        try:
            importlib.import_module(module.name)
        except ImportError as error:
            if (error.name or "").split(".")[0] not in OPTIONAL:
                fail(f"{module.name} does not import from the wheel: {error!r}")
            skipped.append(module.name)
    print(
        f"procpipe {procpipe.__version__} from {where.parent}; every module imports, but those that "
        f"need an optional framework absent here: {', '.join(skipped)}"
    )

    with procpipe.Loader(list(range(12)), _pid, batch_size=2, workers=2) as loader:
        pids = {int(pid) for batch in loader for pid in batch}
    if not pids or os.getpid() in pids:
        fail(f"the batches did not come from worker processes (pids {pids}, this process {os.getpid()})")
    print(f"worker processes started and delivered ({len(pids)} pids)")

    here = Path.cwd()
    (here / "quick_start.py").write_text(quick_start(repo / "README.md"), encoding="utf-8")
    run_script(here / "quick_start.py")
    example = here / "dict_preprocessing.py"
    example.write_text((repo / "examples" / "dict_preprocessing.py").read_text(encoding="utf-8"), encoding="utf-8")
    run_script(example, expect="identical output with 1 and 2 workers: yes")


def _pid(_: int) -> int:
    return os.getpid()


if __name__ == "__main__":
    if sys.argv[1:2] == ["contents"] and len(sys.argv) == 4:
        contents(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1:2] == ["smoke"] and len(sys.argv) == 3:
        smoke(Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
