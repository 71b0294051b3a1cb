"""The documentation as a reader meets it: the README's links resolve into the repository, every
page is in the site's navigation, and the package declares its type hints (``py.typed``)."""
from __future__ import annotations


# --------------------------------------------------------------------------- docs and packaging
def _slug(heading: str) -> str:
    """A heading's anchor as MkDocs makes it (Markdown's toc): markup and punctuation dropped,
    lower case, runs of spaces and dashes to one dash (GitHub's anchors agree on these headings)."""
    import re

    text = re.sub(r"[^\w\s-]", "", heading.strip().replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: str) -> set[str]:
    """The anchors of a Markdown file's headings (outside fenced code)."""
    anchors, fenced = set(), False
    with open(path) as f:
        for line in f:
            fenced ^= line.startswith("```")
            if not fenced and line.startswith("#"):
                anchors.add(_slug(line.lstrip("#")))
    return anchors


def test_readme_links_into_the_docs_resolve_and_nothing_points_outside_the_repository():
    """README is the front page: its links are relative paths to docs/*.md files (there is no
    hosted site) and to its own headings, and each must exist, anchor included."""
    import os
    import re
    import subprocess

    from conftest import REPO_ROOT

    readme_path = os.path.join(REPO_ROOT, "README.md")
    with open(readme_path) as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 300, "README.md is the front page; the guide belongs in docs/"
    assert "## Two commands" in readme
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    into_docs = [link for link in local if link.startswith("docs/")]
    assert len(into_docs) >= 10, into_docs
    broken = []
    for link in local:
        path, _, anchor = link.partition("#")
        target = os.path.join(REPO_ROOT, path) if path else readme_path
        if not os.path.isfile(target) or (anchor and anchor not in _anchors(target)):
            broken.append(link)
    assert broken == []
    assert re.search(r"the whole suite takes about \d+(-\d+)? minutes", readme)  # the test time is stated
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True).stdout.split()
    mentions = []
    for path in tracked:
        if path.endswith((".py", ".md", ".toml", ".txt", ".cfg", ".yml", ".yaml")) and path != "tests/test_docs_site.py":
            with open(os.path.join(REPO_ROOT, path), errors="replace") as f:
                if "TARGETS" + ".md" in f.read():
                    mentions.append(path)
    assert mentions == []


def test_every_docs_page_is_in_the_site_navigation():
    """A page missing from mkdocs.yml's nav is not reachable on the site (and a nav entry whose
    page is missing breaks the build); checked here too, since the suite runs without mkdocs."""
    import os
    import re

    from conftest import REPO_ROOT

    with open(os.path.join(REPO_ROOT, "mkdocs.yml")) as f:
        nav = set(re.findall(r"^\s*-\s+(?:[^\n]*?:\s+)?([\w./-]+\.md)\s*$", f.read(), re.M))
    docs = os.path.join(REPO_ROOT, "docs")
    pages = {os.path.relpath(os.path.join(d, name), docs)
             for d, _, names in os.walk(docs) for name in names if name.endswith(".md")}
    assert pages and pages == nav, (sorted(pages - nav), sorted(nav - pages))


def test_the_package_declares_its_type_hints():
    import os

    from conftest import REPO_ROOT

    assert os.path.isfile(os.path.join(REPO_ROOT, "procpipe", "py.typed"))
    with open(os.path.join(REPO_ROOT, "pyproject.toml")) as f:
        assert 'procpipe = ["py.typed"]' in f.read()
