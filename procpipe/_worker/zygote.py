"""The zygote: a fork server forked from the training process while forking it is still safe.

``start_method="auto"`` forks workers while the process is fork-safe (``fork_safety``).
Once a thread of the program runs (a metrics or logging thread), it cannot: a fresh
forkserver is the fallback, and its start costs a fresh interpreter's imports (Python,
numpy, dill, multiprocess: about 0.3 s) plus the dataset's (torch: seconds). The zygote
avoids both. ``import procpipe`` forks it (``start``), when the process is still safe to
fork: it is a copy of the process as it was then, with every module imported so far
(torch included), and it never runs a second thread. Later, when ``"auto"`` cannot fork
the process itself, workers are forked from the zygote instead (``"zygote"``), through
multiprocess's forkserver protocol (its ``main`` loop and request format, unchanged).

The zygote

- imports procpipe's worker code (``procpipe._worker.process``: numpy, cloudpickle, dill, multiprocess),
  and ``procpipe.torch`` when torch was imported, after it is forked, in the background, so
  neither the import of procpipe nor the workers pay for it; it never imports the main
  script or anything else (a module imported after the zygote was forked, that the
  dataset references, each worker imports itself, as it does a module whose import was
  under way when the zygote was forked: one of the program's that imports procpipe at
  its top);
- holds none of the parent's files, pipes or sockets: every inherited descriptor but
  stdout and stderr is pointed at ``/dev/null`` (its number stays taken, so no Python
  object inherited from the parent closes a descriptor the zygote opens later);
- exits when the training process does (its ``alive`` pipe, as multiprocess's forkserver),
  and removes its socket; its name (``ps``, ``/proc/PID/comm``) is ``procpipe-zygote``. Only
  the training process holds the pipe's write end: a child it forks closes its copy at once
  (``_forget_in_child``), and a worker the copy multiprocess's protocol hands it
  (``start_method.leave_forkserver``), so that a stopped worker cannot keep the zygote alive;
  once the zygote has exited, its workers get their death signal (SIGKILL: _worker/process.py).

It is not forked where it is not wanted: in a process that is not fork-safe at import,
in a worker process multiprocess is starting (one that imports procpipe to unpickle its
target; a process that imports procpipe from the main script it re-imports, such as a
rank of ``torch.multiprocessing.spawn``, is a training process and gets one), in
procpipe's own forkserver, outside Linux, or with ``PROCPIPE_ZYGOTE=0`` in the environment.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass

from . import fork_safety

NAME = "procpipe-zygote"  # the zygote's process name (at most 15 bytes: the kernel's limit)
ENV_SWITCH = "PROCPIPE_ZYGOTE"  # "0": never fork a zygote
_ADAPTERS = (("torch", "procpipe.torch"),)  # (framework, procpipe's adapter the zygote imports beside it)


@dataclass(frozen=True)
class Zygote:
    """The zygote of this process: its pid, socket address, the write end of its alive
    pipe (held by this process only), and the modules imported when it was forked."""

    pid: int
    address: str
    alive_fd: int
    modules: frozenset[str]


_zygote: Zygote | None = None
_owner = 0  # the pid that forked it (a child process does not own its parent's zygote)
_in_zygote = False  # this process is a zygote (or a worker forked from one)


def current() -> Zygote | None:
    """This process's zygote while it runs, else None (never forked, exited, or a parent's)."""
    global _zygote
    if _zygote is None or _owner != os.getpid():
        return None
    try:
        pid, _ = os.waitpid(_zygote.pid, os.WNOHANG)
    except ChildProcessError:
        pid = _zygote.pid
    if pid:
        os.close(_zygote.alive_fd)
        _zygote = None
    return _zygote


def _forget_in_child() -> None:
    """In any child this process forks (a worker, the user's own ``os.fork()``): close the zygote's
    alive pipe. The zygote exits when every copy of it is closed; a child holding one, stopped
    (SIGSTOP, a debugger) or stuck, would keep the zygote, and its workers, alive after the
    training process died."""
    global _zygote
    if _zygote is not None:
        try:
            os.close(_zygote.alive_fd)
        except OSError:
            pass
        _zygote = None


os.register_at_fork(after_in_child=_forget_in_child)


def pid() -> int | None:
    """The pid of this process's zygote, or None (tests leave it out of leak checks)."""
    z = current()
    return z.pid if z is not None else None


def wanted() -> str | None:
    """Why no zygote should be forked in this process (None: one may be)."""
    if _in_zygote:
        return "a zygote, or a worker forked from one"
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if os.environ.get("PROCPIPE_PRELOAD"):
        return "procpipe's forkserver"
    for package in ("multiprocess", "multiprocessing"):
        process, spawn = sys.modules.get(f"{package}.process"), sys.modules.get(f"{package}.spawn")
        inheriting = process is not None and getattr(process.current_process(), "_inheriting", False)
        rerunning_main = bool(getattr(spawn, "old_main_modules", None))  # a training process, e.g. a rank
        if inheriting and not rerunning_main:  # of mp.spawn, re-imports the main script
            return "a worker process multiprocess is starting"
    return fork_safety.why_not_safe()


def start() -> Zygote | None:
    """Fork the zygote now, if there is none and one is wanted (``wanted``); the zygote."""
    global _zygote, _owner
    if current() is not None or wanted() is not None:
        return current()
    directory = tempfile.mkdtemp(prefix="procpipe-zygote-")  # 0700: only this user may connect
    address = os.path.join(directory, "socket")
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(address)
        listener.listen()
        alive_r, alive_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # or each worker would write out a copy of what is buffered
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        with fork_safety.forking():
            child = os.fork()
        if child == 0:  # the zygote
            code = 1
            try:
                os.close(alive_w)
                _serve(listener.fileno(), alive_r)
                code = 0
            finally:
                shutil.rmtree(directory, ignore_errors=True)
                os._exit(code)
        os.close(alive_r)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    finally:
        listener.close()
    _zygote = Zygote(child, address, alive_w, frozenset(sys.modules))
    _owner = os.getpid()
    return _zygote


def _set_name(name: str) -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _neutralize_fds(keep: set[int]) -> None:
    """Point every inherited descriptor but stdin/stdout/stderr and ``keep`` at /dev/null."""
    null = os.open(os.devnull, os.O_RDWR)
    keep = keep | {0, 1, 2, null}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.dup2(null, fd, inheritable=False)
            except OSError:
                pass  # the listing's own descriptor, gone already
    os.close(null)


def _forget_unfinished_imports() -> None:
    """Remove from ``sys.modules`` the modules whose import was under way at the fork: procpipe
    itself, and the program's modules that import procpipe at their top (a dataset module:
    ``import procpipe``, then the dataset class). The zygote never finishes them (it never
    returns from the fork); a worker that needs one imports it afresh, whole."""
    unfinished = [
        name
        for name, module in sys.modules.items()
        if getattr(getattr(module, "__spec__", None), "_initializing", False)
    ]
    for name in unfinished:
        sys.modules.pop(name, None)
        if name != "procpipe":  # (procpipe's finished submodules, this one among them, stay: _relink)
            for sub in [n for n in sys.modules if n.startswith(name + ".")]:
                del sys.modules[sub]


def _relink(package: str) -> None:
    """Bind ``package``'s modules that stayed in ``sys.modules`` as attributes of their parent
    (``procpipe._worker`` on the ``procpipe`` imported afresh): an import binds a submodule
    to its parent only when it loads it."""
    for name, module in list(sys.modules.items()):
        parent, _, child = name.rpartition(".")
        if name.startswith(package + ".") and parent in sys.modules and child not in vars(sys.modules[parent]):
            setattr(sys.modules[parent], child, module)


def _serve(listener_fd: int, alive_r: int) -> None:
    """The zygote's life: drop the parent's descriptors and its unfinished imports, import
    procpipe's worker code, serve fork requests until the training process exits
    (multiprocess's forkserver loop)."""
    global _in_zygote
    _in_zygote = True
    _forget_unfinished_imports()
    parent_name = ""
    try:
        with open("/proc/self/comm") as f:
            parent_name = f.read().strip()
    except OSError:
        pass
    _set_name(NAME)
    os.register_at_fork(after_in_child=lambda: _set_name(parent_name))  # workers keep the program's name
    _neutralize_fds({listener_fd, alive_r})
    # A Ctrl-C in a terminal reaches the whole foreground process group, the zygote included:
    # it is the training process's to handle (the zygote ends with it), so it is ignored here
    # from the start, not only once multiprocess's loop below ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)  # not the program's handlers
    # The workers' code (numpy, cloudpickle, dill, multiprocess), and the adapter of a framework already
    # imported (procpipe.torch.DataLoader's workers unpickle its functions).
    for name in ["procpipe._worker.process"] + [a for f, a in _ADAPTERS if f in sys.modules]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - each worker imports it itself, and reports a failure
            print(f"procpipe: the zygote could not import {name}: {exc!r}", file=sys.stderr)
    _relink("procpipe")
    from multiprocess import forkserver

    try:
        forkserver.main(listener_fd, alive_r, [])
    except SystemExit:
        pass  # the training process exited
