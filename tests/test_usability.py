"""What a new user trips over: global random generators, silent surprises, the start method.

Each test here pins one user-facing behaviour: code drawing from ``random`` / ``np.random``
/ torch's generator gets distinct, reproducible values per sample; ``fn`` returning torch
tensors, ``None``, an empty dataset, a batch that reserves a lot of ``/dev/shm``.
"""
from __future__ import annotations

import random
import textwrap

import numpy as np
import pytest

import procpipe
from conftest import run_python


class GlobalDraws:
    """``__getitem__`` draws from the global generators, as torchvision-style transforms do."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([np.random.randint(1 << 30), random.getrandbits(30)], dtype=np.int64)


def _draws(workers: int, seed: int = 0, **kw) -> np.ndarray:
    with procpipe.Loader(GlobalDraws(), batch_size=3, workers=workers, seed=seed, **kw) as loader:
        return np.concatenate([b.copy() for b in loader])


def test_global_generators_are_seeded_per_sample():
    two = _draws(2)
    assert len({tuple(row) for row in two}) == len(two), "two samples got the same draws"
    np.testing.assert_array_equal(two, _draws(2), err_msg="not reproducible across runs")
    np.testing.assert_array_equal(two, _draws(1), err_msg="depends on the worker count")
    np.testing.assert_array_equal(two, _draws(0), err_msg="workers=0 differs")
    np.testing.assert_array_equal(two, _draws(2, start_method="forkserver"), err_msg="forkserver differs")
    assert not np.array_equal(two, _draws(2, seed=1)), "the seed does not matter"


def test_workers_0_leaves_the_callers_generators_alone():
    np.random.seed(5)
    random.seed(5)
    expected = (np.random.randint(1 << 30), random.getrandbits(30))
    np.random.seed(5)
    random.seed(5)
    _draws(0)
    assert (np.random.randint(1 << 30), random.getrandbits(30)) == expected


def test_seed_globals_false_leaves_them_alone():
    # With workers=0 and no seeding, the draws continue the caller's stream.
    np.random.seed(7)
    random.seed(7)
    out = _draws(0, seed_globals=False)
    np.random.seed(7)
    random.seed(7)
    expected = [(np.random.randint(1 << 30), random.getrandbits(30)) for _ in range(12)]
    assert [tuple(r) for r in out] == expected


def test_auto_start_method_does_not_fork_a_process_running_threads():
    import threading

    import procpipe._worker.start_method as start_method
    from procpipe._worker import zygote

    # Never fork beside a foreign thread: the zygote made at import (when this process was still
    # safe to fork) where there is one, else the forkserver.
    server = "zygote" if zygote.current() is not None else "forkserver"
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="test-busy-thread")
    thread.start()
    try:
        assert not start_method.fork_is_safe()
        assert start_method.resolve("auto") == server
        with procpipe.Loader(list(range(8)), batch_size=4, workers=1) as loader:
            assert loader.start_method == server  # what its workers were really started with
            assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    finally:
        stop.set()
        thread.join(10)
    assert start_method.resolve("spawn") == "spawn" and start_method.resolve("fork") == "fork"


TORCH_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import procpipe

    class Draw:
        def __len__(self):
            return 8
        def __getitem__(self, i):
            return torch.randint(0, 1 << 30, (1,)).numpy()

    def run(workers):
        with procpipe.Loader(Draw(), batch_size=2, workers=workers, seed=3) as loader:
            return [int(x) for b in loader for x in b.ravel()]

    two, one = run(2), run(1)
    assert len(set(two)) == len(two), two
    assert two == one, (two, one)
    print(",".join(map(str, two)))
""")


