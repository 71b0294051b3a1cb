"""Control messages between the coordinator and the workers.

multiprocess's ``Connection.send`` pickles with dill's pure-Python pickler, which costs
tens of microseconds for a small tuple. Control messages are small tuples of ints, lists
and strings, so the C pickler handles them; dill is the fallback for the rare message
that carries user objects the C pickler cannot (lambdas in a sample, say), with the
user's classes kept by reference wherever they can be found (classref.py). Either way
the receiving side uses ``pickle.loads``, which also reads dill's output.

The coordinator thread must never block (it also runs the watchdog, and it reads every
worker's replies), yet a task names every index of its batch (about 5 bytes each) and a
worker busy in a slow sample does not read its pipe: ``Connection.send_bytes`` of a large
task would wait for it. So the coordinator writes through an ``Outbox`` instead: each
message is framed as ``Connection.recv_bytes`` reads it (a 4-byte big-endian length, or
-1 and an 8-byte one; the format multiprocessing keeps for wire compatibility), and
written with ``MSG_DONTWAIT``; what the pipe does not take now waits in the outbox until
the selector says the pipe is writable again. Reading goes the same way (``Inbox``): every
byte waiting, in one non-blocking read, split into whole messages (the coordinator reads a
worker's replies so, and a worker its queued tasks).

A message may carry descriptors (``Outbox.put(message, fds)``: a ring's shared memory, sent
to a worker that must map it, ``MapRing``). They travel with its bytes as ``SCM_RIGHTS``
ancillary data (the pipes are Unix socket pairs), never later than the message itself; an
``Inbox`` made ``with_fds`` keeps those it receives, in order, in ``fds``, for the messages
that announced them to take (one each).
"""

from __future__ import annotations

import array
import itertools
import os
import pickle
import socket
import struct
from collections import deque
from typing import Any

from . import classref
from .messages import STOP, WIRE_TYPES

PROTOCOL = pickle.HIGHEST_PROTOCOL
_DONTWAIT = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL  # never block; a closed peer is an error, not SIGPIPE


# A message (messages.py) travels as the plain tuple ``(tag, *fields)``, ``STOP`` as None:
# pickling a named tuple goes through copyreg (about 5 us each way, against 1 for a tuple),
# a cost paid twice per batch on each side.
_TAGS = {kind: tag for tag, kind in enumerate(WIRE_TYPES)}
_new_tuple = tuple.__new__


def encode(message: Any) -> bytes:
    """``message`` (a message of messages.py, or ``STOP``) pickled: by the C pickler, or by
    dill when it cannot (user objects in a batch's inline values)."""
    if message is not STOP:
        message = (_TAGS[type(message)], *message)
    try:
        return pickle.dumps(message, PROTOCOL)
    except Exception:  # noqa: BLE001 - pickle fails in many types (classes it cannot find by name, lambdas...): see classref.py
        return classref.dumps(message, PROTOCOL)


def encode_value(value: Any) -> bytes:
    """``value`` pickled as ``encode`` would pickle it inside a message (raises if it cannot be)."""
    try:
        return pickle.dumps(value, PROTOCOL)
    except Exception:  # noqa: BLE001 - as in encode: whatever pickle refuses, classref tries
        return classref.dumps(value, PROTOCOL)


def send(conn: Any, message: Any, fds: tuple[int, ...] | list[int] = ()) -> None:
    """Send ``message`` on a ``Connection``, blocking until the pipe takes it (workers' side; a
    Ray agent's to its workers), with ``fds`` (descriptors, ``SCM_RIGHTS``) if any."""
    if not fds:
        conn.send_bytes(encode(message))
        return
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setblocking(True)
        data = frame(encode(message))
        sent = socket.send_fds(sock, [data], list(fds))
        if sent < len(data):
            sock.sendall(memoryview(data)[sent:])


def decode(data: bytes) -> Any:
    """The message ``encode`` wrote."""
    return from_wire(pickle.loads(data))


