"""Control messages between the coordinator and the workers.

multiprocess's ``Connection.send`` pickles with dill's pure-Python pickler, which costs
tens of microseconds for a small tuple. Control messages are small tuples of ints, lists
and strings, so the C pickler handles them; dill is the fallback for the rare message
that carries user objects the C pickler cannot (lambdas in a sample, say). Either way
the receiving side uses ``pickle.loads``, which also reads dill's output.
"""
from __future__ import annotations

import pickle
from typing import Any

import dill

PROTOCOL = pickle.HIGHEST_PROTOCOL


def send(conn: Any, message: Any) -> None:
    try:
        data = pickle.dumps(message, PROTOCOL)
    except Exception:
        data = dill.dumps(message, PROTOCOL)
    conn.send_bytes(data)


def recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())
