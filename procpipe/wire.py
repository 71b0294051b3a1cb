"""Control messages between the coordinator and the workers.

multiprocess's ``Connection.send`` pickles with dill's pure-Python pickler, which costs
tens of microseconds for a small tuple. Control messages are small tuples of ints, lists
and strings, so the C pickler handles them; dill is the fallback for the rare message
that carries user objects the C pickler cannot (lambdas in a sample, say), with the
user's classes kept by reference wherever they can be found (classref.py). Either way
the receiving side uses ``pickle.loads``, which also reads dill's output.
"""
from __future__ import annotations

import pickle
from typing import Any

from . import classref

PROTOCOL = pickle.HIGHEST_PROTOCOL


def send(conn: Any, message: Any) -> None:
    try:
        data = pickle.dumps(message, PROTOCOL)
    except Exception:  # classes pickle cannot find by name, lambdas...: see classref.py
        data = classref.dumps(message, PROTOCOL)
    conn.send_bytes(data)


def recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())
