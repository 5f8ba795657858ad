"""Integration methods: tableaux as data, each with a trial and a plain step."""

from . import rodas5p as rodas5p, rosenbrock23 as rosenbrock23, tsit5 as tsit5, vern7 as vern7
from ._base import Method as Method
from ._erk import ExplicitRungeKutta as ExplicitRungeKutta
from ._rosenbrock import Rosenbrock as Rosenbrock, Rosenbrock23 as Rosenbrock23
from ._rosenbrock_tableau import RosenbrockTableau as RosenbrockTableau
from ._tableau import ButcherTableau as ButcherTableau


_METHODS = {m.method.name: m.method for m in (tsit5, vern7, rosenbrock23, rodas5p)}


def get(name: str):
    """The method called `name` (a `ValueError` naming the known ones otherwise)."""
    if not isinstance(name, str) or name not in _METHODS:
        raise ValueError(f"method must be one of {sorted(_METHODS)}, got {name!r}")
    return _METHODS[name]


def names() -> tuple[str, ...]:
    return tuple(sorted(_METHODS))
