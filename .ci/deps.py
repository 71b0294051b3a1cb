"""Print, one per line, the third-party requirements of procpipe and of the extras named on the
command line (pyproject.toml; an extra that names ``procpipe[...]`` is followed), so that .ci/run
can install an environment's large dependencies in the background before procpipe itself."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
extras: dict[str, list[str]] = project.get("optional-dependencies", {})


def requirements(names: list[str], seen: set[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        if name in seen:
            continue
        if name not in extras:
            raise SystemExit(f".ci/deps.py: pyproject.toml has no extra {name!r}")
        seen.add(name)
        for requirement in extras[name]:
            own = re.fullmatch(r"procpipe\[([^\]]+)\]", requirement.replace(" ", ""))
            out.extend(requirements(own.group(1).split(","), seen) if own else [requirement])
    return out


found = [*project["dependencies"], *requirements(sys.argv[1:], set())]
print("\n".join(dict.fromkeys(found)))
