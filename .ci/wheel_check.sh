#!/usr/bin/env bash
# procpipe as a user gets it: build the sdist and the wheel from the files git tracks, check them
# (twine check --strict, no deprecation warning in the build, the contents), install the wheel (not
# editable) into a fresh venv and, from a directory outside the clone, run the import smoke test
# and the README's quick start (.ci/wheel_check.py). Run by .ci/run; alone: bash .ci/wheel_check.sh
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The tracked files only (what a clean clone holds: no venv, egg-info or build/ of an earlier step).
mkdir "$work/src"
git -C "$repo" ls-files -z | (cd "$repo" && xargs -0 tar cf -) | tar xf - -C "$work/src"

python3 -m venv "$work/tools"
"$work/tools/bin/python" -m pip install --quiet --upgrade pip
"$work/tools/bin/python" -m pip install --quiet build twine
# python -m build: the sdist from the tree, then the wheel from the sdist (so the sdist rebuilds).
(cd "$work/src" && "$work/tools/bin/python" -m build --outdir "$work/dist" .) >"$work/build.log" 2>&1 || {
    cat "$work/build.log"; echo "CI FAILED (package): python -m build failed (log above)" >&2; exit 1; }
if grep -n -i -E "deprecat" "$work/build.log"; then
    echo "CI FAILED (package): the build warns of a deprecation (lines above; full log: python -m build)" >&2
    exit 1
fi
"$work/tools/bin/twine" check --strict "$work/dist"/*
"$work/tools/bin/python" "$repo/.ci/wheel_check.py" contents "$work/dist" "$repo"

python3 -m venv "$work/user"
"$work/user/bin/python" -m pip install --quiet --upgrade pip
"$work/user/bin/python" -m pip install --quiet "$work/dist"/*.whl
mkdir "$work/run"
(cd "$work/run" && "$work/user/bin/python" -I "$repo/.ci/wheel_check.py" smoke "$repo")
(cd "$work/run" && "$work/user/bin/procpipe-bench" --help >/dev/null) || {
    echo "CI FAILED (package): the procpipe-bench script of the wheel does not start" >&2; exit 1; }
echo "CI: package checks passed"
