"""Integration methods: tableaux as data, each with a trial and a plain step."""

from . import tsit5 as tsit5
from ._erk import ExplicitRungeKutta as ExplicitRungeKutta
from ._tableau import ButcherTableau as ButcherTableau


_METHODS = {tsit5.method.name: tsit5.method}


def get(name: str):
    """The method called `name` (a `ValueError` naming the known ones otherwise)."""
    if not isinstance(name, str) or name not in _METHODS:
        raise ValueError(f"method must be one of {sorted(_METHODS)}, got {name!r}")
    return _METHODS[name]


def names() -> tuple[str, ...]:
    return tuple(sorted(_METHODS))
