"""Running a generated benchmark script in a fresh interpreter (bench/cold_start.py, bench/startup.py).

A start-up benchmark must time a process that has imported nothing yet, so each repetition
is a subprocess; this runs one, with this checkout first on its ``PYTHONPATH`` and a neutral
working directory, and returns the JSON object its last line of output holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile


def run_script(python: str, path: str, args: list[str], *, timeout: float, what: str) -> dict:
    """Runs ``python path *args``; its last stdout line parsed as JSON, or exits naming ``what`` failed."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [python, path, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=tempfile.gettempdir(),
        check=False,  # the failure is raised below, with the child's stderr
    )
    if out.returncode != 0:
        raise SystemExit(f"{what} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])