def from_wire(wired: Any) -> Any:
    """The message of an unpickled ``(tag, *fields)`` tuple (or ``STOP``)."""
    if wired is STOP:
        return STOP
    return _new_tuple(WIRE_TYPES[wired[0]], wired[1:])


def recv(conn: Any) -> Any:
    return decode(conn.recv_bytes())


def frame(data: bytes) -> bytes:
    """``data`` with the length header ``Connection.recv_bytes`` expects."""
    n = len(data)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return header + data


_CHUNK = 1 << 16  # what one read asks for, at least
_GATHER = 64  # messages written by one system call, at most
_MAX_FDS = 64  # descriptors one read can receive (the messages of one write carry a few at most)
_FD_SIZE = struct.calcsize("i")


class Inbox:
    """Messages from one ``Connection`` (a socket pair end), read without ever blocking.

    ``receive`` takes every byte the socket holds now, most often in one system call, and
    returns the whole frames among them (``Connection.recv_bytes``'s format, which ``frame``
    writes); a frame not whole yet stays here until the rest arrives. Reading a reply
    through ``Connection.recv_bytes`` costs a poll and two reads each (length, then body);
    the replies and tasks of small batches arrive several at once. Like ``Outbox``, it reads
    through its own duplicate of the connection's descriptor, which stays in blocking mode.
    """

    def __init__(self, conn: Any, with_fds: bool = False) -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._sock.setblocking(True)
        self._buffer = bytearray()
        self._need = 0  # bytes the buffer lacks for its first frame to be whole (0: unknown or none)
        self.closed = False  # the other end is gone (or this one was closed): nothing more will come
        # with_fds: the descriptors that arrived (module doc), oldest first; else any sent are dropped
        self._ancillary = socket.CMSG_SPACE(_MAX_FDS * _FD_SIZE) if with_fds else 0
        self.fds: deque[int] = deque()

    def fileno(self) -> int:
        return self._sock.fileno()

    def receive(self) -> list[bytes]:
        """The whole frames that arrived, in order ([] if none); ``closed`` says whether more may come."""
        if self.closed:
            return []
        buffer = self._buffer
        while True:
            size = max(_CHUNK, self._need)
            try:
                if self._ancillary:
                    chunk, ancillary, _, _ = self._sock.recvmsg(size, self._ancillary, _DONTWAIT)
                    if ancillary:
                        self._keep_fds(ancillary)
                else:
                    chunk = self._sock.recv(size, _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # (reset by a peer that died)
                self.closed = True
                break
            if not chunk:
                self.closed = True
                break
            buffer += chunk
            if len(chunk) < size:
                break  # the socket is drained: asking again would only say so
            self._need = max(0, self._need - len(chunk))  # (a large frame: the rest in one read)
        return self._frames()

    def _keep_fds(self, ancillary: list[tuple[int, int, bytes]]) -> None:
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                count = len(data) // _FD_SIZE
                self.fds.extend(struct.unpack(f"{count}i", data[: count * _FD_SIZE]))

    def _frames(self) -> list[bytes]:
        buffer = self._buffer
        frames = []
        start, end = 0, len(buffer)
        unpack_from = struct.unpack_from
        self._need = 0
        while end - start >= 4:
            (n,) = unpack_from("!i", buffer, start)
            header = 4
            if n == -1:
                if end - start < 12:
                    break
                (n,) = unpack_from("!Q", buffer, start + 4)
                header = 12
            if end - start < header + n:
                self._need = header + n - (end - start)
                break
            frames.append(bytes(buffer[start + header : start + header + n]))
            start += header + n
        if start:
            del buffer[:start]
        return frames

    def close(self) -> None:
        self.closed = True
        self._buffer.clear()
        self._sock.close()
        while self.fds:
            _close_quietly(self.fds.popleft())


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class Outbox:
    """Messages for one ``Connection`` (a socket pair end), written without ever blocking.

    ``put`` queues a message; ``flush`` writes what the socket takes now and says whether
    anything is left, for the caller to wait for ``fileno()`` to become writable. The
    outbox writes through its own duplicate of the connection's descriptor, so the caller
    can watch it for writability separately from the connection's readability. The
    descriptor stays in blocking mode (the connection's reads rely on it); only the
    writes here are non-blocking (``MSG_DONTWAIT``).
    """

    def __init__(self, conn: Any) -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._sock.setblocking(True)  # (a global socket.setdefaulttimeout would have cleared it)
        self._frames: deque[bytes | memoryview] = deque()
        self._started = False  # the first frame is partly written
        self.broken = False  # the other end is gone: messages are dropped
        # Descriptors to send, as (the number of the frame they go with, our duplicates of them):
        # frames are numbered in the order put, ``_written`` of them are written whole.
        self._fds: deque[tuple[int, list[int]]] = deque()
        self._put = 0
        self._written = 0

    @property
    def pending(self) -> bool:
        """Messages (or the rest of one) wait for the pipe to take them."""
        return bool(self._frames)

    def fileno(self) -> int:
        return self._sock.fileno()

    def put(self, message: Any, fds: tuple[int, ...] = ()) -> None:
        """Queue ``message`` (written by the next ``flush``), with duplicates of ``fds`` (sent
        with its bytes, module doc; the caller keeps its own)."""
        if self.broken:
            return
        if fds:
            self._fds.append((self._put, [os.dup(fd) for fd in fds]))
        self._frames.append(frame(encode(message)))
        self._put += 1

    def flush(self) -> bool:
        """Write what the pipe takes now, never blocking; True once nothing is left. The
        messages queued go in one system call (gathered), not one each."""
        frames = self._frames
        sock = self._sock
        while frames:
            try:
                if self._fds and self._fds[0][0] < self._written + _GATHER:
                    n = self._send_with_fds()
                elif len(frames) == 1:
                    n = sock.send(frames[0], _DONTWAIT)
                else:
                    n = sock.sendmsg(list(itertools.islice(frames, _GATHER)), (), _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:  # the worker is gone: its death is handled by its sentinel
                self.broken = True
                frames.clear()
                self._drop_fds()
                return True
            while frames:  # the frames written whole go; a frame written in part keeps its rest
                head = frames[0]
                if n < len(head):
                    if n:
                        frames[0] = memoryview(head)[n:]
                        self._started = True
                    return False
                n -= len(head)
                frames.popleft()
                self._written += 1
                self._started = False
                if not n:
                    break
        return True

    def _send_with_fds(self) -> int:
        """Write the next frames with the descriptors of those among them (they go with the first
        byte written: never after their message); the bytes written."""
        gathered = list(itertools.islice(self._frames, _GATHER))
        last = self._written + len(gathered)
        sending: list[int] = []
        while self._fds and self._fds[0][0] < last and len(sending) < _MAX_FDS:
            sending.extend(self._fds.popleft()[1])
        try:
            n = self._sock.sendmsg(
                gathered, [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", sending))], _DONTWAIT
            )
        except BaseException:
            self._fds.appendleft((self._written, sending))  # not sent: with the next try
            raise
        for fd in sending:
            _close_quietly(fd)
        return n

    def drop_unsent(self) -> None:
        """Forget the messages not begun (a message partly written is kept, so the stream stays whole)."""
        keep = self._frames[0] if self._started else None
        self._frames.clear()
        self._put = self._written
        if keep is not None:
            self._frames.append(keep)
            self._put += 1
        self._drop_fds()

    def _drop_fds(self) -> None:
        while self._fds:
            for fd in self._fds.popleft()[1]:
                _close_quietly(fd)

    def close(self) -> None:
        self._frames.clear()
        self._drop_fds()
        self.broken = True
        self._sock.close()
