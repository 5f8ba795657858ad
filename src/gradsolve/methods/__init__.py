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


NONSTIFF_DEFAULT = "tsit5"
# Stiff methods in order of preference: fifth-order Rodas5P wherever it runs;
# second-order Rosenbrock23 where it is the only stiff method (the fused kernels).
STIFF_PREFERENCE = ("rodas5p", "rosenbrock23")


def default_for(stiff: bool, runs=None) -> str:
    """The method a request that names none gets -- the one rule for every engine:
    Tsit5 for non-stiff problems; for stiff ones the first of `STIFF_PREFERENCE`
    among `runs` (the methods an engine runs; None: all), else Rodas5P (which the
    engine then refuses by name).

    Examples:
        >>> from gradsolve import methods
        >>> methods.default_for(False), methods.default_for(True)
        ('tsit5', 'rodas5p')
        >>> methods.default_for(True, runs=("tsit5", "rosenbrock23"))
        'rosenbrock23'
    """
    if not stiff:
        return NONSTIFF_DEFAULT
    runs = names() if runs is None else runs
    return next((m for m in STIFF_PREFERENCE if m in runs), STIFF_PREFERENCE[0])
