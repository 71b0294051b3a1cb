"""The argument checks every module shares, so that the same mistake reads the same everywhere.

A leaf module (it imports nothing from procpipe): ``validate`` (Loader's arguments),
``resume`` (saved states), ``autotune`` (``AutoWorkers``) and ``_sources.stream`` (``Shards``,
stream states) all use it.
"""

from __future__ import annotations

from typing import Any, TypeGuard


def is_count(value: Any, minimum: int) -> TypeGuard[int]:
    """``value`` is an int (not a bool) ``>= minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_int(name: str, value: Any, minimum: int, allow_none: bool = False, owner: str = "") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int ``>= minimum`` (or None if allowed).

    ``owner`` prefixes the message (e.g. ``"AutoWorkers: "``).
    """
    if (value is None and allow_none) or is_count(value, minimum):
        return
    extra = " or None" if allow_none else ""
    raise ValueError(f"{owner}{name} must be an int >= {minimum}{extra}, got {value!r}")