def test_torch_generator_is_seeded_per_sample(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "draw_torch.py"
    script.write_text(TORCH_SCRIPT)
    runs = [run_python([str(script)], timeout=240) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert runs[0].stdout == runs[1].stdout, "torch draws differ between runs"


class Images:
    """Image-sized samples: a batch of 32 is 1.5 MiB, far more than a pipe holds."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        return np.full((3, 64, 64), i, np.float32), np.int64(i % 10)


def test_dropping_an_iterator_after_the_first_batch_does_not_kill_workers(monkeypatch):
    """Workers blocked sending large inline batches must see the stop (their replies are
    drained while they stop), not wait to be killed after the 2 s grace period."""
    torch_data = pytest.importorskip("procpipe.torch")
    import procpipe._engine.pool

    killed: list[int] = []
    kill_tree = procpipe._engine.pool.kill_tree
    monkeypatch.setattr(procpipe._engine.pool, "kill_tree", lambda pid, wait=True: (killed.append(pid), kill_tree(pid, wait)))
    # fork: workers that start in milliseconds, so the grace period measures the stop, not a slow start
    loader = torch_data.DataLoader(Images(), batch_size=32, num_workers=2, multiprocessing_context="fork")
    first = next(iter(loader))  # the iterator is dropped at once: its loader closes
    assert first[0].shape == (32, 3, 64, 64)
    assert killed == [], "workers had to be killed: they never saw the stop"


# --------------------------------------------------------------------------- silent surprises
class TensorSamples:
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        import torch

        return {"x": torch.full((2, 3), float(i)), "h": torch.full((2,), i, dtype=torch.bfloat16), "y": i}


@pytest.mark.parametrize("workers", [0, 2])
def test_torch_tensor_samples_are_stacked_into_tensors(workers):
    torch = pytest.importorskip("torch")
    with procpipe.Loader(TensorSamples(), batch_size=4, workers=workers) as loader:
        batches = list(loader)
    first = batches[0]
    assert isinstance(first["x"], torch.Tensor) and first["x"].shape == (4, 2, 3)
    assert first["h"].dtype == torch.bfloat16 and first["h"].shape == (4, 2)
    assert torch.equal(torch.cat([b["x"][:, 0, 0] for b in batches]), torch.arange(10, dtype=torch.float32))
    assert torch.equal(torch.cat([b["h"][:, 0] for b in batches]).float(), torch.arange(10, dtype=torch.float32))
    assert isinstance(first["y"], np.ndarray)


def test_torch_tensor_from_a_collate_fn_or_unbatched_is_a_tensor():
    torch = pytest.importorskip("torch")
    with procpipe.Loader(TensorSamples(), lambda s: s["x"], batch_size=None, workers=2) as loader:
        got = list(loader)
    assert all(isinstance(t, torch.Tensor) and t.shape == (2, 3) for t in got)
    assert [float(t[0, 0]) for t in got] == list(map(float, range(10)))


def forgot_return(sample):
    sample * 2  # no return


@pytest.mark.parametrize("workers", [0, 1])
def test_fn_returning_none_says_so(workers):
    with procpipe.Loader(list(range(8)), forgot_return, batch_size=4, workers=workers) as loader:
        with pytest.raises(TypeError, match=r"fn returned None for index 0.*forget a `return`"):
            list(loader)


def test_none_samples_with_a_collate_fn_are_the_users_business():
    with procpipe.Loader(list(range(4)), forgot_return, batch_size=2, workers=0, collate_fn=len) as loader:
        assert list(loader) == [2, 2]


def test_an_empty_source_warns():
    with pytest.warns(UserWarning, match=r"yields no batch: the source is empty"):
        loader = procpipe.Loader([], batch_size=4, workers=0)
    assert list(loader) == []
    with pytest.warns(UserWarning, match=r"drop_last=True drops the only, partial batch \(3 samples < batch_size=4\)"):
        procpipe.Loader([1, 2, 3], batch_size=4, workers=0, drop_last=True)


def test_a_large_ring_says_so_once(monkeypatch):
    import procpipe._core.rings

    assert procpipe._core.rings.is_large_reservation(2 << 30, 100 << 30)  # over 1 GiB
    assert procpipe._core.rings.is_large_reservation(300 << 20, 1 << 30)  # over a quarter of what is free
    assert not procpipe._core.rings.is_large_reservation(100 << 20, 1 << 30)
    monkeypatch.setattr(procpipe._core.rings, "LARGE_RESERVATION_BYTES", 1024)
    with pytest.warns(UserWarning, match=r"the ring reserves .* slots of .*lower it: a smaller prefetch") as record:
        with procpipe.Loader(np.zeros((64, 256), np.float32), batch_size=8, workers=1) as loader:
            for _ in range(2):
                assert sum(len(b) for b in loader) == 64
    assert sum("the ring reserves" in str(w.message) for w in record) == 1


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
        if path.endswith((".py", ".md", ".toml", ".txt", ".cfg", ".yml", ".yaml")) and path != "tests/test_usability.py":
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
