"""Every file procpipe creates is owner-only and never followed: a planted symlink, ``open_owned``'s
refusals, a directory others can write without the sticky bit, a full ``shm_dir``."""
from __future__ import annotations

import glob
import os
import secrets
import shutil
import stat
import subprocess

import numpy as np
import pytest
from conftest import run_python

from procpipe import Loader

N, BS = 40, 4


def eight(i):
    return np.full(8, i, np.int64)  # 64 bytes a sample: a cache field with no padding


FIXED_TOKEN = "feedbeef"


@pytest.mark.parametrize("name", ["ring0", "cache"])  # (the only files: the rest is anonymous memory, unnamed)
def test_a_planted_symlink_is_never_followed(name, shm_dir, tmp_path, monkeypatch):
    # Another local user can read a loader's prefix; here the prefix is made predictable instead.
    monkeypatch.setattr(secrets, "token_hex", lambda nbytes=None: FIXED_TOKEN)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me")
    target.chmod(0o640)
    link = os.path.join(str(cache_dir) if name == "cache" else shm_dir, f"procpipe-{os.getpid()}-{FIXED_TOKEN}-{name}")
    os.symlink(target, link)
    try:
        with pytest.raises(FileExistsError, match="will not reuse or follow an existing file"):
            with Loader(list(range(N)), eight, batch_size=BS, workers=1, shm_dir=shm_dir, start_method="forkserver",
                        cache=str(cache_dir)) as loader:
                list(loader)
    finally:
        if os.path.islink(link):
            os.unlink(link)
    assert target.read_text() == "keep me"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert os.listdir(cache_dir) == []


def test_every_file_procpipe_creates_is_owner_only(shm_dir, tmp_path):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    old_umask = os.umask(0o022)  # the usual umask: plain open(path, "w") gives 0644
    try:
        with Loader(list(range(N)), eight, batch_size=BS, workers=2, shm_dir=shm_dir, cache=str(cache_dir),
                    start_method="forkserver") as loader:
            list(loader)
            paths = glob.glob(os.path.join(shm_dir, "*")) + glob.glob(os.path.join(cache_dir, "*"))
            modes = {p.rsplit("-", 1)[1]: stat.S_IMODE(os.lstat(p).st_mode) for p in paths}
    finally:
        os.umask(old_umask)
    assert set(modes) == {"ring0", "cache"}  # (the spec, the status words...: anonymous memory, no file)
    assert modes == dict.fromkeys(modes, 0o600)


def test_open_owned_refuses_symlinks_and_shared_files(tmp_path):
    from procpipe._core.shm import open_owned

    mine = tmp_path / "mine"
    mine.write_bytes(b"x")
    mine.chmod(0o600)
    os.close(open_owned(str(mine)))
    os.symlink(mine, tmp_path / "link")
    with pytest.raises(PermissionError, match="symlink"):
        open_owned(str(tmp_path / "link"))
    mine.chmod(0o644)
    with pytest.raises(PermissionError, match="mode 0600"):
        open_owned(str(mine))


@pytest.mark.parametrize("option", ["shm_dir", "cache"])
def test_a_directory_others_can_write_without_sticky_bit_is_refused(option, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"no sticky bit.*chmod \+t"):
        Loader(list(range(N)), eight, batch_size=BS, workers=0, **{option: str(shared)})
    shared.chmod(0o1777)  # like /dev/shm and /tmp: others cannot replace our files
    with Loader(list(range(N)), eight, batch_size=BS, workers=0, **{option: str(shared)}) as loader:
        assert len(list(loader)) == N // BS


FULL_SHM_SCRIPT = r"""
import errno, os, sys
import procpipe

if __name__ == "__main__":
    directory = sys.argv[1]
    try:
        with open(os.path.join(directory, "filler"), "wb") as f:  # fill the filesystem
            while True:
                f.write(b"x" * 4096)
                f.flush()
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    try:
        with procpipe.Loader(list(range(8)), batch_size=2, workers=1, shm_dir=directory) as loader:
            list(loader)  # (the ring is made as the first batch arrives)
        print("no error")
    except procpipe.SharedMemoryError as exc:
        print("SharedMemoryError", directory in str(exc), "leave shm_dir out" in str(exc))
    except Exception as exc:
        print(type(exc).__name__, exc)
    os.unlink(os.path.join(directory, "filler"))
    print("left:", sorted(os.listdir(directory)))
"""


def test_a_full_shm_dir_is_a_shared_memory_error(tmp_path):
    # A real full filesystem, without root: a 256 KiB tmpfs in a user + mount namespace.
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    script = tmp_path / "full.py"
    script.write_text(FULL_SHM_SCRIPT)
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=256k tmpfs "$0"', str(mount_point)],
                           capture_output=True, text=True, timeout=60) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"needs unprivileged user namespaces to mount a small tmpfs: {probe and probe.stderr.strip()}")
    result = run_python(["-c", "import subprocess, sys; sys.exit(subprocess.call(['unshare', '-rm', 'sh', '-c', "
                         "'mount -t tmpfs -o size=256k tmpfs \"$0\" && exec \"$1\" \"$2\" \"$0\"', "
                         f"{str(mount_point)!r}, sys.executable, {str(script)!r}]))"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["SharedMemoryError True True", "left: []"], result.stdout + result.stderr[-3000:]


